"""kv_aware routing end to end: two real `llmserve serve` replicas publishing KV events, the real
gateway subscribed to them, the official openai client. A conversation's next turn goes to the
replica that holds its prefix; streams that are stale (a publisher that does not answer, one that
sends junk) fall back to least outstanding, with the junk logged and the gateway serving on."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import zmq
from gateway_utils import spawn_replica, start_gateway
from server_utils import metric, wait_healthy

pytestmark = pytest.mark.integration

BLOCK = 16
SYSTEMS = [  # distinct from their first words: no block shared between conversations
    "Alpha team notes. You answer questions about sorting lists in Python, briefly.",
    "Bravo desk memo. You explain dictionaries and their methods to new programmers.",
    "Charlie log entry. You help with reading files, paths and text encodings.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_events_flag(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"})  # fmt: skip


def route(replicas: dict[str, tuple[int, int | None]]) -> dict:
    """A kv_aware route over replica URL -> (PUB port, replay port)."""
    sources = {
        url: {"endpoint": f"tcp://127.0.0.1:{pub}", "topic": "kv"}
        | ({"replay_endpoint": f"tcp://127.0.0.1:{rep}"} if rep else {})
        for url, (pub, rep) in replicas.items()
    }  # fmt: skip
    return {"replicas": list(replicas), "model": "tiny-kv", "routing": "kv_aware",
            "kv_events": {"replicas": sources, "probe_interval_s": 0.5, "probe_timeout_s": 1.0}}  # fmt: skip


@pytest.fixture(scope="module")
def replicas(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_routing")
    ports = {n: (free_port(), free_port(), free_port()) for n in ("a", "b")}
    spawned = {
        n: spawn_replica(llama_dir, "tiny-kv", http, str(tmp / f"{n}.log"), "--block-size", str(BLOCK),
                         "--kv-events-config", kv_events_flag(pub, rep))
        for n, (http, pub, rep) in ports.items()
    }  # fmt: skip
    up = {n: wait_healthy(s, 300.0) for n, s in spawned.items()}  # (a busy shared machine: slow starts)
    yield {"servers": up, "ports": ports, "tmp": tmp}
    for server in up.values():
        server.stop()


def wait_for(check, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kv_health(gateway) -> dict:
    return httpx.get(f"{gateway.base_url}/health").json()["kv_events"]["m"]


def decisions(gateway) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{gateway.base_url}/metrics").text.splitlines():
        if line.startswith("llmserve_gateway_routing_total{"):
            decision = line.split('decision="', 1)[1].split('"', 1)[0]
            out[decision] = out.get(decision, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def served_by(servers: dict, ask) -> tuple[str, object]:
    """Which replica answered `ask()` (sent one at a time): the one whose finished count grew."""
    before = {n: metric(s.base_url, "vllm:request_success_total") for n, s in servers.items()}
    answer = ask()
    wait_for(lambda: sum(metric(s.base_url, "vllm:request_success_total") for s in servers.values())
             > sum(before.values()), 10, "the request counted")  # fmt: skip
    grew = [n for n, s in servers.items() if metric(s.base_url, "vllm:request_success_total") > before[n]]
    assert len(grew) == 1, grew
    return grew[0], answer


def test_a_conversation_s_next_turn_goes_to_the_replica_holding_its_prefix(replicas, tmp_path):
    servers, ports = replicas["servers"], replicas["ports"]
    config = {"models": {"m": route({servers[n].base_url: ports[n][1:] for n in ("a", "b")})},
              "health": {"interval_s": 0.5}}  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp_path), "kv-gw")
    try:
        wait_for(lambda: kv_health(gateway)["tokenizer"] and all(r["live"] for r in kv_health(gateway)["replicas"].values()),
                 60, "the streams live and the tokenizer loaded")  # fmt: skip
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0)

        def chat(messages):
            return lambda: client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)

        first, histories = {}, []
        for i, system in enumerate(SYSTEMS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: how?"}]
            first[i], answer = served_by(servers, chat(messages))
            histories.append(messages + [{"role": "assistant", "content": answer.choices[0].message.content}])
        assert set(first.values()) == {"a", "b"}  # the first turns spread over both (nobody held them)
        wait_for(lambda: sum(sum(r["blocks"].values()) for r in kv_health(gateway)["replicas"].values()) > 0, 10,
                 "the gateway learned the blocks")  # fmt: skip
        hits_before = {n: metric(s.base_url, "vllm:prefix_cache_hits_total") for n, s in servers.items()}
        for i in reversed(range(len(SYSTEMS))):  # another order: taking turns would send them elsewhere
            messages = histories[i] + [{"role": "user", "content": "And then what?"}]
            replica, _ = served_by(servers, chat(messages))
            assert replica == first[i], f"conversation {i}: turn 1 on {first[i]}, turn 2 on {replica}"
        got = decisions(gateway)
        # (a first turn routed before any replica told its block size is a kv_fallback: by load too)
        assert got.get("kv_prefix") == len(SYSTEMS) and sum(got.values()) == 2 * len(SYSTEMS), got
        hits = sum(metric(s.base_url, "vllm:prefix_cache_hits_total") - hits_before[n] for n, s in servers.items())
        assert hits >= len(SYSTEMS) * BLOCK  # each second turn found its history cached where it went
        blocks = kv_health(gateway)["replicas"]
        assert all(r["blocks"].get("GPU", 0) > 0 for r in blocks.values()), blocks
    finally:
        gateway.stop()


def test_stale_and_garbled_streams_fall_back_to_least_outstanding(replicas, tmp_path):
    """Replica a's events come from a publisher that sends junk (and has no replay socket);
    replica b's from an address where nobody answers. Both streams are stale; requests are
    routed by load (taking turns), the junk is logged and counted, and the gateway serves on."""
    servers = replicas["servers"]
    junk_port, silent_pub, silent_replay = free_port(), free_port(), free_port()
    context = zmq.Context()
    junk = context.socket(zmq.PUB)
    junk.bind(f"tcp://127.0.0.1:{junk_port}")
    stop = threading.Event()

    def send_junk():
        payloads = [[b"kv", b"\x00" * 8, b"\xc1\xc1 not msgpack"], [b"kv", b"x"], [b"kv", b"\x00" * 8, b"\x92\x01"]]
        while not stop.is_set():
            for frames in payloads:
                junk.send_multipart(frames)
            time.sleep(0.05)

    sender = threading.Thread(target=send_junk, daemon=True)
    sender.start()
    config = {"models": {"m": route({servers["a"].base_url: (junk_port, None),
                                     servers["b"].base_url: (silent_pub, silent_replay)})}}  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp_path), "kv-stale")
    try:
        wait_for(lambda: "the publisher does not answer" in json.dumps(kv_health(gateway)), 30, "b stale")
        wait_for(lambda: metric(gateway.base_url, "llmserve_gateway_kv_events_bad_total") > 0, 30, "junk counted")
        streams = kv_health(gateway)["replicas"]
        assert not any(r["live"] for r in streams.values()), streams
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Once more?"}]
        went = [served_by(servers, lambda: client.chat.completions.create(model="m", messages=messages,
                                                                           max_tokens=4))[0]
                for _ in range(4)]  # fmt: skip
        assert sorted(went) == ["a", "a", "b", "b"]  # the same prompt, yet taking turns: by load
        assert decisions(gateway) == {"kv_fallback": 4.0}
        assert httpx.get(f"{gateway.base_url}/health").status_code == 200
        log = gateway.log()
        assert "ignored a message" in log and "Traceback" not in log
    finally:
        stop.set()
        sender.join()
        gateway.stop()
        context.destroy(linger=0)
