"""The `flare` command: the root app, the command groups and commands wired onto it, and the
one mapping from errors to exit codes.

Each component owns its commands (`store/commands.py`, `sign/commands.py`,
`registry/commands.py`, `registry/signature_commands.py`, `build/commands.py`,
`serve/commands.py`); their shared options and printers are in `cli_common.py`. Here are only
the commands that belong to no one component: the demo (build, then serve) and the config."""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import closing
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from flare.build.commands import build_command, join_command
from flare.cli_common import JsonOption, NoTruncOption, err, out, print_json, print_table
from flare.config import SETTINGS, load_config
from flare.errors import FlareError, from_os_error
from flare.registry.commands import registry_app
from flare.registry.signature_commands import sign_command, verify_command
from flare.serve.commands import pull_command, serve_command
from flare.serve.host_commands import cache_app, ps_command
from flare.sign.commands import key_app, trust_app
from flare.store.commands import store_app
from flare.store.package import version_line

_state = {"debug": bool(os.environ.get("FLARE_DEBUG"))}

app = typer.Typer(
    help="flare: reproducible, signed runtime packages for LLM checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)
config_app = typer.Typer(help="The effective configuration.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
app.add_typer(store_app, name="store")
app.add_typer(config_app, name="config")
app.add_typer(key_app, name="key")
app.add_typer(trust_app, name="trust")
app.add_typer(cache_app, name="cache")


def _print_version(wanted: bool) -> None:
    if wanted:
        out.print(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    _version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help=version_line())
    ] = False,
) -> None:
    """Options for every command."""
    _state["debug"] = _state["debug"] or debug


app.command("build")(build_command)
app.command("join")(join_command)

DEMO_QUESTION = "what does the registry keep?"


@app.command("demo")
def demo_command(as_json: JsonOption = False) -> None:
    """The main job on the embedded default: a tiny seeded model built, published, signed with
    a development key, pulled, served, and asked one question over the HTTP API."""
    from flare.build.commands import build_demo, print_build
    from flare.serve.engine_process import EngineProcess
    from flare.serve.launch import ask_served, require_serve_extra

    require_serve_extra("flare demo")
    with closing(EngineProcess()) as engine:  # its start-up runs beside the build
        result = build_demo()
        if not as_json:
            print_build(result, as_json)
        answer = ask_served(f"{result.name}@{result.digest.hex}", DEMO_QUESTION, engine)
    if as_json:
        phases = [asdict(p) for p in result.phases]
        print_json({"name": result.name, "digest": str(result.digest), "phases": phases} | answer)
        return
    out.print(f"signed by {answer['publisher']}; served at {answer['url']}", markup=False)
    out.print(f"asked:  {DEMO_QUESTION}", markup=False)
    out.print(f"answer: {answer['answer']!r} (a tiny random model: words are not expected)")


app.command("sign")(sign_command)
app.command("verify")(verify_command)
app.command("pull")(pull_command)
app.command("serve")(serve_command)
app.command("ps")(ps_command)


@config_app.command("show")
def config_show(as_json: JsonOption = False, _no_trunc: NoTruncOption = False) -> None:
    """Print every effective setting and where it came from."""
    config = load_config()
    rows = [(key, _show(v.value), v.source) for key, v in config.values.items()]
    if as_json:
        print_json(
            {
                "file": str(config.file),
                "home": str(config.home),
                "settings": {k: {"value": v, "source": s} for k, v, s in rows},
            }
        )
        return
    out.print(f"config file: {config.file}{'' if config.file.exists() else ' (absent)'}")
    about = {s.key: (s.env, s.help) for s in SETTINGS}
    print_table(
        "",
        ("setting", "value", "source", "variable", "meaning"),
        [(*row, *about[row[0]]) for row in rows],
    )


def _show(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def main() -> None:
    """Run the CLI; user errors become one line on stderr and a meaningful exit code."""
    try:
        app(prog_name="flare")  # also as `python -m flare`: one name for help and completion
    except FlareError as exc:
        _fail(str(exc), exc.exit_code)
    except OSError as exc:
        error = from_os_error(exc, "access", exc.filename or "a file")
        _fail(str(error), error.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:  # a bug: say so, and how to see more
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for details)", 1)


def _fail(message: str, code: int) -> None:
    if _state["debug"]:
        traceback.print_exc()
    err.print(f"error: {message}", markup=False)
    sys.exit(code)
