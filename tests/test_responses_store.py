"""The Responses API's stores, SQLite and a real Postgres server (pgserver) through the same tests:
namespaces, retention, restarts; Postgres shared by live servers and dropped connections; and how
input items are read."""

from __future__ import annotations

import sys
import time

import pytest
from pg_utils import fresh_database, postgres_server
from pydantic import ValidationError

from llmserve.gateway.config import ResponsesConfig
from llmserve.openai.errors import APIError
from llmserve.responses.items import chat_messages, normalize_items
from llmserve.responses.storage import PSYCOPG_MISSING, location_problem, open_store, redacted
from llmserve.responses.store import namespace_of


def response(rid: str, status: str = "completed", created_at: float | None = None) -> dict:
    return {"id": rid, "status": status, "created_at": time.time() if created_at is None else created_at, "output": []}


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def location(request, tmp_path) -> str:
    """Where a test's store lives: an SQLite file, or a new database on the Postgres server."""
    if request.param == "sqlite":
        return str(tmp_path / "s.sqlite")
    return fresh_database(request.getfixturevalue("postgres"))


def test_namespaces_are_apart(location):
    store = open_store(location)
    one, two = namespace_of("k1"), namespace_of("k2")
    store.put(one, response("resp_a"), [{"id": "msg_1"}])
    assert store.get(one, "resp_a")[1] == [{"id": "msg_1"}]
    assert store.get(two, "resp_a") is None and store.get(namespace_of(None), "resp_a") is None
    assert not store.delete(two, "resp_a") and store.delete(one, "resp_a") and store.get(one, "resp_a") is None
    store.put(two, response("resp_a"), [])  # the same id in two namespaces: two responses
    assert not store.update(one, response("resp_a", "failed")) and store.get(two, "resp_a")[0]["status"] == "completed"


def test_put_replaces_and_update_changes(location):
    store = open_store(location)
    store.put("", response("resp_a", "in_progress"), [{"id": "msg_1"}])
    assert store.update("", {**response("resp_a"), "output": [{"id": "msg_2"}]})
    got, items = store.get("", "resp_a")
    assert got["status"] == "completed" and got["output"] == [{"id": "msg_2"}] and items == [{"id": "msg_1"}]
    replaced = response("resp_a", "failed", created_at=time.time() - 5)
    store.put("", replaced, [])
    assert store.get("", "resp_a") == (replaced, [])
    assert not store.update("", response("resp_missing"))
    store.close()


def test_retention_by_count_and_age(location):
    store = open_store(location, max_count=2, max_age_s=3600)
    for k in range(3):
        store.put("", response(f"resp_{k}", created_at=time.time() + k), [])
    assert store.get("", "resp_0") is None and store.get("", "resp_2") is not None  # the oldest went first
    store.put("", response("resp_old", created_at=time.time() - 7200), [])
    assert store.get("", "resp_old") is None
    unlimited = open_store(location, max_count=None, max_age_s=None)
    for k in range(4):
        unlimited.put("", response(f"resp_more_{k}", created_at=time.time() - 7200), [])
    assert all(unlimited.get("", f"resp_more_{k}") is not None for k in range(4))


def test_unfinished_responses_fail_on_reopen(location):
    store = open_store(location)
    store.put("", response("resp_run", "in_progress"), [])
    store.put("", response("resp_queued", "queued"), [])
    store.put("", response("resp_done"), [])
    store.close()
    again = open_store(location)
    for rid in ("resp_run", "resp_queued"):
        failed = again.get("", rid)[0]
        assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert again.get("", "resp_done")[0]["status"] == "completed"


@pytest.mark.integration
def test_postgres_leaves_a_live_servers_responses_running(postgres):
    """Two servers on one database: one opening its store fails only the responses of a server that
    is gone, not those another live server is still making."""
    url = fresh_database(postgres)
    first = open_store(url)
    first.put("", response("resp_run", "in_progress"), [])
    second = open_store(url)
    assert second.get("", "resp_run")[0]["status"] == "in_progress"
    assert first.update("", response("resp_run")) and second.get("", "resp_run")[0]["status"] == "completed"
    first.put("", response("resp_run2", "in_progress"), [])
    first.close()  # as its server stopping without finishing it (a crash closes the connection too)
    assert second.get("", "resp_run2")[0]["status"] == "in_progress"
    third = open_store(url)
    assert third.get("", "resp_run2")[0]["status"] == "failed"
    assert second.get("", "resp_run")[0]["status"] == "completed"


@pytest.mark.integration
def test_postgres_connection_dropped_then_gone(postgres):
    """A connection the database dropped is opened again (its lock retaken); a database that stays
    away is a 503 naming the store."""
    import psycopg

    url = fresh_database(postgres)
    store = open_store(url)
    store.put("", response("resp_run", "in_progress"), [])

    def drop(name: str, allow: bool) -> None:
        with psycopg.connect(postgres.get_uri(), autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS {allow}")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))

    name = url.split("?")[0].rsplit("/", 1)[1]
    drop(name, True)
    assert store.get("", "resp_run")[0]["status"] == "in_progress"  # connected again
    assert open_store(url).get("", "resp_run")[0]["status"] == "in_progress"  # its lock is held again
    drop(name, False)
    with pytest.raises(APIError) as caught:
        store.get("", "resp_run")
    assert caught.value.status == 503 and caught.value.code == "store_unavailable"
    drop(name, True)
    assert store.update("", response("resp_run"))  # back when the database is


def test_postgres_is_optional(monkeypatch, tmp_path):
    """Without psycopg a Postgres URL is refused with what to install; SQLite paths need nothing."""
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delitem(sys.modules, "llmserve.responses.pg_store", raising=False)
    url = "postgresql://user:secret@db.example:5432/llm"
    assert location_problem(url) == PSYCOPG_MISSING and location_problem(str(tmp_path / "s.sqlite")) is None
    with pytest.raises(RuntimeError, match="psycopg"):
        open_store(url)
    with pytest.raises(ValidationError, match="responses: store: .*psycopg"):  # the gateway's config, at start
        ResponsesConfig(store=url)
    assert ResponsesConfig(store=str(tmp_path / "s.sqlite")).store
    assert open_store(tmp_path / "s.sqlite").get("", "resp_x") is None
    assert redacted(url) == "postgresql://user:***@db.example:5432/llm" and "secret" not in redacted(url)
    assert redacted("postgres:///llm?host=/tmp") == "postgres:///llm?host=/tmp"


def test_items_become_chat_messages():
    items = normalize_items([
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "one"}]},
    ])  # fmt: skip
    assert all(item["id"] and item["status"] == "completed" for item in items)
    messages = chat_messages(items, "Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["content"] == "Let me look." and [c["id"] for c in messages[2]["tool_calls"]] == [
        "call_1",
        "call_2",
    ]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "one"}


@pytest.mark.parametrize(
    ("raw", "param"),
    [(5, "input"), ([{"type": "message", "role": "user"}], "input[0].content"),
     ([{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}], "input[0].content[0].type")],
)  # fmt: skip
def test_bad_items_name_the_field(raw, param):
    with pytest.raises(APIError) as caught:
        normalize_items(raw)
    assert caught.value.status == 400 and caught.value.param == param
