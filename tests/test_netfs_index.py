"""Where a registry's index lives, which filesystems count as shared, and the change journal
hosts read to bring their own index up to date (the sshfs tests are in test_netfs.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flare.registry import journal
from flare.registry.registry import default_database
from flare.store import BlobStore, Digest
from flare.store.backends.filesystems import filesystem_type, is_network


@pytest.mark.parametrize(
    ("fstype", "shared"),
    [
        ("nfs", True),
        ("nfs4", True),
        ("cifs", True),
        ("smb3", True),
        ("9p", True),
        ("ceph", True),
        ("lustre", True),
        ("gpfs", True),
        ("beegfs", True),
        ("fuse.sshfs", True),
        ("fuse.glusterfs", True),
        ("fuse.ceph-fuse", True),
        ("fuse.rclone", True),
        ("fuse", True),
        ("ext4", False),
        ("xfs", False),
        ("btrfs", False),
        ("tmpfs", False),
        ("overlay", False),
        ("fuse.fuse-overlayfs", False),
        ("fuse.squashfuse", False),
        ("", False),
    ],
)
def test_network_filesystems_are_told_from_local_ones(fstype: str, shared: bool) -> None:
    assert is_network(fstype) is shared


def test_a_path_that_does_not_exist_yet_has_its_mount_s_type(tmp_path: Path) -> None:
    assert filesystem_type(tmp_path / "not" / "yet") == filesystem_type(tmp_path)


def test_a_registry_on_a_local_disk_keeps_its_index_beside_the_blobs(tmp_path: Path) -> None:
    assert default_database(str(tmp_path / "r"), tmp_path / "home") == (
        f"sqlite:///{tmp_path / 'r' / 'index.db'}"
    )
    url = default_database("s3://bucket/flare", tmp_path / "home")
    assert url.startswith(f"sqlite:///{tmp_path / 'home' / 'indexes'}/")


def test_journal_entries_are_new_files_read_back_in_any_order(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    digest = Digest("ab" * 32)
    first = journal.record_change(store, "alpha", digest)
    second = journal.record_change(store, "alpha")
    assert first != second
    names = journal.entries(store)
    assert sorted(names) == sorted(Path(k).name for k in (first, second))
    changes = {journal.read_change(store, n) for n in names}
    assert changes == {journal.Change("alpha", digest), journal.Change("alpha", None)}
    (Path(store.location) / journal.JOURNAL_DIR / "junk.json").write_text("{not json")
    assert journal.read_change(store, "junk.json") is None
    for name in ("../../outside", "Alpha", 5, "a/b"):  # another user's hand: no such name
        entry = Path(store.location) / journal.JOURNAL_DIR / "evil.json"
        entry.write_text(json.dumps({"name": name, "digest": None}))
        assert journal.read_change(store, "evil.json") is None, name


def test_old_journal_entries_are_dropped(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    old = journal.record_change(store, "alpha")
    new = journal.record_change(store, "beta")
    week_ago = time.time() - journal.KEEP_S - 60
    os.utime(Path(store.location) / old, (week_ago, week_ago))
    assert journal.drop_old(store) == [old]
    assert journal.entries(store) == [Path(new).name]
