"""Where stored responses live, picked by the store's location: a `postgresql://` (or `postgres://`)
URL is a Postgres database (pg_store.py, psycopg imported only then), anything else an SQLite file
(store.py; ":memory:" keeps them in memory only). Both backends keep the same contract, below."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from llmserve.responses.store import DEFAULT_MAX_AGE_DAYS, DEFAULT_MAX_COUNT, ResponseStore

POSTGRES_SCHEMES = ("postgresql", "postgres")
PSYCOPG_MISSING = "a Postgres responses store needs psycopg 3: pip install 'psycopg[binary]'"


class ResponseStorage(Protocol):
    """Stored responses by namespace (namespace_of: the API key's hash), with the input items each
    response's model saw. Methods block (the serving code calls them in a thread); a response still
    `queued`/`in_progress` when the server that made it stopped reads back `failed`."""

    def put(self, namespace: str, response: dict, input_items: list[dict]) -> None:
        """Add (or replace) `response`; then the retention limits (count, age)."""

    def update(self, namespace: str, response: dict) -> bool:
        """The stored response's new state (False: it is not stored, or no longer)."""

    def get(self, namespace: str, rid: str) -> tuple[dict, list[dict]] | None:
        """(the response, its input items), or None when `namespace` holds no such response."""

    def delete(self, namespace: str, rid: str) -> bool: ...

    def close(self) -> None: ...


def is_postgres_url(location: str | Path) -> bool:
    return isinstance(location, str) and urlsplit(location).scheme in POSTGRES_SCHEMES


def location_problem(location: str | Path | None) -> str | None:
    """Why the store at `location` cannot be opened on this install (None: nothing known against it),
    for a command line or a config to refuse at start rather than on the first request."""
    if location is not None and is_postgres_url(location) and importlib.util.find_spec("psycopg") is None:
        return PSYCOPG_MISSING
    return None


def redacted(location: str | Path) -> str:
    """`location` fit for a log line: a URL's password left out."""
    if not is_postgres_url(location):
        return str(location)
    parts = urlsplit(str(location))
    if parts.password is None:
        return str(location)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def open_store(location: str | Path, max_count: int | None = DEFAULT_MAX_COUNT,
               max_age_s: float | None = DEFAULT_MAX_AGE_DAYS * 86400) -> ResponseStorage:  # fmt: skip
    """The store at `location` (a Postgres URL or an SQLite path), opened; it blocks."""
    if not is_postgres_url(location):
        return ResponseStore(location, max_count, max_age_s)
    try:
        from llmserve.responses.pg_store import PostgresResponseStore
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "psycopg":
            raise RuntimeError(PSYCOPG_MISSING) from None
        raise
    return PostgresResponseStore(str(location), max_count, max_age_s)
