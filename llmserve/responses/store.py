"""Stored responses: one embedded SQLite file (`llmserve serve --responses-store PATH`; a Postgres
URL there is pg_store.py: storage.py picks), kept across restarts. Each row is one response in one
namespace (the API key that made it, hashed: a key never reads another key's responses; a server
without keys has one namespace), with the Response object and the input items the model saw (the
conversation before this response).

Retention: at most `max_count` responses (the oldest go first) and none older than
`max_age_s`, both checked as responses are added. A response the server was still making when it
stopped is marked failed when the file is next opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,     -- the Response object, JSON
    input_items TEXT NOT NULL,  -- the items the model saw before its output, JSON (no instructions)
    PRIMARY KEY (namespace, id)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""
UNFINISHED = ("queued", "in_progress")
DEFAULT_MAX_COUNT = 10_000
DEFAULT_MAX_AGE_DAYS = 30.0


def default_store_path() -> Path:
    """$XDG_CACHE_HOME/llmserve/responses.sqlite, else ~/.cache/llmserve/responses.sqlite."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve" / "responses.sqlite"


def stopped(response: dict) -> dict:
    """`response`, which its server stopped making (a crash, a kill), as it is stored then: failed."""
    error = {"code": "server_error", "message": "the server stopped before this response finished"}
    return {**response, "status": "failed", "error": error}


def namespace_of(api_key: str | None) -> str:
    """The namespace of a request made with `api_key` (None: the server has no keys)."""
    return "" if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()


class ResponseStore:
    """The SQLite file at `path` (":memory:": kept in memory only). Its methods block: the serving
    code calls them in a thread. One connection, one call at a time."""

    def __init__(self, path: str | Path, max_count: int | None = DEFAULT_MAX_COUNT,
                 max_age_s: float | None = DEFAULT_MAX_AGE_DAYS * 86400) -> None:  # fmt: skip
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.max_count, self.max_age_s = max_count, max_age_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            self._fail_unfinished()

    def _fail_unfinished(self) -> None:
        """Responses still running when the server last stopped: failed, with the reason."""
        rows = self._db.execute(
            f"SELECT namespace, id, response FROM responses WHERE status IN {UNFINISHED}"
        ).fetchall()
        for namespace, rid, text in rows:
            self._db.execute("UPDATE responses SET status = 'failed', response = ? WHERE namespace = ? AND id = ?",
                             (json.dumps(stopped(json.loads(text))), namespace, rid))  # fmt: skip

    def put(self, namespace: str, response: dict, input_items: list[dict]) -> None:
        """Add (or replace) `response`; then the retention limits."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (namespace, response["id"], response["created_at"], response["status"], json.dumps(response),
                 json.dumps(input_items)),
            )  # fmt: skip
            self._retain()

    def update(self, namespace: str, response: dict) -> bool:
        """The stored response's new state (False: it is not stored, or no longer)."""
        with self._lock:
            cur = self._db.execute("UPDATE responses SET status = ?, response = ? WHERE namespace = ? AND id = ?",
                                   (response["status"], json.dumps(response), namespace, response["id"]))  # fmt: skip
            return cur.rowcount > 0

    def get(self, namespace: str, rid: str) -> tuple[dict, list[dict]] | None:
        """(the response, its input items), or None when `namespace` holds no such response."""
        with self._lock:
            row = self._db.execute("SELECT response, input_items FROM responses WHERE namespace = ? AND id = ?",
                                   (namespace, rid)).fetchone()  # fmt: skip
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, namespace: str, rid: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE namespace = ? AND id = ?", (namespace, rid))
            return cur.rowcount > 0

    def _retain(self) -> None:
        if self.max_age_s is not None:
            self._db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
        if self.max_count is not None:
            self._db.execute(
                "DELETE FROM responses WHERE rowid IN "
                "(SELECT rowid FROM responses ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
                (self.max_count,),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()
