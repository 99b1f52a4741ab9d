"""Every install line installs this project: `flare` on PyPI is someone else's package, so
pip must know flare by a name of its own, and every `pip install` a user is told to run
(README, docs, flare's own error hints) must name a clone or that name."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import RunFlare

from flare import __version__
from flare.extras import DISTRIBUTION, install_hint

ROOT = Path(__file__).resolve().parent.parent
PIP_INSTALL = re.compile(r"pip install\s+((?:-[a-zA-Z-]+\s+)*)(['\"]?)([^\s'\"`]+)")
"""A `pip install` command in text, its options, and its first requirement (or path)."""


def _requirement_name(text: str) -> str:
    return re.split(r"[\[<>=!~;\s]", text, maxsplit=1)[0].lower().replace("_", "-")


def test_pip_knows_flare_by_its_own_name_and_the_extras_name_it_too() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION != "flare"
    assert project["scripts"] == {"flare": "flare.__main__:main"}
    requirements = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    names = {_requirement_name(r) for r in requirements}
    assert "flare" not in names, "an extra that names `flare` pulls PyPI's flare, not this one"
    assert DISTRIBUTION in names  # gpu and test build on serve


def _install_lines() -> list[tuple[str, str]]:
    """(file, requirement) for every `pip install` in the README, the docs and the code."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for p in sorted(ROOT.rglob("*.py")) if ".venv" not in p.parts]
    found = []
    for path in files:
        for match in PIP_INSTALL.finditer(path.read_text()):
            found.append((str(path.relative_to(ROOT)), match[3]))
    return found


def test_every_install_line_installs_this_project() -> None:
    lines = _install_lines()
    assert len(lines) >= 8  # the README's, the docs' and the hints' (the pattern finds them)
    wrong = [
        (where, requirement)
        for where, requirement in lines
        if not requirement.startswith(".")  # a clone: -e '.[serve]'
        and _requirement_name(requirement) != DISTRIBUTION
        and "{" not in requirement  # the hint's own f-string, checked below
    ]
    assert not wrong, wrong


def test_install_hints_name_the_distribution() -> None:
    assert install_hint("serve") == f"pip install '{DISTRIBUTION}[serve]'"


def test_the_s3_hint_of_a_missing_filesystem_installs_flare(run_flare: RunFlare) -> None:
    done = run_flare("store", "ls", "--store", "s3://bucket/flare")
    assert done.returncode == 4, done.stderr
    assert f"pip install '{DISTRIBUTION}[s3]'" in done.stderr


def test_flare_version_says_the_package_format_and_runtime_abi(run_flare: RunFlare) -> None:
    done = run_flare("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"flare {__version__} (package format 1, runtime ABI 1)\n"


def test_demo_without_the_serve_extra_says_what_to_install_before_building(
    flare_env: dict[str, str], tmp_path: Path
) -> None:
    """httpx (the demo's HTTP client) hidden as pip would leave it out: the demo must stop
    before it builds or publishes anything."""
    hide = "import sys; sys.modules['httpx'] = None; from flare.__main__ import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hide, "demo"],
        env=flare_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: flare demo needs httpx, which is not installed; {install_hint('serve')}"
    ]
    assert not (tmp_path / "home" / "registry").exists()


def test_serve_checks_every_module_of_its_extra_before_it_starts() -> None:
    """A host installed before the serve extra grew (httptools and uvloop came later) must be
    told what to install, not fail inside uvicorn with an ImportError."""
    from flare.serve.launch import SERVE_MODULES

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {_requirement_name(r) for r in project["optional-dependencies"]["serve"]}
    assert {m.replace("_", "-") for m in SERVE_MODULES} == extra
