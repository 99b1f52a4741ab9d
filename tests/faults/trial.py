"""One trial: its seeded random numbers, folder and homes, the faults it injected and caught,
and the invariant checks every kind of trial shares (nothing lost, listings complete, refs
sound, verify exact, a build resumed to a clean state). The kinds of trial are in kills.py,
damage.py, hosts.py and inputs.py; trials.py is their catalogue."""

from __future__ import annotations

import random
import shutil
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from faults import checks
from faults.lab import (
    BASE_PACKAGES,
    Home,
    Lab,
    Run,
    tmpfs,
)

DEFAULT = object()
SYMPTOMS = [("already exists", 7), ("UnicodeDecodeError", 9), ("MemoryError", 11)]
"""Messages that tell which item of issue 13 a failure is, whatever trial met it."""


@dataclass(frozen=True)
class Violation:
    """An invariant that did not hold: what, in which trial, shown by which command."""

    kind: str
    seed: int
    item: int | None
    what: str
    command: str = ""

    def reproduce(self) -> str:
        return f"python tests/bench/soak.py --repro {self.kind}:{self.seed}"


@dataclass
class Outcome:
    """What one trial did and found."""

    kind: str
    seed: int
    faults: int = 0
    caught: int = 0
    lost: int = 0
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Trial:
    """One trial's seeded random numbers, folder, homes, mounts and findings."""

    def __init__(self, lab: Lab, kind: str, seed: int) -> None:
        self.lab, self.kind, self.seed = lab, kind, seed
        self.rng = random.Random(f"{kind}/{seed}")
        self.root = lab.trials / f"{kind}-{seed}"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.item: int | None = None
        self.outcome = Outcome(kind, seed)
        self.stack = ExitStack()
        self._lock = threading.Lock()

    def home(
        self, name: str = "host", base: bool = False, registry: Path | None = None, database=""
    ) -> Home:
        """A host under the trial's folder; with `base`, its registry starts as the lab's
        prepared one."""
        return self.lab.host(self.root / name, base, registry, database)

    def mount(self, path: Path, size: str) -> Path:
        return self.stack.enter_context(tmpfs(path, size))

    # -- findings ---------------------------------------------------------------------------

    def fault(self, count: int = 1) -> None:
        self.outcome.faults += count

    def caught(self, count: int = 1) -> None:
        self.outcome.caught += count

    def note(self, text: str) -> None:
        self.outcome.notes.append(text)

    def violate(self, what: str, run: Run | None = None, item: object = DEFAULT) -> None:
        if item is DEFAULT:
            item = self.item if self.item is not None else _symptom(run)
        command = run.command() if run else ""
        with self._lock:
            self.outcome.violations.append(Violation(self.kind, self.seed, item, what, command))  # type: ignore[arg-type]

    def check(self, run: Run, ok: tuple[int, ...] = (0,), item: object = DEFAULT) -> bool:
        """The command answered, and with one of the exit codes `ok`; never an internal error
        or a traceback (bad input, a full disk or a broken store get a documented code)."""
        if run.timed_out:
            self.violate(f"no answer within {run.seconds:.0f} s", run, item)
        elif run.rc < 0:
            self.violate(f"died of signal {-run.rc}", run, item)
        elif "internal error" in run.err or "Traceback" in run.err:
            self.violate(f"internal error: {run.message()}", run, item)
        elif run.rc not in ok:
            said = run.message() or " ".join(run.out.split())[:300]
            self.violate(f"exit {run.rc} (expected {_codes(ok)}): {said}", run, item)
        else:
            return True
        return False

    def close(self) -> None:
        self.stack.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _codes(ok: tuple[int, ...]) -> str:
    return f"{ok[0]}-{ok[-1]}" if len(ok) > 2 else " or ".join(map(str, ok))


def _symptom(run: Run | None) -> int | None:
    text = run.err if run else ""
    return next((item for marker, item in SYMPTOMS if marker in text), None)


# -- invariants ------------------------------------------------------------------------------


def listing_complete(t: Trial, home: Home, item: object = DEFAULT, **kw: str) -> set[tuple]:
    """`registry ls` works, and every package it lists has its index and all its blobs.
    Returns the (name, hex) rows."""
    done = home.run("registry", "ls", "--json", *_registry(kw))
    if not t.check(done, item=item):
        return set()
    rows = {(row["name"], row["digest"].removeprefix("blake3:")) for row in done.json()}  # type: ignore[union-attr]
    root = Path(kw.get("registry", home.registry))
    for name, hex_digest in sorted(rows):
        problem = checks.package_problem(root, hex_digest)
        if problem is not None:
            t.violate(f"registry ls lists {name}@{hex_digest[:12]}: {problem}", done, item)
    return rows


def verify_exact(
    t: Trial,
    home: Home,
    corrupt: set[str] = frozenset(),
    missing: set[str] = frozenset(),
    item: object = DEFAULT,
    **kw: str,
) -> bool:
    """`registry verify` names exactly the blobs broken on purpose: corrupt ones (exit 6),
    else missing ones (exit 3), else passes (exit 0)."""
    done = home.run("registry", "verify", "--json", *_registry(kw))
    want = 6 if corrupt else 3 if missing else 0
    if not t.check(done, ok=(want,), item=item):
        return False
    if not done.out.strip():
        t.violate(f"verify printed no report (exit {done.rc}): {done.message()}", done, item)
        return False
    report = done.json()
    found_corrupt = {d.removeprefix("blake3:") for d in report["corrupt"]}  # type: ignore[index]
    found_missing = {d.removeprefix("blake3:") for d in report["missing"]}  # type: ignore[index]
    if (found_corrupt, found_missing) != (set(corrupt), set(missing)):
        t.violate(
            f"verify named corrupt {_short(found_corrupt)}, missing {_short(found_missing)}; "
            f"broken on purpose: corrupt {_short(corrupt)}, missing {_short(missing)}",
            done,
            item,
        )
        return False
    return True


def refs_sound(t: Trial, root: Path, ignore: set[Path] = frozenset(), item=DEFAULT) -> None:
    """Every tag and pin names a complete package."""
    for problem in checks.dangling_refs(root, ignore):
        t.violate(f"a ref names a missing blob: {problem}", item=item)


def nothing_lost(
    t: Trial, root: Path, before: dict[str, str], spared: set[str] = frozenset(), item=DEFAULT
) -> None:
    """Every package a tag or pin protected before the trial is still complete."""
    for problem in checks.lost(root, before, spared):
        t.outcome.lost += 1
        t.violate(f"data lost: {problem}", item=item)


def settle(t: Trial, home: Home, before: dict[str, str], item: object = DEFAULT) -> None:
    """The invariants after any trial on a registry: the next commands work, verify passes,
    nothing references a missing blob, nothing protected was lost."""
    listing_complete(t, home, item)
    verify_exact(t, home, item=item)
    refs_sound(t, home.registry, item=item)
    nothing_lost(t, home.registry, before, item=item)


def _registry(kw: dict[str, str]) -> list[str]:
    return ["--registry", kw["registry"]] if "registry" in kw else []


def _short(digests: set[str] | frozenset[str]) -> str:
    return "[" + ", ".join(sorted(d[:12] for d in digests)) + "]"


def live_package(ref: str) -> tuple[str, str, str, str]:
    """(name, source, config, tag) of one of the prepared registry's live packages."""
    name, tag = ref.split(":")
    package = next(p for p in BASE_PACKAGES if (p.name, p.tag) == (name, tag))
    return package.name, package.source, package.config, package.tag


def resume_to_clean(t: Trial, home: Home, args: list[str], want: str, faults: int) -> None:
    """The interrupted build, run again to its end, gives the digest of an uninterrupted one."""
    done = home.run(*args)
    if not t.check(done):
        return
    got = done.json()["digest"]  # type: ignore[index]
    if got == want:
        t.caught(faults)
    else:
        t.violate(f"the resumed build gave {got}, an uninterrupted one gives {want}", done)


# -- kills -----------------------------------------------------------------------------------
