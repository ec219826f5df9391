"""Shared fixtures: small random-weight models built locally for every architecture."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tiny test models: one thread per process beats two threads fighting over two cores
# (set before torch is imported, and inherited by the engine-core processes tests start)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run under its interpreter here (no GPU). Set before anything imports triton:
# tests/test_kernels.py and test_lora_kernels.py skip when triton was imported without it (a
# test module that imported triton first once made 123 kernel tests skip in the full run).
# The GPU tier (`pytest -m gpu` on a machine with CUDA) turns it off again in pytest_configure.
os.environ["TRITON_INTERPRET"] = "1"

import sys

import pytest
import torch

from llmserve.model.random_model import FAMILIES, make_random_model

GPU_TIER_SKIP = "the GPU tier: `pytest -m gpu` on a machine with CUDA"


def _gpu_tier(config) -> bool:
    """This run selects the gpu marker on a machine with CUDA."""
    expr = config.getoption("markexpr", "") or ""
    return "gpu" in expr and "not gpu" not in expr and torch.cuda.is_available()


def pytest_configure(config):
    # before any test module is imported: the kernels must compile for the GPU, not run interpreted
    if _gpu_tier(config) and "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter patches the language once per launch, not again at each jitted helper's
        # call (a third of the kernels' CPU time here; tests/interpreter_patch_once.py)
        from interpreter_patch_once import install

        install()


# the test files that took longest in CI (2026-12-07, slowest first). pytest-xdist hands out whole files
# (--dist loadfile) in collection order (--no-loadscope-reorder, pyproject.toml): these first, so that
# none starts last and keeps one core busy alone at the end; then the rest, most tests first (xdist's
# own order)
SLOW_FILES_FIRST = (
    "test_kernels.py", "test_platform_up.py", "test_gateway_placement.py", "test_gguf.py", "test_server.py",
    "test_lora_engine.py", "test_tensor_parallel.py", "test_kernel_compile.py", "test_schemathesis.py",
    "test_bench_multiturn.py", "test_platform_placement.py", "test_gateway_kv_routing.py", "test_gemma3.py",
    "test_ray_executor.py", "test_gateway.py",
)  # fmt: skip


def _slow_files_first(items) -> None:
    """Reorder `items` file by file (a file's tests keep their order): SLOW_FILES_FIRST, then the others."""
    counts: dict[str, int] = {}
    for item in items:
        counts[str(item.path)] = counts.get(str(item.path), 0) + 1
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}

    def key(item):
        path = str(item.path)
        return rank.get(item.path.name, len(rank)), -counts[path], path

    items.sort(key=key)


def pytest_collection_modifyitems(config, items):
    """The slowest test files first (SLOW_FILES_FIRST). gpu-marked tests run only in the GPU tier:
    without CUDA, or with Triton's interpreter on (any other run), they are skipped."""
    _slow_files_first(items)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason=GPU_TIER_SKIP)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# per family: what makes it that family, on top of the small shared shape
FAMILY_OVERRIDES = {
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }
    ),
    "mistral": dict(sliding_window=32),  # every layer windowed: prompts and outputs cross it
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(),
    "gemma3": dict(),  # a window of 16 on five of its six layers (random_model.py)
}  # fmt: skip


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        family: str(make_random_model(root / family, family, seed=i, **FAMILY_OVERRIDES[family]))
        for i, family in enumerate(FAMILIES)
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers generate(), greedy, float32, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.fixture(autouse=True)
def no_kv_leak(monkeypatch):
    """After every test, every engine the test built has all its KV blocks free again."""
    from llmserve.llm import LLM

    built = []
    original = LLM.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(LLM, "__init__", tracking_init)
    yield
    for llm in built:
        assert_no_leak(llm)


def assert_no_leak(llm) -> None:
    stats = llm.stats()
    assert stats.num_blocks_used == 0, f"{stats.num_blocks_used} KV blocks still held"
    assert stats.num_swapped_blocks == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


def mixed_batch(runner, rng, spans, samples=None):
    """A step's `BatchInputs` from `spans` (first new position, new tokens) of random tokens, each
    sequence on blocks of its own; `samples`: whether each samples (default: all)."""
    from llmserve.engine.input_builder import RowInput

    bs = runner.block_size
    items, next_block = [], 1
    for i, (start, count) in enumerate(spans):
        end = start + count
        table = list(range(next_block, next_block + -(-end // bs)))
        next_block += len(table)
        tokens = [rng.randrange(3, 500) for _ in range(end)]
        items.append(RowInput(f"r{i}", table, start, count, tokens, True if samples is None else samples[i]))
    return runner.inputs.build(items)
