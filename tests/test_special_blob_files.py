"""A FIFO, socket or device node where a blob belongs (a hostile writer on a shared registry, a
broken NAS sync) is no blob: nothing blocks on it or reads it. verify calls it corrupt and
moves it to quarantine, a writer that finds it replaces it (`repaired`), a reader is refused
(exit 6); and every command answers, in seconds, rather than hang in open(2) forever."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from blake3 import blake3
from registry_helpers import answered as run_answered
from registry_helpers import lab_env, tiny_sources

from flare.errors import IntegrityError
from flare.store import BlobStore, Digest, Encoding
from flare.store.backends.regular import NotAFileError
from flare.store.layout import QUARANTINE_DIR, blob_key

CORRUPT, MISSING = 6, 3
ANSWER_S = 60
"""Far more than any of these commands takes; a hang runs into it and fails the test."""

DATA = os.urandom(200_000)
DIGEST = Digest(blake3(DATA).hexdigest())


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_socket(path: Path) -> None:
    """A unix socket file at path (bound from its folder: a socket path has 108 bytes)."""
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path.name)
    finally:
        os.chdir(here)


def make_device(path: Path) -> None:
    """/dev/null's device node (read, it would look like an empty blob), where root may."""
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")


SPECIAL: dict[str, Callable[[Path], None]] = {
    "fifo": make_fifo,
    "socket": make_socket,
    "device": make_device,
}


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (rather than hang the suite) if the block blocks: SIGALRM interrupts a blocked
    open(2), and the handler's exception ends it."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def replace_with(path: Path, kind: str) -> None:
    path.chmod(0o644)
    path.unlink()
    SPECIAL[kind](path)


# -- the store and its local backend ---------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_the_backend_neither_blocks_on_nor_reads_a_special_file(
    store: BlobStore, kind: str
) -> None:
    store.put_bytes(DATA)
    key = blob_key(DIGEST, store.encoding)
    path = store.backend.local_path(key)
    replace_with(path, kind)
    with deadline(20):
        assert store.backend.exists(key)  # something holds the name
        assert store.backend.touch(key)
        for read in (store.backend.open_read, store.backend.open_uncached, store.backend.read):
            with pytest.raises(NotAFileError) as refused:
                read(key)
            assert isinstance(refused.value, IntegrityError) and str(path) in str(refused.value)
        with pytest.raises(IntegrityError):
            store.read_bytes(DIGEST)
    assert stat.S_IFMT(path.lstat().st_mode) != stat.S_IFREG  # left as it was


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_a_put_quarantines_a_special_file_at_the_blob_name_and_publishes(
    store: BlobStore, kind: str
) -> None:
    store.put_bytes(DATA)
    path = store.backend.local_path(blob_key(DIGEST, store.encoding))
    replace_with(path, kind)
    with deadline(20):
        assert store.put_bytes(DATA).method == "repaired"
        assert path.is_file() and store.read_bytes(DIGEST) == DATA
        assert store.put_bytes(DATA).method == "existing"
    moved = list(Path(store.location, QUARANTINE_DIR).iterdir())
    assert len(moved) == 1 and not stat.S_ISREG(moved[0].lstat().st_mode)


def test_a_fifo_among_temp_files_does_not_block_the_temp_sweep(store: BlobStore) -> None:
    store.put_bytes(DATA)
    fifo = Path(store.location, "tmp", "host.1.abc.part")
    os.mkfifo(fifo)
    os.utime(fifo, (0, 0))
    with deadline(20):
        assert store.sweep_temps(stale_after_s=0) == []
    assert fifo.exists()  # no temp file of a writer's: left alone


# -- the real command on a registry --------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 1)


@pytest.fixture
def host(tmp_path: Path, sources: Path) -> Iterator[dict[str, str]]:
    """A host with a signing key and one package, `t`, built into its local registry."""
    with lab_env("sqlite", tmp_path) as env:
        answered(env, "key", "generate", "--publisher", "alice")
        assert answered(env, "build", str(sources / "tiny-0"), "--name", "t").returncode == 0
        yield env


def answered(
    env: dict[str, str], *args: str, timeout: int = ANSWER_S
) -> subprocess.CompletedProcess[str]:
    """The real command, within this file's time to answer."""
    return run_answered(env, *args, timeout=timeout)


def payload(env: dict[str, str]) -> tuple[Digest, Path]:
    """The package's payload blob and its path in the registry."""
    shown = json.loads(answered(env, "registry", "show", "t", "--json").stdout)
    digest = Digest.parse(shown["manifest"]["payloads"][0]["digest"])
    return digest, Path(env["FLARE_REGISTRY"]) / blob_key(digest, Encoding.PLAIN)


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_registry_verify_quarantines_a_special_file_and_a_rebuild_restores_the_blob(
    host: dict[str, str], sources: Path, kind: str
) -> None:
    digest, path = payload(host)
    replace_with(path, kind)
    started = time.monotonic()
    done = answered(host, "registry", "verify", "--json")
    assert time.monotonic() - started < ANSWER_S / 2
    assert done.returncode == CORRUPT, done.stderr
    report = json.loads(done.stdout)
    assert report["corrupt"] == [str(digest)] and len(report["quarantined"]) == 1
    moved = Path(host["FLARE_REGISTRY"]) / report["quarantined"][0]
    assert not stat.S_ISREG(moved.lstat().st_mode) and not os.path.lexists(path)

    again = answered(host, "registry", "verify", "--json")
    assert again.returncode == MISSING and json.loads(again.stdout)["missing"] == [str(digest)]
    assert answered(host, "registry", "verify", "--restore").returncode == MISSING  # not put back

    rebuilt = answered(host, "build", str(sources / "tiny-0"), "--name", "t", timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert stat.S_ISREG(path.lstat().st_mode)
    assert answered(host, "registry", "verify").returncode == 0
    assert answered(host, "verify", "t").returncode == 0


def test_verify_of_a_package_with_a_fifo_answers_at_once_and_names_the_blob(
    host: dict[str, str],
) -> None:
    digest, path = payload(host)
    replace_with(path, "fifo")
    done = answered(host, "verify", "t", timeout=30)
    assert done.returncode == CORRUPT, done.stderr
    assert str(digest) in done.stdout + done.stderr


def test_build_and_pull_with_a_fifo_at_a_blob_name_answer(
    host: dict[str, str], sources: Path
) -> None:
    digest, path = payload(host)
    replace_with(path, "fifo")
    # the build reuses what its journal and the registry list, as for any damaged blob
    # (verify finds it, and the build after restores it: the tests above)
    rebuilt = answered(host, "build", str(sources / "tiny-0"), "--name", "t", timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    pulled = answered(host, "pull", "t")
    assert pulled.returncode == CORRUPT and str(digest) in pulled.stderr
    assert answered(host, "registry", "gc", "--grace", "0").returncode == 0
    assert stat.S_ISFIFO(path.lstat().st_mode)  # gc sweeps files only; verify moves it
