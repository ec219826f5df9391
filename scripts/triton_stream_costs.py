"""What one streamed response costs on the Triton path, on either side (a diagnosis, not a benchmark).

A decoupled Python model ("spray") answers one request with N responses shaped as the chat
model's (an INT32 status and one string), sent as fast as the stub sends them, and times its
own loop: `sender.send` alone, and with `request.is_cancelled()` before each send (as the chat
model did for every token). Beside the loop a second Python thread spins, as the engine's
output thread does in the chat model's stub while it takes a step's outputs: both calls wait
on Triton with the GIL released, and getting it back from a busy thread takes up to the
interpreter's switch interval, so each is timed at three intervals (sys.setswitchinterval).
The client reads the stream through tritonclient's asyncio gRPC client, as the gateway does.

    .venv/bin/python scripts/triton_stream_costs.py [--responses 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = """name: "spray"
backend: "python"
max_batch_size: 0
input [ { name: "request", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "status", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "response", data_type: TYPE_STRING, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
model_transaction_policy { decoupled: true }
"""
MODEL = """import server_path  # noqa
import json
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

CHUNK = 'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}'


def response(status, text):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("status", np.array([status], dtype=np.int32)),
        pb_utils.Tensor("response", np.array([text.encode("utf-8")], dtype=np.object_)),
    ])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            spec = json.loads(pb_utils.get_input_tensor_by_name(request, "request").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            sys.setswitchinterval(spec["switch_s"])
            spins, stop = [0], threading.Event()

            def spin():  # pure Python beside the sends: how much of the GIL the sends leave
                while not stop.is_set():
                    spins[0] += 1

            spinner = threading.Thread(target=spin)
            spinner.start()
            start = time.perf_counter()
            checks = 0.0
            for _ in range(spec["n"]):
                if spec["check_cancel"]:
                    t = time.perf_counter()
                    request.is_cancelled()
                    checks += time.perf_counter() - t
                sender.send(response(200, CHUNK))
            total = time.perf_counter() - start
            stop.set()
            spinner.join()
            sender.send(response(200, json.dumps({"total_s": total, "cancel_checks_s": checks, "spins": spins[0]})),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


async def read_stream(url: str, n: int, check_cancel: bool, switch_s: float) -> dict:
    import numpy as np
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    text = grpcclient.InferInput("request", [1], "BYTES")
    text.set_data_from_numpy(
        np.array([json.dumps({"n": n, "check_cancel": check_cancel, "switch_s": switch_s}).encode()], dtype=np.object_)
    )

    async def one():
        yield {"model_name": "spray", "inputs": [text], "request_id": "r"}

    start = time.perf_counter()
    count, last = 0, None
    async for result, error in client.stream_infer(one()):
        assert error is None, error
        count += 1
        int(result.as_numpy("status").reshape(-1)[0])
        last = result.as_numpy("response").reshape(-1)[0].decode()
        if not last.startswith("data: "):
            break
    elapsed = time.perf_counter() - start
    await client.close()
    model_side = json.loads(last)
    return {"responses": count, "client_s": round(elapsed, 4), "client_us_per_response": round(elapsed / count * 1e6, 1),
            "model_us_per_send": round((model_side["total_s"] - model_side["cancel_checks_s"]) / n * 1e6, 1),
            "model_us_per_cancel_check": round(model_side["cancel_checks_s"] / n * 1e6, 1) if check_cancel else None,
            "spins_per_ms_beside": round(model_side["spins"] / model_side["total_s"] / 1e3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--responses", type=int, default=3000)
    opts = ap.parse_args()
    from llmserve.net import free_port
    from llmserve.triton.build_repo import MODELS_DIR
    from llmserve.triton.server import TritonServer

    root = Path(tempfile.mkdtemp(prefix="spray-"))
    (root / "spray" / "1").mkdir(parents=True)
    (root / "spray" / "config.pbtxt").write_text(CONFIG)
    (root / "spray" / "1" / "model.py").write_text(MODEL)
    shutil.copyfile(MODELS_DIR / "server_path.py", root / "spray" / "1" / "server_path.py")
    server = TritonServer(str(root), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          exit_timeout_secs=3).start()  # fmt: skip
    try:
        server.wait_ready(timeout=120)
        url = f"127.0.0.1:{server.grpc_port}"
        for switch_s in (0.005, 0.0005, 0.0001):
            for check_cancel in (False, True):
                result = asyncio.run(read_stream(url, opts.responses, check_cancel, switch_s))
                print(json.dumps({"switch_interval_s": switch_s, "check_cancel": check_cancel, **result}))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
