"""Speculative decoding with EAGLE and EAGLE-3 heads (model/eagle.py, model/eagle_format.py,
engine/spec_eagle.py): heads written in the published format over tiny targets; lossless against
the engine without them; their proposals equal a plain-PyTorch head over transformers' hidden
states; heads built to agree with their target accepted; the target's distribution kept for
sampled requests; the head's cache left empty; malformed heads refused naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.engine.request import EngineCoreRequest
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.unit

H, Q, KV, INTER = 64, 64, 32, 128  # the tiny Llama's shape (model/random_model.py)
AUX = (0, 1, 3)  # the EAGLE-3 heads' target layers (of 4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 5, 9, 30, 44, 7, 8, 100, 101, 5, 9, 30], [1, 2, 3], [1] + list(range(200, 236))]


def _spec(method: str, head: str, k: int = 3, **more) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k, **more}


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _head_tensors(method: str, vocab: int, seed: int, draft_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """A random head in the published names (EAGLE-3's layer as `midlayer.`)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    attn_in = 2 * H if method == "eagle3" else H
    layer = {"self_attn.q_proj.weight": r(Q, attn_in), "self_attn.k_proj.weight": r(KV, attn_in),
             "self_attn.v_proj.weight": r(KV, attn_in), "self_attn.o_proj.weight": r(H, Q),
             "mlp.gate_proj.weight": r(INTER, H), "mlp.up_proj.weight": r(INTER, H), "mlp.down_proj.weight": r(H, INTER),
             "post_attention_layernorm.weight": 1 + r(H)}  # fmt: skip
    if method == "eagle":
        return {**{f"layers.0.{k}": v for k, v in layer.items()}, "fc.weight": r(H, 2 * H), "fc.bias": r(H)}
    dv = draft_vocab or vocab
    ids = torch.randperm(vocab, generator=g)[:dv].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    layer.update({"input_layernorm.weight": 1 + r(H), "hidden_norm.weight": 1 + r(H)})
    return {**{f"midlayer.{k}": v for k, v in layer.items()}, "fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H),
            "lm_head.weight": r(dv, H), "d2t": ids - torch.arange(dv), "t2d": t2d}  # fmt: skip


def _write_head(folder: Path, target: str, method: str, tensors: dict[str, torch.Tensor], **config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target) / "config.json").read_text())
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    if method == "eagle3":
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(tensors["lm_head.weight"]),
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX)})  # fmt: skip
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


def _variant(src: str, dst: Path, change) -> str:
    """A copy of the target `src` whose tensors `change` edits in place."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def target_with_heads(root: Path) -> tuple[str, dict[str, str]]:
    """A 4-layer random Llama target under `root` and a random head of each method for it (EAGLE-3's
    with a 300-token draft vocabulary): (target folder, method -> head folder)."""
    target = str(make_random_model(root / "target", "llama", seed=0, num_hidden_layers=4))
    heads = {m: _write_head(root / m, target, m, _head_tensors(m, 512, seed=1, draft_vocab=300 if m == "eagle3" else None))
             for m in ("eagle", "eagle3")}  # fmt: skip
    return target, heads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer target, random heads of both methods, and the engine's greedy tokens without them."""
    root = tmp_path_factory.mktemp("eagle")
    target, heads = target_with_heads(root)
    plain = _generate(LLM(target, max_model_len=128), PROMPTS, GREEDY)
    return target, heads, plain, root


def _head_cache_empty(llm: LLM) -> bool:
    blocks = llm.core.draft.blocks
    return blocks.num_free == blocks.num_blocks and not blocks.seqs and not llm.core.draft.store.chunks


VARIANTS = {
    "plain": dict(),
    "chunked-no-prefix-cache": dict(
        enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=False
    ),
    "preempt": dict(
        block_size=8, num_gpu_blocks_override=12, max_model_len=96, swap_space=0, admission_reserve_tokens=0
    ),
}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_the_engine_without_speculation(tiny, method, variant):
    """Random heads (they rarely agree with the target): the same tokens, through chunked prefill,
    prefix-cache hits (the repeated prompt) and preemption; the head's pool empty at the end."""
    target, heads, plain, _ = tiny
    options = {"max_model_len": 128, **VARIANTS[variant]}
    llm = LLM(target, speculative_config=_spec(method, heads[method]), **options)
    assert _generate(llm, PROMPTS, GREEDY) == plain
    assert _generate(llm, PROMPTS[:1], GREEDY) == plain[:1]  # (a prefix-cache hit where caching is on)
    stats = llm.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if variant == "preempt":
        assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert _head_cache_empty(llm)


# -- proposals against an oracle: transformers' hidden states, a plain-PyTorch head ---------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_proposals(hf, w: dict, method: str, tokens: list[int], k: int) -> list[int]:
    """The head's greedy proposals after `tokens`, every pair recomputed over the whole sequence:
    pair t = (token t + 1, the target's feature of position t) from transformers' hidden states."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [0] embeddings, [-1] final normed
        if method == "eagle3":
            feats = torch.cat([hs[i][0] for i in AUX], -1) @ w["fc.weight"].T
        else:
            feats = hs[-1][0]
        ids, feats = list(tokens[1:]), feats[:-1]
        embed, p = hf.model.embed_tokens.weight, "midlayer." if method == "eagle3" else "layers.0."
        out = []
        for _ in range(k):
            n = len(ids)
            emb = embed[torch.tensor(ids)]
            if method == "eagle3":
                x_in, residual = torch.cat([_rms(emb, w[p + "input_layernorm.weight"]),
                                            _rms(feats, w[p + "hidden_norm.weight"])], -1), feats  # fmt: skip
            else:
                x_in = torch.cat([emb, feats], -1) @ w["fc.weight"].T + w["fc.bias"]
                residual = x_in
            q = (x_in @ w[p + "self_attn.q_proj.weight"].T).view(n, 4, 16).transpose(0, 1)
            kk = (x_in @ w[p + "self_attn.k_proj.weight"].T).view(n, 2, 16).transpose(0, 1)
            v = (x_in @ w[p + "self_attn.v_proj.weight"].T).view(n, 2, 16).transpose(0, 1)
            cos, sin = hf.model.rotary_emb(v, torch.arange(n)[None])
            q, kk = apply_rotary_pos_emb(q[None], kk[None], cos, sin)
            kk, v = kk[0].repeat_interleave(2, 0), v.repeat_interleave(2, 0)
            attn = torch.nn.functional.scaled_dot_product_attention(q[0], kk, v, is_causal=True)
            h = attn.transpose(0, 1).reshape(n, Q) @ w[p + "self_attn.o_proj.weight"].T + residual
            m = _rms(h, w[p + "post_attention_layernorm.weight"])
            m = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
            out_state = m @ w[p + "mlp.down_proj.weight"].T + h
            if method == "eagle3":
                draft = int((_rms(out_state[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
                token = draft + int(w["d2t"][draft])
            else:
                token = int(hf.lm_head(out_state[-1]).argmax())
            out.append(token)
            ids.append(token)
            feats = torch.cat([feats, out_state[-1:]])
    return out


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_proposals_equal_a_plain_head_over_transformers_hidden_states(tiny, method):
    """Every greedy proposal the engine's head made equals the oracle's: the target's captured
    states (EAGLE-1 the final normed ones, EAGLE-3 those entering layers 0, 1, 3 through fc), the
    pairs' alignment, the rollback of the head's own features, and EAGLE-3's d2t."""
    from transformers import AutoModelForCausalLM

    target, heads, plain, _ = tiny
    llm = LLM(target, max_model_len=128, enable_prefix_caching=False, speculative_config=_spec(method, heads[method]))
    seen = []
    propose = llm.core.draft.propose

    def recording(requests, ks):
        proposals, probs = propose(requests, ks)
        seen.extend((list(r.all_token_ids), p) for r, p in zip(requests, proposals))
        return proposals, probs

    llm.core.draft.propose = recording
    assert _generate(llm, PROMPTS[:2], GREEDY) == plain[:2]
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    weights = load_file(str(Path(heads[method]) / "model.safetensors"))
    assert len(seen) > 10
    for tokens, proposal in seen:
        assert proposal == _reference_proposals(hf, weights, method, tokens, len(proposal)), tokens


# -- heads that agree with their target --------------------------------------------------------------
def test_an_eagle_head_that_reproduces_its_target_is_always_accepted(tiny):
    """A target whose attention outputs are zero and whose layers after the first add nothing (the
    next token a function of the last), and an EAGLE-1 head computing that function: fc passes the
    embedding, the head's MLP and norm are the target's first layer's (its attention zero), the
    target's LM head reads it (the target's final norm is all ones: the argmax keeps). Every
    proposal is accepted."""
    target, _, _, root = tiny

    def markov(t):
        for i in range(4):
            t[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
            if i:
                t[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
        t["model.norm.weight"].fill_(1.0)

    markov_dir = _variant(target, root / "markov", markov)
    tw = load_file(str(Path(markov_dir) / "model.safetensors"))
    head = _head_tensors("eagle", 512, seed=5)
    head["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    head["fc.bias"] = torch.zeros(H)
    head["layers.0.self_attn.o_proj.weight"].zero_()
    for name in (
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "post_attention_layernorm.weight",
    ):
        head[f"layers.0.{name}"] = tw[f"model.layers.0.{name}"]
    head_dir = _write_head(root / "markov-head", markov_dir, "eagle", head)
    plain = _generate(LLM(markov_dir, max_model_len=128), PROMPTS, GREEDY)
    llm = LLM(markov_dir, max_model_len=128, speculative_config=_spec("eagle", head_dir, k=4))
    assert _generate(llm, PROMPTS, GREEDY) == plain
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_num_drafts * 3 < sum(len(t) for t in plain)  # several tokens a step


def test_an_eagle3_head_over_a_reduced_vocabulary_is_accepted(tiny):
    """A target that repeats its last token (attention and MLPs add nothing; its LM head is its
    embedding, rows of norm 1), and an EAGLE-3 head that reads the state entering layer 0 (the
    embedding) through fc and maps it back through its own LM head over 300 of the 512 tokens (d2t):
    once the repeated token is in the draft vocabulary, every proposal is accepted."""
    target, _, _, root = tiny

    def echo(t):
        emb = t["model.embed_tokens.weight"]
        emb /= emb.norm(dim=1, keepdim=True)
        t["lm_head.weight"] = emb.clone()
        for i in range(4):
            t[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
            t[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
        t["model.norm.weight"].fill_(1.0)

    echo_dir = _variant(target, root / "echo", echo)
    emb = load_file(str(Path(echo_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    head = _head_tensors("eagle3", 512, seed=6, draft_vocab=300)
    ids = torch.arange(300) + head["d2t"]
    head["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1)  # the state entering layer 0
    head["midlayer.self_attn.o_proj.weight"].zero_()
    head["midlayer.mlp.down_proj.weight"].zero_()
    head["norm.weight"] = torch.ones(H)
    head["lm_head.weight"] = emb[ids]
    head_dir = _write_head(root / "echo-head", echo_dir, "eagle3", head)
    in_vocab = [p for p in ([1, 5, int(ids[7])], [1, int(ids[100])], [3, int(ids[250])])]
    plain = _generate(LLM(echo_dir, max_model_len=128), in_vocab, GREEDY)
    assert all(set(t) == {p[-1]} for t, p in zip(plain, in_vocab))  # (it repeats)
    llm = LLM(echo_dir, max_model_len=128, speculative_config=_spec("eagle3", head_dir, k=4))
    assert _generate(llm, in_vocab, GREEDY) == plain
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens >= 0.8 * stats.spec_num_draft_tokens > 0


# -- sampled requests: the target's distribution -------------------------------------------------------
def _exact_marginals(model_dir: str, prompt: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """P(second output token) and P(third) of sampling at `temperature` (transformers, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v = model.config.vocab_size

    def next_probs(seqs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(seqs).logits[:, -1].double() / temperature, dim=-1)

    base = torch.tensor([prompt])
    p0 = next_probs(base)[0]
    p1 = next_probs(torch.cat([base.repeat(v, 1), torch.arange(v)[:, None]], 1))
    pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))
    p2 = next_probs(torch.cat([base.repeat(v * v, 1), pairs], 1)).view(v, v, v)
    joint01 = p0[:, None] * p1
    return joint01.sum(0).numpy(), (joint01[:, :, None] * p2).sum((0, 1)).numpy()


def test_sampled_requests_keep_the_target_distribution(tmp_path):
    """1,200 requests of 3 tokens at temperature 0.5 over 16 tokens, proposals from an EAGLE-3 head
    whose draft vocabulary holds 10 of them (q is 0 on the other 6): the second and third tokens'
    counts against their exact probabilities (chi-square), some proposals rejected."""
    from scipy.stats import chisquare

    target = str(make_random_model(tmp_path / "target", "llama", seed=0, vocab_size=16, num_hidden_layers=4))
    head = _write_head(tmp_path / "head", target, "eagle3", _head_tensors("eagle3", 16, seed=2, draft_vocab=10))
    prompt, temperature, n = [1, 5, 9, 3, 7, 11], 0.5, 1200
    want1, want2 = _exact_marginals(target, prompt, temperature)
    llm = LLM(target, max_model_len=64, max_num_seqs=256,
              speculative_config=_spec("eagle3", head, k=3, disable_by_batch_size=1 << 20))  # fmt: skip
    outs = _generate(llm, [prompt] * n, SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True))
    stats = llm.stats()
    assert 0.05 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.95
    for position, want in ((1, want1), (2, want2)):
        counts = np.bincount([o[position] for o in outs], minlength=16)
        keep = want * n >= 5  # (chi-square wants expected counts of 5 or more: the rest pooled)
        observed, expected = counts[keep], want[keep]
        if not keep.all():
            observed, expected = np.append(observed, counts[~keep].sum()), np.append(expected, want[~keep].sum())
        expected = np.asarray(expected, dtype=np.float64) / np.sum(expected) * observed.sum()
        assert chisquare(observed, expected).pvalue > 1e-3, position
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    assert _generate(llm, [prompt] * 3, seeded) == _generate(llm, [prompt] * 3, seeded)  # (seeded: reproduces)
    assert _head_cache_empty(llm)


# -- abort and refusals -----------------------------------------------------------------------------------
def test_abort_mid_speculation_frees_both_caches(tiny):
    target, heads, _, _ = tiny
    llm = LLM(target, max_model_len=128, speculative_config=_spec("eagle3", heads["eagle3"]))
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 100, (2,)))
    while core.stats().spec_num_drafts < 4:
        core.step()
    assert core.draft.blocks.num_free < core.draft.blocks.num_blocks and core.draft.store.chunks
    core.abort_requests(["r0", "r1", "r2"])
    while core.has_unfinished():
        core.step()
    core.step()
    assert core.kv.pool.num_used == 0
    assert _head_cache_empty(llm)


def test_malformed_heads_are_refused_at_start_naming_the_tensor(tiny, tmp_path):
    target, heads, _, _ = tiny

    def start(method: str, head: str, model: str = target) -> None:
        EngineArgs(model=model, max_model_len=128, speculative_config=_spec(method, head)).create_engine_config()

    def broken(name: str, method: str, change, **config) -> str:
        tensors = _head_tensors(method, 512, seed=1, draft_vocab=300 if method == "eagle3" else None)
        change(tensors)
        return _write_head(tmp_path / name, target, method, tensors, **config)

    with pytest.raises(ConfigError, match="lacks tensor 'fc.weight'"):
        start("eagle", broken("no-fc", "eagle", lambda t: t.pop("fc.weight")))
    with pytest.raises(ConfigError, match=r"'layers.0.self_attn.q_proj.weight' has shape \(64, 64\)"):
        start(
            "eagle3",
            broken("narrow-q", "eagle3", lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(Q, H)})),
        )
    with pytest.raises(ConfigError, match="'medusa_head.0.weight' has no place"):
        start("eagle", broken("extra", "eagle", lambda t: t.update({"medusa_head.0.weight": torch.zeros(2)})))
    with pytest.raises(ConfigError, match="lacks tensor 'd2t'"):
        start("eagle3", broken("no-d2t", "eagle3", lambda t: t.pop("d2t")))
    with pytest.raises(ConfigError, match='use "method": "eagle3"'):
        start("eagle", heads["eagle3"])
    with pytest.raises(ConfigError, match="hidden_size 32"):
        start("eagle", broken("narrow", "eagle", lambda t: None, hidden_size=32))
    two_layers = str(make_random_model(tmp_path / "two-layers", "llama", seed=0))
    no_ids = _write_head(tmp_path / "default-ids", two_layers, "eagle3", _head_tensors("eagle3", 512, seed=1))
    cfg = json.loads((Path(no_ids) / "config.json").read_text())
    cfg.pop("eagle_config")
    (Path(no_ids) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"3 distinct layers of the target's 2"):
        start("eagle3", no_ids, two_layers)
    with pytest.raises(ConfigError, match='needs "model"'):
        EngineArgs(model=target, speculative_config={"method": "eagle"}).create_engine_config()
    cfg = EngineArgs(
        model=target, max_model_len=128, speculative_config=_spec("eagle3", heads["eagle3"])
    ).create_engine_config()
    assert cfg.speculative.eagle.aux_layers == AUX and cfg.speculative.eagle.draft_vocab_size == 300
