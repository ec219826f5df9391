"""The Responses API's SQLite store: namespaces, retention, restarts; and how input items are read."""

from __future__ import annotations

import time

import pytest

from llmserve.openai.errors import APIError
from llmserve.responses.items import chat_messages, normalize_items
from llmserve.responses.store import ResponseStore, namespace_of


def response(rid: str, status: str = "completed", created_at: float | None = None) -> dict:
    return {"id": rid, "status": status, "created_at": time.time() if created_at is None else created_at, "output": []}


def test_namespaces_are_apart(tmp_path):
    store = ResponseStore(tmp_path / "s.sqlite")
    one, two = namespace_of("k1"), namespace_of("k2")
    store.put(one, response("resp_a"), [{"id": "msg_1"}])
    assert store.get(one, "resp_a")[1] == [{"id": "msg_1"}]
    assert store.get(two, "resp_a") is None and store.get(namespace_of(None), "resp_a") is None
    assert not store.delete(two, "resp_a") and store.delete(one, "resp_a") and store.get(one, "resp_a") is None


def test_retention_by_count_and_age(tmp_path):
    store = ResponseStore(tmp_path / "s.sqlite", max_count=2, max_age_s=3600)
    for k in range(3):
        store.put("", response(f"resp_{k}", created_at=time.time() + k), [])
    assert store.get("", "resp_0") is None and store.get("", "resp_2") is not None  # the oldest went first
    store.put("", response("resp_old", created_at=time.time() - 7200), [])
    assert store.get("", "resp_old") is None


def test_unfinished_responses_fail_on_reopen(tmp_path):
    path = tmp_path / "s.sqlite"
    store = ResponseStore(path)
    store.put("", response("resp_run", "in_progress"), [])
    store.put("", response("resp_done"), [])
    store.close()
    again = ResponseStore(path)
    failed = again.get("", "resp_run")[0]
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert again.get("", "resp_done")[0]["status"] == "completed"


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
