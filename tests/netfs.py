"""A real network filesystem for tests: one folder exported over SFTP by an sshd of our own on
loopback, mounted twice with sshfs, the two mounts standing for two hosts of a lab.

The sshd has its own host key, user key, config and pid file in a temp folder; nothing under
~/.ssh is read or written. Tests that need it skip, saying what is missing, where sshfs, sshd
or FUSE is not there (CI installs the Debian packages sshfs and openssh-server).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
MOUNT_TIMEOUT_S = 20.0


@dataclass
class NetworkShare:
    """The server-side folder and its mounts (one per "host")."""

    export: Path
    mounts: list[Path] = field(default_factory=list)


def missing_tools() -> str | None:
    """Why sshfs mounts cannot be made here, or None when they can."""
    for tool, package in (("sshfs", "sshfs"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package {package})"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (Debian package openssh-server)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: FUSE is not available here"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "fusermount is not installed (Debian package fuse3)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_config(folder: Path, port: int) -> Path:
    """An sshd config that serves SFTP only, to our own key, on loopback."""
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)],
            check=True,
        )
    config = folder / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host_key'}\n"
        f"PidFile {folder / 'sshd.pid'}\nAuthorizedKeysFile {folder / 'user_key.pub'}\n"
        "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nPermitRootLogin prohibit-password\nSubsystem sftp internal-sftp\n"
        f"AllowUsers {_user()}\nLogLevel ERROR\n"
    )
    return config


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _wait_for_port(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"sshd exited with {server.returncode}")
        with socket.socket() as sock, suppress(OSError):
            sock.connect(("127.0.0.1", port))
            return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not listen on port {port}")


def mount(folder: Path, port: int, export: Path, at: Path, *options: str) -> None:
    """Mount `export` over SFTP at `at` with the lab's default sshfs options plus `options`."""
    at.mkdir(parents=True, exist_ok=True)
    opts = [
        f"IdentityFile={folder / 'user_key'}",
        "StrictHostKeyChecking=no",
        "UserKnownHostsFile=/dev/null",
        "LogLevel=ERROR",
        *options,
    ]
    subprocess.run(
        ["sshfs", "-p", str(port), "-o", ",".join(opts), f"{_user()}@127.0.0.1:{export}", str(at)],
        check=True,
        timeout=MOUNT_TIMEOUT_S,
        capture_output=True,
    )


def unmount(at: Path) -> None:
    """Unmount, lazily if a process still has something open there."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount"
    result = subprocess.run([tool, "-u", str(at)], capture_output=True)
    if result.returncode != 0:
        subprocess.run([tool, "-u", "-z", str(at)], capture_output=True)


@contextmanager
def network_share(root: Path, hosts: int = 2, *options: str) -> Iterator[NetworkShare]:
    """Start an sshd on loopback and mount its export `hosts` times; undo both on exit."""
    folder = root / "sshd"
    folder.mkdir(parents=True)
    export = root / "export"
    export.mkdir()
    port = _free_port()
    config = _write_config(folder, port)
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder
    server = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
    share = NetworkShare(export)
    try:
        _wait_for_port(port, server)
        for host in range(hosts):
            at = root / f"host{host}"
            mount(folder, port, export, at, *options)
            share.mounts.append(at)
        yield share
    finally:
        for at in share.mounts:
            unmount(at)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stderr is not None:
            server.stderr.close()
