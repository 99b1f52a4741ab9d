"""Which filesystem holds a path, and whether other hosts share it over a network.

A network filesystem's client caches listings and attributes (NFS for up to `acdirmax`, 60 s by
default; sshfs for `dcache_timeout`, 20 s), gives no cross-host locks that SQLite or flock can
trust (sshfs none at all), and may serve a stale read: flare keeps no SQLite index there,
re-reads a blob past the client's cache before it calls it corrupt, and hashes by reading
rather than through a memory map.
"""

from __future__ import annotations

from pathlib import Path

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "lustre",
        "gpfs",
        "beegfs",
        "glusterfs",
        "afs",
        "ocfs2",
        "gfs2",
        "virtiofs",
        "davfs",
        "ncpfs",
        "orangefs",
        "pvfs2",
        "panfs",
        "wekafs",
        "quobyte",
    }
)
"""Kernel filesystem types whose files other hosts (or VMs) see too."""
LOCAL_FUSE = frozenset(
    {"fuse-overlayfs", "squashfuse", "squashfuse_ll", "bindfs", "lxcfs", "portal", "fuseblk"}
)
"""FUSE subtypes known to serve local files only. Any other `fuse.*` (sshfs, glusterfs,
ceph-fuse, s3fs, rclone, gcsfuse, juicefs, ...) counts as a network filesystem: where unsure,
the careful choice costs a host-local index and a slower verify, never data."""


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding path, from /proc/self/mountinfo ('' if unknown).

    The path need not exist yet: the longest mount point that contains it decides."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    target, best, kind = str(Path(path).resolve()), "", ""
    for line in lines:
        fields = line.split()
        mount, fstype = fields[4], fields[fields.index("-") + 1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


def is_network(fstype: str) -> bool:
    """True for a filesystem type other hosts may share (see NETWORK_FILESYSTEMS)."""
    if fstype in NETWORK_FILESYSTEMS:
        return True
    if fstype == "fuse" or fstype.startswith("fuse."):
        return fstype.removeprefix("fuse.") not in LOCAL_FUSE
    return False


def on_network_filesystem(path: Path) -> bool:
    """True when path lies on a filesystem other hosts may share."""
    return is_network(filesystem_type(path))


CACHE_WINDOWS_S = {"fuse.sshfs": 21.0}
"""How long a client may show a listing or a file's attributes as they were, by filesystem:
sshfs caches for `dcache_timeout` (20 s by default); NFS for up to `acdirmax`/`acregmax`
(60 s by default), and other network filesystems are given the same. One second more for the
kernel's own entry and attribute caches."""
NETWORK_CACHE_WINDOW_S = 61.0


def cache_window_s(fstype: str) -> float:
    """The default cache window of a filesystem type: 0 for a local one."""
    if not is_network(fstype):
        return 0.0
    return CACHE_WINDOWS_S.get(fstype, NETWORK_CACHE_WINDOW_S)
