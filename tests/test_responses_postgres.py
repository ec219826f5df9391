"""`llmserve serve --responses-store postgresql://...`: stored responses in a real Postgres server
(pgserver), through the official openai client; a killed server restarted on the same database keeps
them, and fails the one it was still making. Skipped without pgserver."""

from __future__ import annotations

import openai
import pytest
from pg_utils import fresh_database, postgres_server
from server_utils import start_server
from test_responses_server import ANSWER, KEYS, model_dir  # noqa: F401 - model_dir: the fixture

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def database():
    with postgres_server() as server:
        yield fresh_database(server)


def serve(model_dir, database: str, log: str):  # noqa: F811
    return start_server([str(model_dir), "--max-model-len", "512", "--served-model-name", "tiny", "--reasoning-parser",
                         "deepseek_r1", "--api-key", KEYS[0], "--api-key", KEYS[1], "--responses-store", database],
                        str(model_dir.parent / log))  # fmt: skip


def clients(server) -> tuple[openai.OpenAI, openai.OpenAI]:
    return tuple(openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0) for key in KEYS)


def test_postgres_store_across_a_restart(model_dir, database):  # noqa: F811
    server = serve(model_dir, database, "pg-server.log")
    try:
        client, other = clients(server)
        done = client.responses.create(**ANSWER)
        assert done.status == "completed" and client.responses.retrieve(done.id).model_dump() == done.model_dump()
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(done.id)
        busy = client.responses.create(model="tiny", input="Count.", max_output_tokens=480, background=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
        assert client.responses.retrieve(busy.id).status == "in_progress"
        server.proc.kill()  # no shutdown: as a crash (its connection, and so its lock, go with it)
        server.proc.wait()
    finally:
        server.stop()
    server = serve(model_dir, database, "pg-restarted.log")
    try:
        client, other = clients(server)
        assert client.responses.retrieve(done.id).model_dump() == done.model_dump()
        failed = client.responses.retrieve(busy.id)
        assert failed.status == "failed" and "stopped" in failed.error.message
        follow = client.responses.create(**{**ANSWER, "input": "Again?"}, previous_response_id=done.id)
        assert follow.status == "completed" and follow.usage.input_tokens > done.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            other.responses.create(**ANSWER, previous_response_id=done.id)
        client.responses.delete(done.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(done.id)
    finally:
        server.stop()
