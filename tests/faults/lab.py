"""The soak's world: tiny checkpoints, a signing key, reference digests and a prepared registry,
made once; then one home per trial, where the real `flare` command runs as a subprocess.

Everything a trial touches lives in its own folder (FLARE_HOME, the registry, the host cache,
mounts), so a trial can be run again alone from its kind and seed.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

KILLSHIM = Path(__file__).with_name("killshim.py")
COMMAND_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Config:
    """Build options of a reference package."""

    name: str
    options: tuple[str, ...]


CONFIGS = {
    "r1": Config("r1", ("--payload-size", "16K")),
    "r2": Config("r2", ("--ranks", "2", "--payload-size", "16K")),
    "r1-big": Config("r1-big", ("--payload-size", "64K")),
}


@dataclass(frozen=True)
class Package:
    """A package of the prepared registry: built from `source` with `config` as NAME:TAG."""

    name: str
    source: str
    config: str
    tag: str

    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


BASE_PACKAGES = [
    Package("tiny", "ck", "r1", "latest"),
    Package("tiny", "ck", "r2", "tp2"),
    Package("other", "ck2", "r1", "latest"),
    Package("other", "ck2", "r2", "v1"),
    Package("scratch", "ck", "r1-big", "latest"),
]
"""The prepared registry: tiny:latest, tiny:tp2 (pinned) and other:latest are live; other's r2
package is recorded but untagged (v1 was moved) and scratch was removed: garbage for gc."""
LIVE = ["tiny:latest", "tiny:tp2", "other:latest"]
PULLABLE = ["tiny:latest", "other:latest"]
"""The live packages a CPU host can pull (one rank)."""


@dataclass
class Run:
    """A finished (or killed) `flare` command."""

    args: list[str]
    rc: int
    out: str
    err: str
    seconds: float
    timed_out: bool = False
    env: dict[str, str] | None = None

    def command(self) -> str:
        """The command line as a user would type it, with the settings that differ."""
        shown = {k: v for k, v in (self.env or {}).items() if k.startswith(("FLARE_", "SOAK_"))}
        prefix = " ".join(f"{k}={v}" for k, v in sorted(shown.items()))
        return f"{prefix} flare {' '.join(self.args)}".strip()

    def message(self) -> str:
        """flare's error (from its last `error:` line on), else the last line of stderr."""
        lines = [line for line in self.err.splitlines() if line.strip()]
        starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
        return " ".join(lines[starts[-1] if starts else -1 :]) if lines else ""

    def json(self) -> object:
        return json.loads(self.out)


class Home:
    """One host: its FLARE_HOME (staging area, host cache) and the registry it uses."""

    def __init__(self, root: Path, xdg: Path, registry: Path | None = None, database: str = ""):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLARE_", "SOAK_"))}
        env |= {
            "FLARE_HOME": str(root),
            "XDG_CONFIG_HOME": str(xdg),
            "FLARE_MEMORY_RESERVE": "0",
            "FLARE_BUILD_TARGET": "none",  # eager packages: a trial never compiles
            "FLARE_REGISTRY": str(registry or root / "registry"),
        }
        if database:
            env["FLARE_DATABASE"] = database
        self.env = env

    @property
    def registry(self) -> Path:
        return Path(self.env["FLARE_REGISTRY"])

    @property
    def cache(self) -> Path:
        return self.root / "packages"

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    def argv(self, args: tuple[str, ...], kill_at: str | None) -> list[str]:
        entry = [str(KILLSHIM)] if kill_at else ["-m", "flare"]
        return [sys.executable, *entry, *args]

    def environment(self, extra: dict[str, str] | None, kill_at: str | None) -> dict[str, str]:
        env = {**self.env, **(extra or {})}
        if kill_at:
            env["SOAK_KILL_AT"] = kill_at
        return env

    def run(
        self,
        *args: str,
        timeout: float = COMMAND_TIMEOUT_S,
        env: dict[str, str] | None = None,
        kill_at: str | None = None,
        memory_limit: int | None = None,
    ) -> Run:
        """Run a command to its end (killed, with timed_out set, past the timeout)."""
        process = self.start(*args, env=env, kill_at=kill_at, memory_limit=memory_limit)
        return self.finish(process, args, timeout, env, kill_at)

    def finish(
        self,
        process: subprocess.Popen[str],
        args: tuple[str, ...] | list[str],
        timeout: float = COMMAND_TIMEOUT_S,
        env: dict[str, str] | None = None,
        kill_at: str | None = None,
        kill: bool = False,
    ) -> Run:
        """Wait for a started command; SIGKILL it after `timeout` s: on purpose with `kill`,
        else as a command that hung (timed_out)."""
        started = time.monotonic()
        try:
            out, err = process.communicate(timeout=timeout)
            late = False
        except subprocess.TimeoutExpired:
            kill_group(process)
            out, err = process.communicate()
            late = not kill
        seconds = time.monotonic() - started
        full_env = self.environment(env, kill_at)
        return Run(list(args), process.returncode, out, err, seconds, late, full_env)

    def start(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        kill_at: str | None = None,
        memory_limit: int | None = None,
    ) -> subprocess.Popen[str]:
        """Start a command in its own process group (gc's sweep forks: a kill takes all),
        its address space limited to `memory_limit` bytes if given."""

        def limit() -> None:
            if memory_limit is not None:
                resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

        return subprocess.Popen(
            self.argv(args, kill_at),
            env=self.environment(env, kill_at),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=limit,
        )

    def kill_after(self, delay: float, *args: str, env: dict[str, str] | None = None) -> Run:
        """Start a command and SIGKILL it after `delay` seconds, as a host dies."""
        return self.finish(self.start(*args, env=env), args, delay, env, kill=True)


def kill_group(process: subprocess.Popen[str]) -> None:
    """SIGKILL the process and everything it forked."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


class Lab:
    """What every trial shares, made once: checkpoints, a trusted signing key, the prepared
    registry, reference digests (uninterrupted builds) and how long each command takes."""

    def __init__(self, root: Path, postgres: str | None = None) -> None:
        self.root = root
        self.postgres = postgres
        self.xdg = root / "xdg"
        self.digests: dict[tuple[str, str, str], str] = {}
        """(name, source, config) -> the digest of an uninterrupted build."""
        self.seconds: dict[str, float] = {}
        """How long each command took on the prepared registry (the range of random kills)."""
        self.payloads: dict[str, int] = {}
        """Payload blobs per config, for assemble's crash points."""
        self.garbage = 0
        """Blobs a gc deletes in the prepared registry."""
        self.trials = root / "trials"

    # -- made once --------------------------------------------------------------------------

    def prepare(self) -> Lab:
        from flare.build.tiny import make_tiny_llama

        for source, seed in (("ck", 0), ("ck2", 1)):
            make_tiny_llama(self.root / source, seed=seed)
        self._check(self.home("key").run("key", "generate", "--publisher", "soak"))
        base = self.home("base")
        for package in BASE_PACKAGES:
            self._reference(base, package)
        self._check(base.run("registry", "tag", "other:latest", "other:v1"))
        self._check(base.run("registry", "rm", "scratch"))
        self._check(base.run("registry", "pin", "tiny:tp2"))
        self._time_commands()
        return self

    def _reference(self, home: Home, package: Package) -> None:
        started = time.monotonic()
        done = home.run(*self.build_args(package.name, package.source, package.config, package.tag))
        self._check(done)
        key = (package.name, package.source, package.config)
        self.digests[key] = str(done.json()["digest"])  # type: ignore[index]
        self.seconds.setdefault("build", time.monotonic() - started)
        manifest = json.loads(home.run("registry", "show", package.ref(), "--json").out)
        self.payloads[package.config] = len(manifest["manifest"]["payloads"])

    def _time_commands(self) -> None:
        for command, args in {
            "pull": ("pull", "tiny", "--device", "cpu"),
            "copy": ("registry", "copy", "tiny:tp2", "--to", "{dest}"),
            "gc": ("registry", "gc", "--grace", "0"),
            "reindex": ("registry", "reindex"),
        }.items():
            home = self.home(f"timing-{command}", base=True)
            dest = str(home.root / "dest")
            self._check(done := home.run(*(a.format(dest=dest) for a in args), "--json"))
            self.seconds[command] = done.seconds
            if command == "gc":
                self.garbage = len(done.json()["deleted"])  # type: ignore[index]
            shutil.rmtree(home.root)

    def _check(self, done: Run) -> None:
        if done.rc != 0:
            raise RuntimeError(f"preparing the soak: {done.command()} exited {done.rc}: {done.err}")

    # -- per trial --------------------------------------------------------------------------

    def source(self, name: str) -> Path:
        return self.root / name

    def build_args(self, name: str, source: str, config: str, tag: str = "latest") -> list[str]:
        options = CONFIGS[config].options
        return ["build", str(self.source(source)), "--name", name, "--tag", tag, *options, "--json"]

    def home(self, name: str, base: bool = False) -> Home:
        """A host folder under the lab, for preparing it."""
        return self.host(self.root / name, base)

    def host(
        self, root: Path, base: bool = False, registry: Path | None = None, database: str = ""
    ) -> Home:
        """A host at root; with `base`, its registry starts as a copy of the prepared one."""
        home = Home(root, self.xdg, registry, database)
        if base:
            self.copy_base(home.registry)
        return home

    def copy_base(self, registry: Path) -> None:
        """A copy of the prepared registry (its SQLite index included) at `registry`."""
        shutil.copytree(self.root / "base" / "registry", registry, symlinks=True)

    def digest(self, name: str, source: str, config: str) -> str:
        return self.digests[(name, source, config)]


def write_filler(folder: Path) -> None:
    """Fill a filesystem to the last byte (a file that grows until ENOSPC)."""
    with open(folder / f"filler-{secrets.token_hex(4)}", "wb", buffering=0) as handle:
        chunk = b"\0" * 4096
        try:
            while handle.write(chunk):
                pass
        except OSError:
            pass


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small real filesystem at path (root only), unmounted whatever happens."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def remount(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root, with CAP_SYS_ADMIN)."""
    return os.geteuid() == 0 and shutil.which("mount") is not None
