"""Drive a running Triton server's repository API: load, unload, reload a model."""

from __future__ import annotations

import time


def _client(url: str, **timeouts: float):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url, **timeouts)


def _busy(client, model: str) -> bool:
    """Whether some version of `model` is still loaded or being unloaded."""
    states = [m.get("state") for m in client.get_model_repository_index() if m.get("name") == model]
    return any(state in ("READY", "UNLOADING", "LOADING") for state in states)


def ready_models(url: str) -> set[str]:
    """The models the server holds READY (quick timeouts: a server that does not answer raises)."""
    client = _client(url, connection_timeout=2.0, network_timeout=5.0)
    try:
        return {m["name"] for m in client.get_model_repository_index() if m.get("state") == "READY"}
    finally:
        client.close()


def load(url: str, model: str) -> None:
    client = _client(url)
    try:
        client.load_model(model)
    finally:
        client.close()


def unload(url: str, model: str, wait: float = 60.0) -> None:
    """Unload and wait until Triton reports the model gone (in-flight requests finish first)."""
    client = _client(url)
    try:
        client.unload_model(model)
        deadline = time.monotonic() + wait
        while _busy(client, model) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        client.close()


def reload(url: str, model: str) -> None:
    """Load again: Triton reads config and versions anew, serving the old version until
    the new one is ready, so no request is lost."""
    load(url, model)


def restart(url: str, model: str, wait: float = 60.0) -> None:
    """Unload, then load: for a model whose backend died (its stub was killed). Triton's load
    of a model whose files did not change does nothing, so `reload` cannot bring it back;
    requests in between are refused (unavailable), as the model is gone for that moment.
    `wait`: how long the unload may wait for in-flight requests (a decoupled request the dead
    stub was streaming never finishes, and its version stays UNLOADING; the load works anyway)."""
    unload(url, model, wait)
    load(url, model)
