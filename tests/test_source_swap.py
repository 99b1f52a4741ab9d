"""What a build lists is what it reads, stores and signs. A checkpoint folder swapped for a
twin while the build runs (renamed in one step: the twin's files are hard links to the same
bytes, but its tokenizer.json is a link to a secret outside) must not have the build hash,
store or publish the secret: each read checks that it opened the file the listing saw
(build/sources.py), and a runtime file is stored only if its bytes are the ones hashed.
A build stopped at a crash point (faults.py) while the test swaps the folders makes the
race happen every time, not by luck."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
from pathlib import Path

import pytest
from registry_helpers import stopped_at, tiny_source

from flare.errors import IntegrityError
from flare.store.blobs import BlobStore
from flare.store.hashing import hash_bytes

INTEGRITY = 6
RENAME_EXCHANGE = 2
SECRET = b"TOP SECRET: the lab's API token\n"


def exchange(one: Path, other: Path) -> None:
    """Swap two folders' names in one step, as renameat2(RENAME_EXCHANGE) does: no file in
    them changes its inode, size or times."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_cwd = -100
    if libc.renameat2(at_cwd, bytes(one), at_cwd, bytes(other), RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")


@pytest.fixture
def twins(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The checkpoint, its twin with tokenizer.json linked to a secret, and the secret."""
    real = tiny_source(tmp_path / "sources", 0)
    twin = tmp_path / "twin"
    shutil.copytree(real, twin, copy_function=os.link)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    (twin / "tokenizer.json").unlink()
    (twin / "tokenizer.json").symlink_to(secret)
    return real, twin, secret


def env_for(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {
        "FLARE_HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        "FLARE_REGISTRY": str(tmp_path / "registry"),
        "FLARE_BUILD_TARGET": "none",
    }
    return env


@pytest.mark.parametrize("point", ["resolve:hash", "assemble:payload"])
def test_a_folder_swapped_under_a_build_stores_and_publishes_nothing_of_the_twin(
    tmp_path: Path, twins: tuple[Path, Path, Path], point: str
) -> None:
    real, twin, _ = twins
    env = env_for(tmp_path)
    build = stopped_at(env, point, "build", str(real), "--name", "tiny", "--rehash")
    exchange(real, twin)  # `real` now names the twin
    build.send_signal(signal.SIGCONT)
    _, stderr = build.communicate(timeout=300)
    assert build.returncode == INTEGRITY, stderr
    assert "tokenizer.json" in stderr and "Traceback" not in stderr
    store = BlobStore(tmp_path / "registry")
    assert not store.confirm(hash_bytes(SECRET)), "the secret was stored"
    assert not (tmp_path / "registry" / "refs" / "tiny").exists() or not list(
        (tmp_path / "registry" / "refs" / "tiny").rglob("tags/*")
    ), "a package was published"


@pytest.mark.parametrize("link", [True, False])
def test_a_file_whose_bytes_are_not_the_digest_expected_is_not_stored(
    tmp_path: Path, link: bool
) -> None:
    store = BlobStore(tmp_path / "store")
    path = tmp_path / "file"
    path.write_bytes(SECRET)
    with pytest.raises(IntegrityError):
        store.put_file(path, link=link, expect=hash_bytes(b"what was hashed before"))
    assert not store.confirm(hash_bytes(SECRET))
    assert store.put_file(path, link=link, expect=hash_bytes(SECRET)).digest == hash_bytes(SECRET)
