"""What `bench soak` reads of the platform besides its replies: the memory and open files of
its processes (psutil), and the server's own gauges (`/metrics`, vLLM's names)."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

# gauge names (vLLM's, which llmserve's servers export) -> key in a window's `server`
GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


class ProcessProbe:
    """The processes given by PID and all their children, sampled each window. A process is
    labelled by its PID and command (`1234 llmserve serve`); one that exited drops out."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self._psutil = psutil
        self.roots = [psutil.Process(pid) for pid in pids]

    def sample(self) -> tuple[dict[str, float], dict[str, int]]:
        rss: dict[str, float] = {}
        files: dict[str, int] = {}
        for proc in self._tree():
            try:
                with proc.oneshot():
                    label = f"{proc.pid} {_short(proc.cmdline())}"
                    rss[label] = round(proc.memory_info().rss / (1 << 20), 1)
                    files[label] = proc.num_fds()
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
                continue
        return rss, files

    def _tree(self):
        seen = {}
        for root in self.roots:
            try:
                for proc in [root, *root.children(recursive=True)]:
                    seen[proc.pid] = proc
            except self._psutil.NoSuchProcess:
                continue
        return list(seen.values())


def _short(cmdline: list[str]) -> str:
    """A process's command in a few words: the program's name and its first arguments."""
    words = [w.rsplit("/", 1)[-1] for w in cmdline[:4] if not w.startswith("-")]
    return " ".join(words)[:60] or "?"


async def scrape_gauges(client: httpx.AsyncClient, base_url: str, headers: dict,
                        gauges: Mapping[str, str] = GAUGES) -> dict[str, float]:  # fmt: skip
    """The `gauges` (metric name -> key) the server exports now, summed over label sets; {}
    without /metrics."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10.0)
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for line in resp.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = gauges.get(name)
        if key is None:
            continue
        try:
            found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return found
