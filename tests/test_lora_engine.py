"""LoRA adapters through the engine (issue 22): `LLM(..., enable_lora=True).generate(...,
lora_request=LoRARequest(...))` against Hugging Face PEFT with each adapter merged, several
adapters and the base model in one call, more adapters than device slots, prefix caching
kept apart per adapter, bad adapters refused with the reason."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_lora import ADAPTERS, make_adapter

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.engine.output_processor import RequestFailedError
from llmserve.lora.errors import UNUSABLE_PATH_MESSAGE
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.integration

NEW_TOKENS = 6
ADMIN_KEY = "sk-admin-lora-7f3c"
# longer than two KV blocks of 8, sharing their first 17 tokens: prefix-cache hits across requests
SHARED = [1, 17, 94, 250, 33, 7, 401, 62, 5, 300, 12, 12, 88, 140, 230, 77, 19]
PROMPTS = [SHARED + [402, 9, 3], SHARED + [8, 8]]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = str(make_random_model(root / "base", "llama", seed=3))
    paths = {name: make_adapter(base, root / name, i, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}
    return base, paths


def merged_greedy(base: str, adapter, prompts: list[list[int]]) -> list[list[int]]:
    """The oracle: transformers with the adapter merged, each prompt alone, greedy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    outs = []
    with torch.no_grad():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p) :].tolist())
    return outs


def test_adapters_and_the_base_in_one_call_give_each_merged_models_tokens(lora_setup):
    """Four adapters (ranks 4, 8, 16 rsLoRA, 8 on one layer) and the base model, every prompt
    with each, in one generate call, on an engine with two device slots (the scheduler runs
    at most two adapters at once; the rest wait and take an evicted slot) and prefix caching
    on (each adapter's prompts share blocks with its own, never with another's)."""
    base, paths = lora_setup
    want = {None: merged_greedy(base, None, PROMPTS)} | {n: merged_greedy(base, p, PROMPTS) for n, p in paths.items()}
    assert len({tuple(map(tuple, v)) for v in want.values()}) == len(want)  # every adapter changes the tokens
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3,
              block_size=8, max_model_len=128)  # fmt: skip
    names = [None, *paths]
    requests = {n: LoRARequest(n, i + 1, str(paths[n])) if n else None for i, n in enumerate(names)}
    prompts = [{"prompt_token_ids": p} for _ in names for p in PROMPTS]
    loras = [requests[n] for n in names for _ in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second time, from the prefix cache (and adapters read from the host cache)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == [t for n in names for t in want[n]]
    assert llm.stats().prefix_cache_hits > 0
    assert llm.core.kv.pool.num_used == 0 and len(llm.core.runner.lora.store.loaded()) <= 2


def test_tensor_parallel_ranks_share_each_adapter_and_give_merged_peft_tokens(lora_setup):
    """tensor_parallel_size=2: each rank holds its share of every adapter (B's rows for q, k, v,
    gate, up; A's columns for o and down, whose shrink outputs are summed over the ranks), the
    driver's slot choices reach both ranks, and with one slot for three adapters (evictions on
    both ranks) every request still gets its merged model's tokens."""
    base, paths = lora_setup
    names = ["r4-qv", "r8-all", "r16-mlp-rslora", "r8-layer1"]
    want = {None: merged_greedy(base, None, PROMPTS)} | {n: merged_greedy(base, paths[n], PROMPTS) for n in names}
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, tensor_parallel_size=2,
              block_size=8, max_model_len=128)  # fmt: skip
    try:
        requests = {n: LoRARequest(n, i + 1, str(paths[n])) for i, n in enumerate(names)}
        order = [None, *names, "r4-qv"]  # the first adapter again after it was evicted
        prompts = [{"prompt_token_ids": p} for _ in order for p in PROMPTS]
        loras = [requests.get(n) for n in order for _ in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == [t for n in order for t in want[n]]
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_with_the_reason(lora_setup, tmp_path):
    base, paths = lora_setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64)
    params = SamplingParams(max_tokens=2)
    cases = {
        "missing": (LoRARequest("missing", 1, str(tmp_path / "nowhere")), "does not name a LoRA adapter folder"),
        "rank": (LoRARequest("big", 2, str(paths["r16-mlp-rslora"])), "rank"),
    }
    for request, words in cases.values():
        with pytest.raises(RequestFailedError, match=words):
            llm.generate([[1, 5, 9]], params, use_tqdm=False, lora_request=request)
    assert llm.generate([[1, 5, 9]], params, use_tqdm=False)[0].outputs[0].token_ids  # still serving
    plain = LLM(base, dtype="float32", max_model_len=64)
    with pytest.raises(RequestFailedError, match="enable-lora"):
        plain.generate([[1, 5, 9]], params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(paths["r4-qv"])))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "x")


def test_the_server_serves_adapters_by_model_name_and_loads_and_unloads_them(lora_setup, tmp_path):
    """`llmserve serve --enable-lora --lora-modules`: an adapter is a model name (the official
    client, the same tokens as the engine in process), listed in /v1/models with its parent;
    with --enable-runtime-lora-updating, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    behind the admin key, a bad adapter a 400 that changes nothing, requests running while their
    adapter unloads finish; each load and unload logged with the client, never the key."""
    import concurrent.futures

    import httpx
    from openai import OpenAI
    from server_utils import start_server

    base, paths = lora_setup
    srv = start_server([base, "--dtype", "float32", "--max-model-len", "128", "--served-model-name", "base",
                        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                        "--lora-modules", f"qv={paths['r4-qv']}", "--lora-roots", str(paths["r8-all"].parent),
                        "--enable-runtime-lora-updating"],
                       str(tmp_path / "server.log"),
                       env={"LLMSERVE_ADMIN_API_KEY": ADMIN_KEY})  # fmt: skip
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    prompt = PROMPTS[0]
    try:

        def tokens(model: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text.rstrip("\ufffd")  # fmt: skip

        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "qv"} and cards["qv"].parent == "base" and cards["qv"].root == str(paths["r4-qv"])
        want = {n: merged_greedy(base, p, [prompt])[0] for n, p in (("base", None), ("qv", paths["r4-qv"]),
                                                                    ("all", paths["r8-all"]))}  # fmt: skip
        from transformers import AutoTokenizer

        # the server holds back a last token that ends inside a UTF-8 character: compare without it
        text = {n: AutoTokenizer.from_pretrained(base).decode(ids, skip_special_tokens=True).rstrip("\ufffd")
                for n, ids in want.items()}  # fmt: skip
        got_base, got_qv = tokens("base"), tokens("qv")
        assert (got_base, got_qv) == (text["base"], text["qv"]) and got_base != got_qv
        load = {"lora_name": "all", "lora_path": str(paths["r8-all"])}
        assert httpx.post(srv.base_url + "/v1/load_lora_adapter", json=load).status_code == 401  # admin only
        bad = httpx.post(srv.base_url + "/v1/load_lora_adapter", headers=admin,
                         json={"lora_name": "bad", "lora_path": str(paths["r8-all"].parent / "nowhere")})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["message"] == UNUSABLE_PATH_MESSAGE
        for outside in ("/etc", str(paths["r8-all"].parent / ".." / ".."), str(tmp_path)):  # outside --lora-roots
            refused = httpx.post(srv.base_url + "/v1/load_lora_adapter", headers=admin,
                                 json={"lora_name": "x", "lora_path": outside})  # fmt: skip
            assert refused.status_code == 400 and refused.json() == bad.json(), refused.text  # the same answer
        assert httpx.post(srv.base_url + "/v1/load_lora_adapter", headers=admin, json=load).status_code == 200
        assert httpx.post(srv.base_url + "/v1/load_lora_adapter", headers=admin, json=load).status_code == 400
        assert {m.id for m in client.models.list().data} == {"base", "qv", "all"}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # unload "all" while requests on it run
            running = [pool.submit(tokens, "all") for _ in range(6)]
            unload = httpx.post(srv.base_url + "/v1/unload_lora_adapter", headers=admin, json={"lora_name": "all"})
            results = [f.result() for f in running]
        assert unload.status_code == 200 and results == [text["all"]] * 6
        gone = httpx.post(srv.base_url + "/v1/completions", json={"model": "all", "prompt": prompt, "max_tokens": 2})
        assert gone.status_code == 404
        assert httpx.post(srv.base_url + "/v1/unload_lora_adapter", headers=admin,
                          json={"lora_name": "all"}).status_code == 404  # fmt: skip
        assert tokens("qv") == got_qv and tokens("base") == got_base
        log = srv.log()
        assert f"LoRA adapter 'all' loaded from {str(paths['r8-all'])!r}" in log and "unloaded for 127.0.0.1:" in log
        assert ADMIN_KEY not in log
        # the gateway in front: an alias per adapter (`lora:`), keys limited to some of them
        from gateway_utils import start_gateway
        from server_utils import free_port

        key = {"name": "team-a", "sha256": __import__("hashlib").sha256(b"ka").hexdigest(), "models": ["sql"]}
        config = {"models": {"base": {"replicas": [srv.base_url], "model": "base"},
                             "sql": {"replicas": [srv.base_url], "lora": "qv"}}, "keys": [key]}  # fmt: skip
        gateway = start_gateway(config, free_port(), str(tmp_path))
        try:
            via = OpenAI(base_url=gateway.base_url + "/v1", api_key="ka")
            reply = via.completions.create(model="sql", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
            assert reply.choices[0].text.rstrip("\ufffd") == got_qv and reply.model == "sql"
            refused = httpx.post(gateway.base_url + "/v1/completions", headers={"Authorization": "Bearer ka"},
                                 json={"model": "base", "prompt": prompt, "max_tokens": 2})  # fmt: skip
            assert refused.status_code == 403  # this key may use the adapter only
        finally:
            gateway.stop()
    finally:
        srv.stop()


def test_runtime_lora_loading_is_an_explicit_choice_with_one_answer_for_every_unusable_path(lora_setup, tmp_path):
    """Issue 49, item 4. `--enable-lora` alone serves no loading routes (404, as vLLM without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING; before, anyone could load and unload); turned on, they need a
    key unless the operator allows them without one (and then only inside --lora-roots). Every
    unusable path gets the same 400 (before: "no adapter folder at '/root/.ssh'" told what exists)."""
    import subprocess
    import sys

    import httpx
    from server_utils import free_port, spawn, wait_healthy

    base, paths = lora_setup
    common = [base, "--dtype", "float32", "--max-model-len", "128", "--served-model-name", "base", "--enable-lora",
              "--max-lora-rank", "16"]  # fmt: skip
    refused = {  # settings that do not start, with their reason
        "needs a key": ["--enable-runtime-lora-updating"],
        "needs --enable-runtime-lora-updating and --lora-roots": ["--enable-runtime-lora-updating",
                                                                  "--allow-unauthenticated-lora-updating"],
        "only --enable-runtime-lora-updating serves": ["--lora-roots", str(tmp_path)],
    }  # fmt: skip
    for reason, flags in refused.items():
        run = subprocess.run([sys.executable, "-m", "llmserve", "serve", *common, *flags], capture_output=True,
                             text=True, timeout=120, env={k: v for k, v in os.environ.items() if "API_KEY" not in k})  # fmt: skip
        assert run.returncode != 0 and reason in run.stderr, run.stderr[-2000:]
    roots = tmp_path / "roots"
    roots.mkdir()
    (roots / "adapter").symlink_to(paths["r8-all"])  # inside the roots, but leading out of them
    (roots / "empty").mkdir()
    (roots / "a file").write_text("x")
    shutil.copytree(paths["r4-qv"], roots / "qv")
    ports = free_port(), free_port()
    closed = spawn([sys.executable, "-m", "llmserve", "serve", *common, "--port", str(ports[0]),
                    "--lora-modules", f"qv={paths['r4-qv']}"], ports[0], str(tmp_path / "closed.log"))  # fmt: skip
    open_ = spawn([sys.executable, "-m", "llmserve", "serve", *common, "--port", str(ports[1]),
                   "--enable-runtime-lora-updating", "--allow-unauthenticated-lora-updating", "--lora-roots", str(roots)],
                  ports[1], str(tmp_path / "open.log"))  # fmt: skip
    try:
        wait_healthy(closed, 240)
        wait_healthy(open_, 240)
        for route, body in (
            ("load", {"lora_name": "x", "lora_path": str(paths["r8-all"])}),
            ("unload", {"lora_name": "qv"}),
        ):
            assert httpx.post(f"{closed.base_url}/v1/{route}_lora_adapter", json=body).status_code == 404
        answers = [httpx.post(open_.base_url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
                   for path in ("/root/.ssh", "/nowhere/at/all", "/etc", "/etc/passwd", str(roots / "nowhere"),
                                str(roots / "empty"), str(roots / "a file"), str(roots / "adapter"),
                                str(roots / "qv" / ".." / ".." / ".."))]  # fmt: skip
        assert {a.status_code for a in answers} == {400} and len({a.text for a in answers}) == 1, [
            a.text for a in answers
        ]
        assert answers[0].json()["error"]["message"] == UNUSABLE_PATH_MESSAGE
        load = {"lora_name": "qv", "lora_path": str(roots / "qv")}
        assert httpx.post(open_.base_url + "/v1/load_lora_adapter", json=load).status_code == 200  # no key: allowed
        assert httpx.post(open_.base_url + "/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
        log = open_.log()
        assert f"LoRA adapter 'qv' loaded from {str(roots / 'qv')!r}" in log and "'qv' unloaded for 127.0.0.1:" in log
        assert "'/root/.ssh'" in log  # the operator sees what was asked, and why it was refused
    finally:
        closed.stop()
        open_.stop()
