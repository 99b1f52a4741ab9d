"""The index DB: SQLite by default (WAL on local disks, a rollback journal on network mounts),
PostgreSQL for labs whose hosts write at once. Migrations run on open, under a lock."""

from __future__ import annotations

import fcntl
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

from sqlalchemy import (
    Column,
    Connection,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, IntegrityError

from flare.errors import FlareError, NoSpaceError, PermissionDeniedError, from_os_error
from flare.extras import install_hint
from flare.faults import crash_point
from flare.registry.models import metadata
from flare.store.backends.filesystems import on_network_filesystem

T = TypeVar("T")
BUSY_TIMEOUT_MS = 30_000
WRITE_RETRIES = 8
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
MIGRATION_LOCK_KEY = 0x666C617265  # "flare": the PostgreSQL advisory lock for migrations
WRITING = "flare_writing"
"""The execution option that marks a write transaction (SQLite begins it IMMEDIATE)."""
SQLITE_FULL = 13
SQLITE_IOERR = 10
SQLITE_IOERR_SHMSIZE = 4874
"""SQLite's result codes for a full disk: SQLITE_FULL where a write of the DB or its journal
found no space; an I/O error growing the WAL's shared-memory file (or another I/O error on a
filesystem with no space left) where opening the DB did."""
NEARLY_FULL = 1 << 20
"""Free bytes below which a SQLite I/O error is taken for a full disk."""
PG_DISK_FULL = "53100"
"""PostgreSQL's SQLSTATE disk_full: the server could not extend a table, index or WAL file."""
PG_NO_DATABASE = re.compile(r'database "[^"]*" does not exist')
"""The server's refusal of a connection to a database it lacks (a connection failure carries
no SQLSTATE, only this text)."""
URL_EXAMPLES = "write e.g. postgresql+psycopg://USER@HOST/DB or sqlite:////abs/path/index.db"
SCHEMA_HEAD = "0002"
"""The newest revision in migrations/versions (a test keeps the two equal). An index already
at it opens without loading alembic, which keeps every command's start-up short."""


class UnusableIndexError(FlareError):
    """The index DB cannot be used as it is: a bad URL, unreachable, a PostgreSQL database
    that does not exist, from a newer flare, or corrupt."""

    exit_code = 10

    def __init__(self, what: str, hint: str = "", corrupt: bool = False) -> None:
        super().__init__(what, hint)
        self.corrupt = corrupt


def _disk_full(exc: DatabaseError, sqlite_path: Path | None) -> bool:
    """Whether the DB failed because its disk is full: SQLite's SQLITE_FULL, its I/O errors
    where the filesystem holding the DB has no space left (they carry no errno), PostgreSQL's
    disk_full. SQLite's text is tested too, for drivers that give no code."""
    cause = exc.orig
    if (
        getattr(cause, "sqlstate", None) == PG_DISK_FULL
        or getattr(cause, "pgcode", None) == PG_DISK_FULL
    ):
        return True
    code = getattr(cause, "sqlite_errorcode", None)
    if code is None:
        return "database or disk is full" in str(exc)
    if code & 0xFF == SQLITE_FULL or code == SQLITE_IOERR_SHMSIZE:
        return True
    return (
        code & 0xFF == SQLITE_IOERR and sqlite_path is not None and _free(sqlite_path) < NEARLY_FULL
    )


def _free(sqlite_path: Path) -> int:
    """Free bytes on the filesystem holding the SQLite DB (unknown: plenty)."""
    try:
        st = os.statvfs(sqlite_path.parent)
    except OSError:
        return NEARLY_FULL
    return st.f_bavail * st.f_frsize


def _retryable(exc: DatabaseError) -> bool:
    """Another writer holds the lock, or inserted the same row first (the retry will merge)."""
    return isinstance(exc, IntegrityError) or "locked" in str(exc)


def _set_journal_mode(cursor, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Switch the journal mode if it differs, retrying while another connection switches it:
    SQLite answers a concurrent switch with "locked" at once, without its busy handler."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].upper() != mode:
                cursor.execute(f"PRAGMA journal_mode = {mode}")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def alembic_config():  # type: ignore[no-untyped-def]
    """Alembic's configuration, pointing at flare's migrations folder."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


VERSION_TABLE = Table(
    "alembic_version",
    MetaData(),
    Column("version_num", String(32), nullable=False),
    PrimaryKeyConstraint("version_num", name="alembic_version_pkc"),
)
"""Where alembic keeps the schema's revision, as alembic itself makes it."""


def _create(connection: Connection) -> str:
    """A new index DB: the head schema from the models, stamped at head (alembic's advice for
    new databases), in the caller's one transaction, so a kill leaves the DB as it was. The
    same tables as replaying every revision (a test compares them), without loading alembic: a
    lab's first command on a new registry starts faster.

    Any flare tables already there are dropped first: a DB without a version row is one whose
    creation was killed before the stamp (older flares created outside the transaction), and an
    index DB holds nothing the store cannot give again (`flare registry reindex`)."""
    VERSION_TABLE.drop(connection, checkfirst=True)
    metadata.drop_all(connection, checkfirst=True)
    metadata.create_all(connection)
    crash_point("index:stamp")
    VERSION_TABLE.create(connection)
    connection.execute(VERSION_TABLE.insert().values(version_num=SCHEMA_HEAD))
    return SCHEMA_HEAD


def _hide_password(url: str) -> str:
    """The URL as written, its password (`USER:SECRET@`) replaced by `***`."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _bad_url(url: str, reason: object) -> UnusableIndexError:
    """A URL SQLAlchemy cannot parse or load a driver for, said in one line."""
    if isinstance(reason, ImportError) and "psycopg" in str(reason):
        hint = f"install PostgreSQL's driver: {install_hint('postgres')}"
    else:
        hint = URL_EXAMPLES
    return UnusableIndexError(
        f"registry.database {_hide_password(url)!r} is not a usable index DB URL ({reason})", hint
    )


def _parse(url: str) -> URL:
    """The URL parsed; refused if SQLAlchemy cannot parse it, or if it is SQLite's in-memory
    DB (an index that would be empty on every command)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise _bad_url(url, exc) from exc
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise _bad_url(url, "a SQLite URL must name a file")
    return parsed


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite index DB URL; None for PostgreSQL (or a URL that does not parse,
    which opening the DB reports)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return Path(parsed.database)


def set_aside(path: Path) -> Path:
    """Move a damaged SQLite DB out of the way, kept for a post-mortem, so that a new one can
    be made in its place; returns where it went (`NAME.corrupt`, or `NAME.corrupt.N` if an
    earlier one is kept there). Its WAL and shared-memory files go first and keep their pairing
    (`NEW-wal`): a WAL left behind would be replayed into the new DB."""
    target = path.with_name(f"{path.name}.corrupt")
    number = 0
    while any(Path(f"{target}{suffix}").exists() for suffix in ("", "-wal", "-shm")):
        number += 1
        target = path.with_name(f"{path.name}.corrupt.{number}")
    for suffix in ("-wal", "-shm", ""):
        try:
            Path(f"{path}{suffix}").rename(f"{target}{suffix}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise from_os_error(exc, "move aside the damaged index DB", f"{path}{suffix}") from exc
    return target


def _unwritable(folder: Path) -> str | None:
    """Why this process cannot create files in the DB's folder (None: it can). SQLite needs
    to, for its journal or WAL, even to read a DB in WAL mode; a folder it cannot write is
    opened read-only instead, so that listing and verifying still work."""
    if os.access(folder, os.W_OK):
        return None
    try:
        read_only_fs = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only_fs = False
    kind = "on a read-only file system" if read_only_fs else "not writable by this user"
    return f"its folder {folder} is {kind}"


def _read_only_connector(path: Path) -> Callable[[], sqlite3.Connection]:
    """Connections that open the DB read-only. With no WAL file beside it, also `immutable`:
    SQLite cannot otherwise open a WAL-mode DB whose shared-memory file it cannot create, and
    no change can be pending. The path is quoted: SQLite reads it as a URI."""
    query = "mode=ro" if Path(f"{path}-wal").exists() else "mode=ro&immutable=1"
    uri = f"file:{quote(str(path))}?{query}"
    return lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)


class IndexDB:
    """An engine on the index DB, migrated to this flare's schema."""

    def __init__(self, url: str) -> None:
        self.url = url
        parsed = _parse(url)
        self.created = False
        """Whether this open made the DB's tables (a new or an emptied DB)."""
        self.sqlite_path = Path(parsed.database) if parsed.get_backend_name() == "sqlite" else None
        self.unwritable: str | None = None
        """Why the SQLite DB was opened read-only (its folder cannot be written), else None."""
        options: dict[str, object] = {}
        if self.sqlite_path is not None:
            self.unwritable = self._sqlite_folder()
            if self.unwritable:
                options["creator"] = _read_only_connector(self.sqlite_path)
        try:
            self.engine = create_engine(url, **options)
        except (ArgumentError, ImportError, ValueError) as exc:
            raise _bad_url(url, exc) from exc
        if self.sqlite_path is not None:
            self._configure_sqlite()

    def _sqlite_folder(self) -> str | None:
        """Make the SQLite DB's folder if need be; say why it cannot be written, if so. A DB
        that does not exist yet in such a folder cannot be made: refused at once."""
        assert self.sqlite_path is not None
        folder = self.sqlite_path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, "create the index DB's folder", folder) from exc
        unwritable = _unwritable(folder)
        if unwritable and not self.sqlite_path.exists():
            raise self._read_only("create", unwritable)
        return unwritable

    def _read_only(self, action: str, why: str | None = None, reading: bool = True) -> FlareError:
        """Exit 7 for a change to a SQLite DB whose folder cannot be written; `reading`: the
        DB opened read-only, so the hint can say what still works."""
        assert self.sqlite_path is not None
        works = "; reading commands (ls, show, verify) work on it as it is"
        return PermissionDeniedError(
            f"cannot {action} the index DB {self.sqlite_path}: {why or self.unwritable}",
            "make it writable (remount it read-write, or fix its owner and mode) or use "
            f"another registry{works if reading and self.sqlite_path.exists() else ''}",
        )

    def _configure_sqlite(self) -> None:
        assert self.sqlite_path is not None
        network = on_network_filesystem(self.sqlite_path.parent)
        journal = "DELETE" if network else "WAL"  # WAL needs shared memory a NAS cannot give

        @event.listens_for(self.engine, "connect")
        def _pragmas(connection, _record) -> None:  # type: ignore[no-untyped-def]
            connection.isolation_level = None  # pysqlite begins nothing: _begin does
            cursor = connection.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if self.unwritable:  # read-only: the journal mode is the writers' to set
                cursor.close()
                return
            _set_journal_mode(cursor, journal)
            cursor.execute(
                "PRAGMA synchronous = FULL" if network else "PRAGMA synchronous = NORMAL"
            )
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.close()

        @event.listens_for(self.engine, "begin")
        def _begin(connection: Connection) -> None:
            """Every SQLAlchemy transaction is one SQLite transaction, DDL included. pysqlite's
            legacy mode (its default up to Python 3.15) begins one only before INSERT, UPDATE
            or DELETE, so CREATE TABLE ran outside any and committed at once: a kill between
            creating the tables and stamping them left a DB no command could open. SQLAlchemy's
            SQLite docs ("Transactions with SQLite and the sqlite3 driver") give this recipe.
            A write begins IMMEDIATE: it takes the write lock up front, waiting busy_timeout,
            rather than fail later upgrading a read lock that another writer overtook."""
            writing = connection.get_execution_options().get(WRITING, False)
            connection.exec_driver_sql("BEGIN IMMEDIATE" if writing else "BEGIN")

    # -- schema -----------------------------------------------------------------------------

    def migrate(self) -> str:
        """Bring the schema to this flare's head under a lock; refuse a newer schema."""
        try:
            with self.engine.connect() as connection:
                if self._current(connection) == SCHEMA_HEAD:
                    return SCHEMA_HEAD
            if self.unwritable:
                raise self._read_only("create or upgrade the tables of")
            with self._migration_lock(), self._writing() as connection:
                return self._upgrade(connection)
        except DatabaseError as exc:
            raise self._failure(exc) or self._unreachable(exc) from exc

    def _upgrade(self, connection) -> str:  # type: ignore[no-untyped-def]
        current = self._current(connection)
        if current is None:
            self.created = True
            return _create(connection)
        if current == SCHEMA_HEAD:
            return current  # another host upgraded it while this one waited for the lock
        from alembic import command
        from alembic.script import ScriptDirectory

        config = alembic_config()
        config.attributes["connection"] = connection
        scripts = ScriptDirectory.from_config(config)
        if current not in {s.revision for s in scripts.walk_revisions()}:
            raise UnusableIndexError(
                f"the index DB {self.where()} has schema {current}, newer than this flare",
                "upgrade flare on this host",
            )
        command.upgrade(config, "head")
        return scripts.get_current_head() or ""

    def _current(self, connection) -> str | None:  # type: ignore[no-untyped-def]
        if not inspect(connection).has_table(VERSION_TABLE.name):
            return None
        row = connection.execute(text("SELECT version_num FROM alembic_version")).first()
        return None if row is None else str(row[0])

    @contextmanager
    def _migration_lock(self) -> Iterator[None]:
        if self.sqlite_path is None:
            with self.engine.connect() as connection:
                connection.execute(text(f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})"))
                try:
                    yield
                finally:
                    connection.execute(text(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"))
            return
        fd = os.open(f"{self.sqlite_path}.migrate.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- use --------------------------------------------------------------------------------

    def read(self, action: Callable[[Connection], T]) -> T:
        """Run a query, turning an unreadable DB into an error that says what to do."""
        try:
            with self.engine.connect() as connection:
                return action(connection)
        except DatabaseError as exc:
            failure = self._failure(exc)
            if failure is not None:
                raise failure from exc
            raise

    def write(self, action: Callable[[Connection], T]) -> T:
        """Run a change in one transaction, retried while another writer holds the lock."""
        if self.unwritable:
            raise self._read_only("write")
        for attempt in range(WRITE_RETRIES):
            try:
                with self._writing() as connection:
                    return action(connection)
            except DatabaseError as exc:
                failure = self._failure(exc)
                if failure is not None:
                    raise failure from exc
                if not _retryable(exc) or attempt == WRITE_RETRIES - 1:
                    raise
                time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    @contextmanager
    def _writing(self) -> Iterator[Connection]:
        """A connection in one write transaction, committed at the end of the block."""
        with self.engine.connect() as connection:
            connection.execution_options(**{WRITING: True})
            with connection.begin():
                yield connection

    def _failure(self, exc: DatabaseError) -> FlareError | None:
        """The error a user can act on, for a DB that is corrupt, read-only (a DB file this
        user may read but not write) or whose disk is full."""
        if self._is_corrupt(exc):
            return self._corrupt(exc)
        if self.sqlite_path is not None and "readonly database" in str(exc):
            return self._read_only("write", "the file is not writable by this user")
        if _disk_full(exc, self.sqlite_path):
            return self._full(exc)
        return None

    def _full(self, exc: DatabaseError) -> FlareError:
        """Exit 8, saying where space must be freed. The transaction was rolled back, so the
        same command works once there is room (a DB being created is created then)."""
        if self.sqlite_path is not None:
            where = f"the filesystem holding {self.sqlite_path.parent}"
        else:
            where = "the PostgreSQL server's disk (its data folder or the DB's tablespace)"
        reason = str(exc.orig or exc).splitlines()[0]
        return NoSpaceError(
            f"cannot write the index DB {self.where()}: the disk is full ({reason})",
            f"free space on {where}, then run the command again",
        )

    def check(self) -> str | None:
        """What SQLite's `PRAGMA quick_check` finds wrong with the DB (None: nothing; always
        None on PostgreSQL, whose server keeps its own files whole). A damaged page fails only
        the queries that touch it, so a DB that opens may still be damaged: verify reports it
        and reindex moves it aside. Quick: it reads every page once, without matching indexes
        to tables."""
        if self.sqlite_path is None:
            return None
        try:
            with self.engine.connect() as connection:
                found = connection.exec_driver_sql("PRAGMA quick_check").scalars().all()
        except DatabaseError as exc:
            if self._is_corrupt(exc):
                return str(exc.orig or exc).splitlines()[0]
            raise self._failure(exc) or self._unreachable(exc) from exc
        problems = [str(line) for line in found if line != "ok"]
        return "; ".join(problems[:3]) or None

    def damaged(self, problem: str) -> UnusableIndexError:
        """Exit 10 for a DB that quick_check finds damaged, saying how to rebuild it."""
        return UnusableIndexError(
            f"the index DB {self.where()} is damaged ({problem})",
            "run `flare registry reindex` to rebuild it from the store",
            corrupt=True,
        )

    def _is_corrupt(self, exc: Exception) -> bool:
        message = str(exc).lower()
        return "not a database" in message or "malformed" in message or "corrupt" in message

    def _corrupt(self, exc: Exception) -> FlareError:
        return UnusableIndexError(
            f"the index DB {self.where()} is unreadable ({str(exc).splitlines()[0]})",
            "run `flare registry reindex` to rebuild it from the store",
            corrupt=True,
        )

    def _unreachable(self, exc: Exception) -> FlareError:
        if self.sqlite_path is None and PG_NO_DATABASE.search(str(exc)):
            return self._no_database()
        if self.unwritable:  # e.g. a WAL left by a killed writer, which only a writer recovers
            reason = str(exc).splitlines()[0]
            return self._read_only("open", f"{self.unwritable} ({reason})", reading=False)
        if self.sqlite_path is not None and not os.access(self.sqlite_path, os.R_OK):
            return PermissionDeniedError(
                f"cannot read the index DB {self.sqlite_path}: permission denied",
                "check the owner and mode of the file",
            )
        return UnusableIndexError(
            f"cannot use the index DB {self.where()}: {str(exc).splitlines()[0]}",
            "check registry.database (FLARE_DATABASE) and that the server is up",
        )

    def _no_database(self) -> FlareError:
        """flare creates its tables in a PostgreSQL database, not the database itself (that
        takes the server's owner, and a mistyped name would otherwise make a second index)."""
        url = make_url(self.url)
        server = f"{url.host or 'localhost'}:{url.port or 5432}"
        return UnusableIndexError(
            f"the PostgreSQL database {url.database} does not exist on {server} "
            "(registry.database)",
            f"create it there (createdb {url.database}; flare makes the tables), or point "
            "registry.database (FLARE_DATABASE) at the lab's index DB",
        )

    def where(self) -> str:
        """The DB for messages: its SQLite file, or its URL with the password hidden."""
        return str(self.sqlite_path) if self.sqlite_path else make_url(self.url).render_as_string()

    def dispose(self) -> None:
        self.engine.dispose()
