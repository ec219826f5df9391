"""The watchdog's reading of /proc: which model's backend stubs are alive (the real kill-and-reload
runs are in test_platform_up.py)."""

from __future__ import annotations

from llmserve.triton.watchdog import stub_instances


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
