"""A real Postgres server for the tests: PyPI's pgserver (Postgres binaries in a wheel), started in a
temporary folder and reached over a Unix socket. Tests that need it skip when pgserver (or psycopg)
is not installed.

As root, pgserver runs Postgres as the system user `pgserver`, which must reach the data folder:
not under pytest's tmp folders (pytest makes /tmp/pytest-of-root private again as a run starts)."""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_names = itertools.count()


@contextlib.contextmanager
def postgres_server() -> Iterator[object]:
    """pgserver's server with its data in a new temporary folder, stopped and deleted on the way out."""
    pgserver = pytest.importorskip("pgserver")
    psycopg = pytest.importorskip("psycopg")

    server = pgserver.get_server(Path(tempfile.mkdtemp(prefix="llmserve-pg-")), cleanup_mode="delete")
    with psycopg.connect(server.get_uri(), autocommit=True) as db:  # nothing to keep: no waiting on disks
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            db.execute(f"ALTER SYSTEM SET {setting} = off")
        db.execute("SELECT pg_reload_conf()")
    try:
        yield server
    finally:
        server.cleanup()


def fresh_database(server) -> str:
    """The URL of a new, empty database on `server`."""
    import psycopg

    name = f"t{next(_names)}"
    with psycopg.connect(server.get_uri(), autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return server.get_uri(name)
