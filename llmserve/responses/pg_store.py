"""Stored responses in a Postgres database (`--responses-store postgresql://...`): the SQLite store's
contract (storage.ResponseStorage) with several servers or gateways on one database.

One table, `llmserve_responses`, made on first open, in the first schema of the connection's
search_path (`?options=-csearch_path%3Dname` in the URL gives a server its own). Rows are as in the
SQLite file, plus the `owner` that wrote each: every open store holds a Postgres advisory lock
named by its owner id for as long as its connection lives. A store opening fails the unfinished
responses of owners whose lock nobody holds (their server is gone), never those of a live server
sharing the database. A dropped connection is opened again once per call (the lock retaken); a
database that stays away is a 503 to the client.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from llmserve.openai.errors import APIError
from llmserve.responses.store import DEFAULT_MAX_AGE_DAYS, DEFAULT_MAX_COUNT, UNFINISHED, stopped

logger = logging.getLogger(__name__)

TABLE = "llmserve_responses"
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,     -- the Response object, JSON
    input_items TEXT NOT NULL,  -- the items the model saw before its output, JSON (no instructions)
    owner INTEGER NOT NULL,     -- the store that wrote it last (its advisory lock: alive or not)
    PRIMARY KEY (namespace, id)
);
CREATE INDEX IF NOT EXISTS {TABLE}_by_age ON {TABLE} (created_at);
"""
LOCK_SPACE = 0x6C6C6D73  # the first key of llmserve's advisory locks ("llms"); the second is an owner
# how long a call waits on a database that does not answer, unless the URL says otherwise
CONNECTION_DEFAULTS = {"connect_timeout": "10", "keepalives_idle": "10", "keepalives_interval": "5",
                       "keepalives_count": "3", "tcp_user_timeout": "30000"}  # fmt: skip
T = TypeVar("T")


class PostgresResponseStore:
    """The database at `url`. Its methods block: the serving code calls them in a thread. One
    connection, one call at a time."""

    def __init__(self, url: str, max_count: int | None = DEFAULT_MAX_COUNT,
                 max_age_s: float | None = DEFAULT_MAX_AGE_DAYS * 86400) -> None:  # fmt: skip
        self._conninfo = {**CONNECTION_DEFAULTS, **conninfo_to_dict(url)}
        self.max_count, self.max_age_s = max_count, max_age_s
        self.owner = secrets.randbelow(2**31 - 1) + 1
        self._lock = threading.Lock()
        self._db: psycopg.Connection | None = None
        with self._lock:
            self._connect()  # a database that cannot be reached fails here, for the caller to report
            try:
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_SPACE,))  # one creator at a time
                    for statement in filter(str.strip, SCHEMA.split(";")):
                        self._db.execute(statement)
                self._fail_orphans()
            except BaseException:
                self._db.close()
                raise

    def _connect(self) -> None:
        self._db = psycopg.connect(**self._conninfo, autocommit=True)
        self._db.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_SPACE, self.owner))

    def _call(self, work: Callable[[psycopg.Connection], T]) -> T:
        """`work` on the connection; a broken connection is opened again and `work` tried once more."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._db is None or self._db.closed:
                        self._connect()
                    return work(self._db)
                except psycopg.OperationalError as exc:
                    if self._db is not None:
                        self._db.close()
                    self._db = None
                    if attempt == 2:
                        logger.error("the Postgres responses store failed: %s", exc)
                        raise APIError(503, f"the responses store is unavailable: {exc}",
                                       code="store_unavailable") from None  # fmt: skip
                    logger.warning("the Postgres responses store's connection broke (%s): connecting again", exc)
        raise AssertionError("unreachable")

    def _fail_orphans(self) -> None:
        """Unfinished responses whose owner's lock is free (its server is gone): failed."""
        owners = self._db.execute(
            f"SELECT DISTINCT owner FROM {TABLE} WHERE status = ANY(%s) AND owner <> %s", (list(UNFINISHED), self.owner)
        ).fetchall()
        for (owner,) in owners:
            if not self._db.execute("SELECT pg_try_advisory_lock(%s, %s)", (LOCK_SPACE, owner)).fetchone()[0]:
                continue  # its server is alive: its responses are still being made
            try:
                with self._db.transaction():
                    rows = self._db.execute(
                        f"SELECT namespace, id, response FROM {TABLE} WHERE owner = %s AND status = ANY(%s) FOR UPDATE",
                        (owner, list(UNFINISHED)),
                    ).fetchall()  # fmt: skip
                    for namespace, rid, text in rows:
                        self._db.execute(f"UPDATE {TABLE} SET status = 'failed', response = %s "
                                         "WHERE namespace = %s AND id = %s",
                                         (json.dumps(stopped(json.loads(text))), namespace, rid))  # fmt: skip
            finally:
                self._db.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_SPACE, owner))

    def put(self, namespace: str, response: dict, input_items: list[dict]) -> None:
        """Add (or replace) `response`; then the retention limits."""
        row = (namespace, response["id"], response["created_at"], response["status"], json.dumps(response),
               json.dumps(input_items), self.owner)  # fmt: skip

        def work(db: psycopg.Connection) -> None:
            with db.transaction():
                db.execute(
                    f"INSERT INTO {TABLE} VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (namespace, id) DO UPDATE "
                    "SET created_at = EXCLUDED.created_at, status = EXCLUDED.status, response = EXCLUDED.response, "
                    "input_items = EXCLUDED.input_items, owner = EXCLUDED.owner",
                    row,
                )  # fmt: skip
                self._retain(db)

        self._call(work)

    def update(self, namespace: str, response: dict) -> bool:
        """The stored response's new state (False: it is not stored, or no longer)."""
        row = (response["status"], json.dumps(response), self.owner, namespace, response["id"])
        return self._call(lambda db: db.execute(
            f"UPDATE {TABLE} SET status = %s, response = %s, owner = %s WHERE namespace = %s AND id = %s", row
        ).rowcount > 0)  # fmt: skip

    def get(self, namespace: str, rid: str) -> tuple[dict, list[dict]] | None:
        """(the response, its input items), or None when `namespace` holds no such response."""
        row = self._call(lambda db: db.execute(
            f"SELECT response, input_items FROM {TABLE} WHERE namespace = %s AND id = %s", (namespace, rid)
        ).fetchone())  # fmt: skip
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, namespace: str, rid: str) -> bool:
        return self._call(lambda db: db.execute(
            f"DELETE FROM {TABLE} WHERE namespace = %s AND id = %s", (namespace, rid)
        ).rowcount > 0)  # fmt: skip

    def _retain(self, db: psycopg.Connection) -> None:
        if self.max_age_s is not None:
            db.execute(f"DELETE FROM {TABLE} WHERE created_at < %s", (time.time() - self.max_age_s,))
        if self.max_count is not None:
            db.execute(
                f"DELETE FROM {TABLE} AS t USING (SELECT namespace, id FROM {TABLE} "
                "ORDER BY created_at DESC OFFSET %s) AS old WHERE t.namespace = old.namespace AND t.id = old.id",
                (self.max_count,),
            )

    def close(self) -> None:
        """Closed: its advisory lock goes with its connection."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
