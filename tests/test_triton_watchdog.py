"""The watchdog's reading of /proc: which model's backend stubs are alive (the real kill-and-reload
runs are in test_platform_up.py)."""

from __future__ import annotations

import pytest

from llmserve.triton.watchdog import stub_instances

pytestmark = pytest.mark.unit


def _proc(root, pid: int, argv: list[str]) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_stubs_are_found_per_model_and_instance_and_others_ignored(tmp_path):
    repo, proc = tmp_path / "model_repository", tmp_path / "proc"
    repo.mkdir()
    proc.mkdir()
    stub = "/tmp/tree/backends/python/triton_python_backend_stub"
    tail = ["triton_python_backend_shm_region_x", "1048576", "1048576", "42", "/tmp/tree/backends/python", "336"]
    _proc(proc, 10, [stub, f"{repo}/chat/1/model.py", *tail, "chat_0_0", "DEFAULT"])
    _proc(proc, 11, [stub, f"{repo}/chat/1/model.py", *tail, "chat_0_1", "DEFAULT"])
    _proc(proc, 12, [stub, f"{repo}/embed/3/model.py", *tail, "embed_0_0", "DEFAULT"])
    _proc(proc, 13, [stub, f"{tmp_path}/other_repository/chat/1/model.py", *tail, "chat_0_0", "DEFAULT"])
    _proc(proc, 14, ["/usr/bin/python3", f"{repo}/chat/1/model.py"])  # not a stub
    (proc / "15").mkdir()
    (proc / "15" / "cmdline").write_bytes(b"")  # a zombie
    (proc / "self").mkdir()
    assert stub_instances(repo, str(proc)) == {"chat": {"chat_0_0", "chat_0_1"}, "embed": {"embed_0_0"}}


def test_a_backend_death_ends_the_waiting_calls_but_a_client_leaving_stays_a_cancellation():
    """The gateway's side: calls waiting on a model's backend end with BackendDied when it dies
    (and a call of the old generation fails at its next wait); a task cancelled for another
    reason (the client left) is still cancelled, not turned into BackendDied."""
    import asyncio

    import pytest

    from llmserve.gateway.triton_upstream import Backend, BackendDied

    async def scenario():
        backend = Backend()

        async def wait_forever(generation: int):
            async with backend.watch(generation):
                await asyncio.Event().wait()

        waiting = [asyncio.ensure_future(wait_forever(0)) for _ in range(3)]
        await asyncio.sleep(0)
        assert len(backend.waiting) == 3
        backend.died()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, BackendDied) for r in results), results
        assert backend.waiting == set() and backend.generation == 1
        with pytest.raises(BackendDied):  # a call of the dead generation
            await wait_forever(0)
        leaving = asyncio.ensure_future(wait_forever(1))
        await asyncio.sleep(0)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert backend.waiting == set()

    asyncio.run(scenario())


def test_a_failed_restart_is_tried_again_and_too_many_restarts_give_up(tmp_path, monkeypatch):
    """The watchdog's decisions, with Triton's answers simulated: a stub missing on two looks
    is a restart; a restart that fails (the load ran out of memory) is tried again at the next
    look; the sixth restart within the window gives up (the platform then exits 1)."""
    from types import SimpleNamespace

    from llmserve.triton import watchdog as wd

    state = {"ready": {"chat"}, "alive": {"chat": {"chat_0_0"}}, "fail": 1, "restarts": 0}

    def restart(url, model, wait):
        state["restarts"] += 1
        if state["fail"]:
            state["fail"] -= 1
            state["ready"].discard(model)  # the unload went through, the load did not
            raise RuntimeError("out of memory")
        state["ready"].add(model)
        state["alive"][model] = {"chat_0_0"}

    monkeypatch.setattr(wd.control, "restart", restart)
    monkeypatch.setattr(wd, "stub_instances", lambda repo: {m: set(i) for m, i in state["alive"].items()})
    triton = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None), model_repository=str(tmp_path), url="x")
    gave_up = []
    dog = wd.Watchdog(triton, max_restarts=5, on_give_up=lambda: gave_up.append(True))
    monkeypatch.setattr(dog, "_ready_models", lambda: set(state["ready"]))
    dog.check()  # the stub is seen
    state["alive"]["chat"] = set()  # killed
    dog.check()
    assert state["restarts"] == 0  # one look is not enough
    dog.check()
    assert state["restarts"] == 1 and "chat" not in state["ready"]  # restarted, and the load failed
    dog.check()
    assert state["restarts"] == 2 and "chat" in state["ready"] and not dog._failed  # tried again: back
    assert [r["model"] for r in dog.restarts] == ["chat"]
    for _ in range(3):  # killed again and again: restarts 3, 4, 5 are allowed, the sixth gives up
        dog.check()  # the new stub is seen
        state["alive"]["chat"] = set()
        dog.check()
        dog.check()
    assert state["restarts"] == 5 and not gave_up
    dog.check()
    state["alive"]["chat"] = set()
    dog.check()
    dog.check()
    assert gave_up == [True] and dog.gave_up and state["restarts"] == 5


def test_a_python_model_ready_without_any_stub_is_restarted_even_if_never_seen(tmp_path, monkeypatch):
    """A stub that died before the watchdog's first look (a fast test, a crash at start): the
    model is READY, runs on the Python backend (its model.py is in the repository) and has no
    stub at all: a restart after two looks. A model of another backend has no stubs to miss."""
    from types import SimpleNamespace

    from llmserve.triton import watchdog as wd

    (tmp_path / "chat" / "1").mkdir(parents=True)
    (tmp_path / "chat" / "1" / "model.py").write_text("")
    (tmp_path / "onnx_model" / "1").mkdir(parents=True)
    restarted = []
    monkeypatch.setattr(wd.control, "restart", lambda url, model, wait: restarted.append(model))
    monkeypatch.setattr(wd, "stub_instances", lambda repo: {})
    triton = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None), model_repository=str(tmp_path), url="x")
    dog = wd.Watchdog(triton)
    monkeypatch.setattr(dog, "_ready_models", lambda: {"chat", "onnx_model"})
    dog.check()
    assert restarted == []
    dog.check()
    assert restarted == ["chat"]
