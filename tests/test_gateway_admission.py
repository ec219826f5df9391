"""Admission through a real gateway process: the concurrency cap, shedding by queueing delay,
and the key's priority reaching the engine's scheduler."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest
from gateway_utils import spawn_gateway, spawn_replica
from server_utils import free_port, metric, wait_healthy

from llmserve.config import TINY_MODEL_DIR
from llmserve.gateway.admission import Admission, Refused
from llmserve.gateway.config import AdmissionConfig, hash_key
from llmserve.gateway.dashboard import Sample, engine_queue_delay

pytestmark = pytest.mark.integration

KEYS = {"low": "sk-low", "high": "sk-high"}
HOLD = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True}  # about 2 s on the tiny model, CPU
SHORT = {"prompt": "x", "max_tokens": 4}


def _config(url: str, admission: dict) -> dict:
    return {
        "models": {"tiny": {"replicas": [url], "model": "tiny-up"}},
        "keys": [
            {"name": "low", "sha256": hash_key(KEYS["low"]), "priority": 0},
            {"name": "high", "sha256": hash_key(KEYS["high"]), "priority": 10},
        ],
        "admission": admission,
    }


@pytest.fixture(scope="module")
def admission(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admission")
    port = free_port()
    # the tiny model (slow enough to hold a slot), one sequence at a time: a second
    # request waits in the engine's queue
    replica = spawn_replica(
        str(TINY_MODEL_DIR), "tiny-up", port, str(tmp / "replica.log"), "--max-num-seqs", "1", "--max-model-len", "1024"
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    shed = {"max_concurrency": 1, "queue_timeout_s": 10, "target_queue_delay_ms": 300}
    capped = {"max_concurrency": 3, "queue_timeout_s": 0.3}
    engine = {"target_queue_delay_ms": 300}  # no cap: only the engine's own queue can shed
    gateways = {
        "shed": spawn_gateway(_config(url, shed), free_port(), str(tmp), name="shed"),
        "capped": spawn_gateway(_config(url, capped), free_port(), str(tmp), name="capped"),
        "engine": spawn_gateway(_config(url, engine), free_port(), str(tmp), name="engine"),
    }
    for server in (replica, *gateways.values()):  # started together, waited for in turn
        wait_healthy(server)
    for gw in gateways.values():  # and each gateway has seen the replica up
        _wait(lambda gw=gw: httpx.get(gw.base_url + "/health").json()["upstreams"][url])
    yield {"replica": replica, **gateways}
    for server in (*gateways.values(), replica):
        server.stop()


def _post(gateway, key: str, body: dict) -> tuple[httpx.Response, float, float]:
    """The reply, how long it took, and when it came back."""
    started = time.monotonic()
    resp = httpx.post(
        gateway.base_url + "/v1/completions", json={"model": "tiny", **body},
        headers={"Authorization": f"Bearer {KEYS[key]}"}, timeout=60,
    )  # fmt: skip
    now = time.monotonic()
    return resp, now - started, now


def _answered(gateway, status: int) -> float:
    """Requests the gateway has answered with `status`, all aliases."""
    lines = httpx.get(gateway.base_url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("llmserve_gateway_requests_total{") and f'status="{status}"' in line)  # fmt: skip


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_queue_serves_higher_priority_first():
    async def run() -> list[str]:
        admission = Admission(AdmissionConfig(max_concurrency=1), [0, 10])
        first = await admission.acquire(0)
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            slot = await admission.acquire(priority)
            order.append(name)
            slot.release()

        tasks = [asyncio.create_task(wait("low", 0))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(wait("high", 10)))
        await asyncio.sleep(0.01)
        assert admission.waiting() == 2 and admission.queueing_delay() > 0
        first.release()
        await asyncio.gather(*tasks)
        assert admission.in_flight == 0 and admission.waiting() == 0
        return order

    assert asyncio.run(run()) == ["high", "low"]


def test_timeout_while_queued_gives_the_slot_to_no_one():
    async def run() -> None:
        admission = Admission(AdmissionConfig(max_concurrency=1, queue_timeout_s=0.05), [0])
        held = await admission.acquire(0)
        with pytest.raises(Refused) as info:
            await admission.acquire(0)
        assert info.value.reason == "queue_timeout"
        held.release()
        held.release()  # a second release changes nothing
        assert admission.in_flight == 0
        (await admission.acquire(0)).release()

    asyncio.run(run())


def test_lowest_priority_is_shed_when_queueing_delay_passes_the_target(admission):
    gw, replica = admission["shed"], admission["replica"]
    done_before = metric(replica.base_url, "vllm:request_success_total")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        holder = pool.submit(_post, gw, "high", HOLD)
        _wait(lambda: metric(gw.base_url, "llmserve_gateway_in_flight") == 1)
        low = pool.submit(_post, gw, "low", SHORT)
        _wait(lambda: metric(gw.base_url, "llmserve_gateway_queue_waiting") == 1)
        high = pool.submit(_post, gw, "high", SHORT)
        resp, took, _ = low.result()
        # the waiting low-priority request is refused once its wait crosses the target
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_delay", resp.text
        assert int(resp.headers["Retry-After"]) >= 1 and 0.25 < took < 2
        # the high-priority one still waits: once it has waited past the target, a new
        # low-priority request is shed at once
        _wait(lambda: metric(gw.base_url, "llmserve_gateway_queueing_delay_seconds") > 0.35)
        assert not holder.done() and not high.done()
        resp, took, _ = _post(gw, "low", SHORT)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_delay" and took < 0.25
        assert high.result()[0].status_code == 200 and holder.result()[0].status_code == 200
    assert _post(gw, "low", SHORT)[0].status_code == 200  # no queue any more: served again
    assert metric(replica.base_url, "vllm:request_success_total") - done_before == 3  # shed ones never went up


def test_a_client_leaving_the_queue_frees_its_place_at_once(admission):
    """A request waiting for a slot whose client disconnects leaves the queue then (a 499,
    counted), not when the queue timeout (10 s here) or the slot comes; it never goes upstream."""
    gw, replica = admission["shed"], admission["replica"]
    done_before = metric(replica.base_url, "vllm:request_success_total")
    left_before = _answered(gw, 499)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holder = pool.submit(_post, gw, "high", HOLD)  # about 2 s
        _wait(lambda: metric(gw.base_url, "llmserve_gateway_in_flight") == 1)
        with pytest.raises(httpx.ReadTimeout):  # the high class is never shed: it would wait
            httpx.post(gw.base_url + "/v1/completions", json={"model": "tiny", **SHORT},
                       headers={"Authorization": f"Bearer {KEYS['high']}"}, timeout=httpx.Timeout(30, read=0.3))  # fmt: skip
        left = time.monotonic()
        _wait(lambda: metric(gw.base_url, "llmserve_gateway_queue_waiting") == 0, timeout=1.0)
        assert time.monotonic() - left < 1.0 and not holder.done()
        assert holder.result()[0].status_code == 200
    assert _answered(gw, 499) == left_before + 1
    assert metric(replica.base_url, "vllm:request_success_total") - done_before == 1  # only the holder went up


def test_priority_reaches_the_engine_and_the_cap_bounds_the_wait(admission):
    gw, replica = admission["capped"], admission["replica"]
    body = {"prompt": "y", "max_tokens": 60, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        holder = pool.submit(_post, gw, "low", HOLD)
        _wait(lambda: metric(replica.base_url, "vllm:num_requests_running") == 1)
        low = pool.submit(_post, gw, "low", body)
        _wait(lambda: metric(replica.base_url, "vllm:num_requests_waiting") == 1)
        high = pool.submit(_post, gw, "high", body)  # arrives later, scheduled first
        _wait(lambda: metric(replica.base_url, "vllm:num_requests_waiting") == 2)
        resp, took, _ = _post(gw, "high", SHORT)  # three in flight: the cap; it waits 0.3 s
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_timeout"
        assert int(resp.headers["Retry-After"]) >= 1 and 0.25 < took < 2
        assert not holder.done()
        results = {name: f.result() for name, f in (("holder", holder), ("low", low), ("high", high))}
    assert all(r[0].status_code == 200 for r in results.values())
    assert results["high"][2] < results["low"][2]  # the engine took the high-priority request first


def test_client_leaving_a_non_streamed_request_cancels_it_upstream(admission):
    gw, replica = admission["capped"], admission["replica"]
    done_before = metric(replica.base_url, "vllm:request_success_total")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(
            gw.base_url + "/v1/completions", json={"model": "tiny", **HOLD},
            headers={"Authorization": f"Bearer {KEYS['low']}"}, timeout=httpx.Timeout(10, read=0.5),
        )  # fmt: skip
    # the gateway closes its upstream connection: the replica aborts the request, frees its blocks
    _wait(lambda: metric(replica.base_url, "vllm:num_requests_running") == 0, timeout=1.5)
    assert metric(replica.base_url, "vllm:num_kv_blocks_used") == 0
    assert metric(replica.base_url, "vllm:request_success_total") == done_before  # aborted, not finished
    _wait(lambda: metric(gw.base_url, "llmserve_gateway_in_flight") == 0, timeout=1)  # its slot is free


def test_engine_queue_delay_from_two_scrapes():
    base = {"waiting": 0.0, "queue_sum": 10.0, "queue_count": 4.0}
    a = Sample(100.0, base)
    assert engine_queue_delay(a, Sample(105.0, {**base, "queue_sum": 13.0, "queue_count": 6.0})) == 1.5
    assert engine_queue_delay(a, Sample(105.0, {**base, "waiting": 3.0})) == 5.0  # none scheduled, some wait
    assert engine_queue_delay(a, Sample(105.0, base)) == 0.0  # idle
    assert engine_queue_delay(a, Sample(105.0, {})) is None  # the scrape failed


class _EngineQueues:
    """The engines' queueing delay per alias, as the status sampler would report it."""

    def __init__(self, delays: dict[str, float]):
        self.delays = delays

    def engine_delay(self, alias: str) -> float:
        return self.delays[alias]


def test_engine_delay_sheds_the_lowest_priority_without_a_cap():
    async def scenario() -> None:
        engines = _EngineQueues({"busy": 0.5, "calm": 0.1, "jammed": 5.0})
        adm = Admission(AdmissionConfig(target_queue_delay_ms=300), [0, 10], engines)
        with pytest.raises(Refused) as refused:
            await adm.acquire(0, "busy")
        assert refused.value.reason == "queue_delay"
        (await adm.acquire(0, "calm")).release()  # under the target
        (await adm.acquire(10, "jammed")).release()  # the top class is never shed for delay

    asyncio.run(scenario())


def test_queueing_in_the_engine_sheds_low_priority_through_the_gateway(admission):
    """No concurrency cap: the gateway reads the delay from the replica's queue-time metric."""
    gw = admission["engine"]
    # idle (once the queueing of earlier tests has left the few-second window): served
    _wait(lambda: _post(gw, "low", SHORT)[0].status_code == 200, timeout=15)
    with concurrent.futures.ThreadPoolExecutor(128) as pool:  # a probe every 0.5 s for up to 60 s
        holders = [pool.submit(_post, gw, "high", HOLD) for _ in range(2)]  # one runs, one queues
        # Probes are sent without waiting for the ones admitted: an admitted low-priority probe
        # queues in the engine behind both holders, and a test that waited for it would see the
        # delay only when the engine is idle again (past any deadline on a loaded machine). The
        # delay reaches the metric when the queued holder starts, or after a few seconds with
        # nothing scheduled and something waiting; the gateway's sampler within a second more.
        probes: list[concurrent.futures.Future] = []
        deadline = time.monotonic() + 60
        shed = None
        while shed is None:
            assert time.monotonic() < deadline, "never shed while the engine queued for seconds"
            probes.append(pool.submit(_post, gw, "low", SHORT))
            time.sleep(0.5)  # a shed probe is answered within 0.25 s
            shed = next((p.result() for p in probes if p.done() and p.result()[0].status_code == 503), None)
        resp, took, _ = shed
        assert resp.json()["error"]["code"] == "queue_delay" and took < 0.25, resp.text
        assert all(h.result()[0].status_code == 200 for h in holders)  # the top class is served
        # nothing accepted is lost: each probe was served or shed at once
        assert all(p.result()[0].status_code in (200, 503) for p in probes)
