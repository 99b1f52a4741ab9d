"""A lease file that is no lease (wrong field types, a bad digest, not JSON, a FIFO or a folder
at its name) protects nothing, as a file that is not JSON never did: gc and `flare ps` pass over
it with a one-line warning that names it, and go on; the live leases beside it still protect
their packages. One damaged or hostile file must not stop every gc of a shared registry."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from registry_helpers import answered as run_answered
from registry_helpers import lab_env, tiny_sources

from flare.registry.leases import BadLease, Lease, hold_lease, parse_lease
from flare.registry.registry import Registry
from flare.store import Digest

ANSWER_S = 120
DIGEST = "blake3:" + "ab" * 32

LEASE = '{"id":"x","holder":"h:1","purpose":"serve"'
LIVE = LEASE + ',"expires":9e99'
BAD: dict[str, str] = {
    "expires-text": LEASE + ',"expires":"9e99"}',
    "package-number": LIVE + ',"packages":[123]}',
    "since-text": LIVE + ',"since":"x"}',
    "holder-no-pid": '{"id":"x","holder":"hx","purpose":"serve","expires":9e99}',
    "packages-text": LIVE + f',"packages":"{DIGEST}"}}',
    "bad-digest": LIVE + ',"packages":["blake3:zz"]}',
    "blobs-object": LIVE + ',"blobs":{"a":1}}',
    "expires-nan": LEASE + ',"expires":NaN}',
    "expires-true": LEASE + ',"expires":true}',
    "expires-huge": LEASE + ',"expires":1' + "0" * 400 + "}",
    "started-far": LIVE + ',"started":9e99}',
    "url-number": LIVE + ',"url":5}',
    "what-escape": LIVE + ',"what":"\\u001b[2J"}',
    "no-holder": '{"id":"x","purpose":"serve","expires":9e99}',
    "a-list": "[1, 2]",
    "not-json": "garbage \udcff",
}


# -- reading one file -------------------------------------------------------------------------


def test_what_hold_lease_writes_and_older_files_read_back() -> None:
    lease = Lease(id="a1", holder="node-1.lab:4242", purpose="build", packages=[DIGEST], since=1.5)
    assert parse_lease(json.dumps(asdict(lease)).encode()) == lease
    dead = {"id": "dead", "holder": "gone:1", "purpose": "serve", "expires": 1}
    assert parse_lease(json.dumps(dead).encode()).expires == 1.0
    newer = {**dead, "priority": "high"}  # a field of a newer flare: its lease still counts
    assert parse_lease(json.dumps(newer).encode()).holder == "gone:1"


@pytest.mark.parametrize("shape", sorted(BAD))
def test_a_bad_shape_is_refused_saying_why(shape: str) -> None:
    with pytest.raises(BadLease) as refused:
        parse_lease(BAD[shape].encode("utf-8", "surrogateescape"))
    assert str(refused.value) and "\n" not in str(refused.value)


# -- the real command on a registry --------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 1)


@pytest.fixture
def host(tmp_path: Path, sources: Path) -> Iterator[dict[str, str]]:
    """A registry with one package, `held`."""
    with lab_env("sqlite", tmp_path) as env:
        answered(env, "build", str(sources / "tiny-0"), "--name", "held", timeout=300)
        yield env


def answered(
    env: dict[str, str], *args: str, timeout: int = ANSWER_S
) -> subprocess.CompletedProcess[str]:
    """The real command: it must answer, exit 0, and print no traceback."""
    done = run_answered(env, *args, timeout=timeout)
    assert done.returncode == 0, (args, done.stderr)
    return done


def digest_of(env: dict[str, str], name: str) -> Digest:
    shown = json.loads(answered(env, "registry", "show", name, "--json").stdout)
    return Digest.parse(shown["digest"])


def warned_once(stderr: str, path: Path) -> None:
    lines = [line for line in stderr.splitlines() if line.startswith("warning: ignoring lease")]
    assert len(lines) == 1 and f"lease file {path}: " in lines[0], stderr


def put_text(path: Path, body: str) -> None:
    path.write_bytes(body.encode("utf-8", "surrogateescape"))


def writer(body: str) -> Callable[[Path], None]:
    return lambda path: put_text(path, body)


MAKERS: dict[str, Callable[[Path], None]] = {
    **{shape: writer(body) for shape, body in BAD.items()},
    "fifo": os.mkfifo,
    "folder": Path.mkdir,
}


@pytest.mark.parametrize("shape", sorted(MAKERS))
def test_gc_and_ps_pass_over_a_bad_lease_and_live_leases_still_protect(
    host: dict[str, str], shape: str
) -> None:
    registry = Registry(host["FLARE_REGISTRY"], host["FLARE_DATABASE"])
    held = digest_of(host, "held")
    answered(host, "registry", "rm", "held")  # only the lease below keeps it now
    junk = registry.store.put_bytes(os.urandom(1000)).digest  # garbage: nothing keeps it
    evil = Path(host["FLARE_REGISTRY"]) / "leases" / "evil.json"
    with hold_lease(registry.store, "serve", [held], url="http://x/v1", what=f"held@{held}"):
        MAKERS[shape](evil)
        collected = answered(host, "registry", "gc", "--grace", "0", "--json")
        warned_once(collected.stderr, evil)
        deleted = json.loads(collected.stdout)["deleted"]
        assert str(junk) in deleted and str(held) not in deleted  # gc went on, the lease held
        assert registry.verify(str(held)).ok

        shown = answered(host, "ps", "--json")
        warned_once(shown.stderr, evil)
        servers = json.loads(shown.stdout)
        assert [(s["pid"], s["package"]) for s in servers] == [(os.getpid(), f"held@{held}")]
        table = answered(host, "ps")
        warned_once(table.stderr, evil)
        assert "held@" in table.stdout
    assert os.path.lexists(evil)  # not flare's to remove: the warning says to
    registry.db.dispose()


def test_a_bad_lease_that_expired_long_ago_is_dropped(host: dict[str, str]) -> None:
    leases = Path(host["FLARE_REGISTRY"]) / "leases"
    leases.mkdir(exist_ok=True)
    (leases / "old.json").write_text('{"id":"x","holder":"hx","purpose":"serve","expires":1}')
    answered(host, "registry", "gc")
    assert not (leases / "old.json").exists()
