"""`llmserve train-eagle` (llmserve/spec_train/): EAGLE-3 heads trained on a tiny random target's
own text. The command writes a head the engine loads (in the published names); training lowers
the loss; the trained head is accepted more often than the untrained one it started from, and
greedy tokens stay those of the engine without speculation; the training module computes exactly
the proposals the runtime's head makes; bad arguments are refused naming the flag."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmserve import LLM, SamplingParams
from llmserve.cli import main
from llmserve.model.eagle3_train_head import Eagle3TrainHead
from llmserve.model.eagle_format import read_eagle_head
from llmserve.model.random_model import make_random_model
from llmserve.spec_train.checkpoint import head_arch
from llmserve.spec_train.data import generate_sequences, random_prompt_ids
from llmserve.spec_train.metrics import walk
from llmserve.spec_train.options import TrainOptions, default_aux_layers
from llmserve.spec_train.vocab import choose_draft_vocab

pytestmark = pytest.mark.unit

VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# the first 8 of the 64 training prompts (`--prompts random --seed 0`), and 4 it never saw
PROMPTS = random_prompt_ids(64, VOCAB, 8, seed=0)[:8] + random_prompt_ids(4, VOCAB, 8, seed=123)


def _train(target: str, out: Path, *flags: str) -> Path:
    main(["train-eagle", "--model", target, "--out", str(out), "--prompts", "random", "--num-prompts", "64",
          "--gen-len", "32", "--max-model-len", "128", "--draft-vocab-size", "384", "--no-progress", *flags])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A 4-layer random Llama, a head trained on its greedy text, and the untrained head (the
    same initialisation, 0 epochs)."""
    root = tmp_path_factory.mktemp("train_eagle")
    target = str(make_random_model(root / "target", "llama", seed=0, num_hidden_layers=4))
    trained = _train(target, root / "trained", "--epochs", "12", "--lr", "5e-3")
    untrained = _train(target, root / "untrained", "--epochs", "0")
    return target, trained, untrained


def _spec(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          use_tqdm=False)]  # fmt: skip


def test_the_command_writes_a_head_in_the_published_format(heads):
    """config.json and model.safetensors as EAGLE-3 heads are published (midlayer.*, fc over 3
    layers, its own norm and LM head over a draft vocabulary, d2t and t2d), which the runtime's
    checker reads."""
    target, trained, _ = heads
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 384 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tensors = load_file(str(trained / "model.safetensors"))
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["lm_head.weight"].shape == (384, 64)
    assert "midlayer.self_attn.q_proj.weight" in tensors and "midlayer.hidden_norm.weight" in tensors
    ids = torch.arange(384) + tensors["d2t"]
    assert (ids.diff() > 0).all() and tensors["t2d"].sum() == 384 and tensors["t2d"][ids].all()
    from llmserve.config import EngineArgs

    spec = read_eagle_head(trained, "eagle3", EngineArgs(model=target).create_engine_config().model_config.arch)
    assert spec.aux_layers == (1, 2, 3) and spec.draft_vocab_size == 384 and spec.has_d2t
    training = json.loads((trained / "training.json").read_text())
    assert training["sequences"] == 64 and training["held_out"] == 6 and len(training["epochs"]) == 13


def test_training_lowers_the_loss(heads):
    """Per epoch (training.json): the loss falls, accuracy rises on the training text and above
    the untrained head's (none) on the held-out sequences."""
    _, trained, _ = heads
    epochs = json.loads((trained / "training.json").read_text())["epochs"]
    assert epochs[0]["held_out"]["top1"] == 0.0  # (before training: a random head)
    losses = [e["train"]["loss"] for e in epochs[1:]]
    assert losses[-1] < 0.6 * losses[0] and all(b <= a + 0.05 for a, b in zip(losses, losses[1:]))
    assert epochs[-1]["train"]["top1"] > 0.3 and epochs[-1]["train"]["acceptance_length"] > 1.3
    assert epochs[-1]["held_out"]["top1"] > 0.0


def test_the_trained_head_is_accepted_more_and_greedy_tokens_stay_the_same(heads):
    """On prompts it trained on (the target's own greedy text) and some it never saw: the engine
    with either head makes the tokens it makes without speculation; the trained head's proposals
    are accepted many times as often."""
    target, trained, untrained = heads
    plain = _generate(LLM(target, max_model_len=128), PROMPTS)
    accepted = {}
    for name, head in (("trained", trained), ("untrained", untrained)):
        llm = LLM(target, max_model_len=128, speculative_config=_spec(head))
        assert _generate(llm, PROMPTS) == plain, name
        stats = llm.stats()
        assert stats.spec_num_draft_tokens > 0
        accepted[name] = stats.spec_num_accepted_tokens
    assert accepted["trained"] >= 10 * max(1, accepted["untrained"]), accepted


def test_the_training_head_computes_the_runtime_heads_proposals(heads):
    """Every greedy proposal the engine's head made equals the training module's, unrolled over
    the same tokens (the proposals fed as the next steps' tokens) and the target's states of the
    same positions: the same features, pairs, rotary positions, attention over its own chain and
    d2t, so what training optimises is what serving runs."""
    target, trained, _ = heads
    cfg = json.loads((trained / "config.json").read_text())
    weights = load_file(str(trained / "model.safetensors"))
    head = Eagle3TrainHead(head_arch(cfg), 3, cfg["draft_vocab_size"], 128)
    head.load_state_dict({k: v for k, v in weights.items() if k not in ("d2t", "t2d")})
    llm = LLM(target, max_model_len=128, enable_prefix_caching=False, speculative_config=_spec(trained))
    seen = []
    propose = llm.core.draft.propose

    def recording(requests, ks):
        proposals, probs = propose(requests, ks)
        seen.extend((list(r.all_token_ids), p) for r, p in zip(requests, proposals) if p)
        return proposals, probs

    llm.core.draft.propose = recording
    _generate(llm, PROMPTS[:2] + PROMPTS[-1:])
    plain = LLM(target, max_model_len=128, enforce_eager=True, enable_prefix_caching=False)
    embed, device = plain.core.runner.model.token_embeddings, plain.core.runner.device
    assert len(seen) > 10 and any(len(p) > 1 for _, p in seen)
    for tokens, proposal in seen[::3]:
        states = generate_sequences(plain, [tokens], SamplingParams(max_tokens=1), (1, 2, 3), use_tqdm=False)[0].states
        n = len(tokens)
        with torch.no_grad():
            embeds = embed(torch.tensor(tokens[1:] + proposal, device=device)).float().cpu()[None]
            outs = head.unroll(embeds, states[None, : n - 1].float(), len(proposal))
        draft = [int(head.lm_head(out[0, n - 2]).argmax()) for out in outs]
        assert [d + int(weights["d2t"][d]) for d in draft] == proposal, tokens


def test_the_draft_vocabulary_and_the_default_layers():
    labels, context = Counter({7: 5, 3: 9, 900: 1}), Counter({11: 4, 3: 2})
    vocab = choose_draft_vocab(labels, context, vocab_size=20, size=5)  # (900 is no token of 20)
    assert vocab.target_ids.tolist() == [0, 1, 3, 7, 11]  # generated, then the prompts', then the lowest ids
    assert (torch.arange(5) + vocab.d2t()).tolist() == [0, 1, 3, 7, 11]
    assert vocab.draft_index()[[3, 11, 2]].tolist() == [2, 4, -1] and vocab.t2d().sum() == 5
    assert choose_draft_vocab(labels, context, vocab_size=20, size=50).size == 20
    assert default_aux_layers(30) == (2, 15, 27) and default_aux_layers(6) == (1, 3, 4)
    assert default_aux_layers(4) == (1, 2, 3) and default_aux_layers(3) == (0, 1, 2)
    with pytest.raises(ValueError, match="3 distinct layers; the target has 2"):
        default_aux_layers(2)


def test_the_walk_counts_tokens_a_verification_makes():
    """Pairs from prompt_len - 1; a verification makes 1 + the leading right proposals."""
    #      pair: 0  1  2  3  4  5  6  7
    lead = [[0, 0, 2, 0, 0, 1, 0, 0]]
    # prompt 3 tokens, 9 in all: pair 2 makes 3 (tokens 4-6), pair 5 makes 2 (7, 8): 5 tokens, 2 steps
    assert walk(lead, [3], [9]) == (5, 2)
    assert walk([[0] * 8], [3], [9]) == (5, 5)  # one a verification


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--epochs", "-1"], "--epochs must be an integer >= 0"),
        (["--num-prompts", "0"], "--num-prompts must be an integer >= 1"),
        (["--ttt-steps", "0"], "--ttt-steps must be an integer >= 1"),
        (["--ttt-steps", "17"], "--ttt-steps must be at most 16"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--holdout", "1"], r"--holdout is a share of the sequences in \[0, 1\)"),
        (["--aux-layers", "1,1,2"], "--aux-layers names 3 distinct target layers"),
        (["--aux-layers", "1,2,9"], r"--aux-layers \[1, 2, 9\]: the target's layers are 0 .. 3"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(heads, tmp_path, capsys, flags, message):
    target, _, _ = heads
    with pytest.raises(SystemExit) as exit_:
        main(["train-eagle", "--model", target, "--out", str(tmp_path / "head"), *flags])
    assert exit_.value.code == 2
    assert "train-eagle" in (err := capsys.readouterr().err) and re.search(message, err), err
    assert not (tmp_path / "head").exists()


def test_bad_targets_and_folders_are_refused(heads, tmp_path, capsys):
    target, trained, _ = heads
    gemma = str(make_random_model(tmp_path / "gemma", "gemma3", seed=0))
    for args, message in (
        (["--model", target, "--out", str(trained)], "exists and is not an empty folder"),
        (["--model", gemma, "--out", str(tmp_path / "g")], "EAGLE heads take Llama-family targets"),
        (["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "n")], "nowhere"),
        (
            ["--model", target, "--out", str(tmp_path / "l"), "--gen-len", "200", "--max-model-len", "128"],
            "and --gen-len 200 do not fit the target's max_model_len 128",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["train-eagle", "--prompts", "random", "--num-prompts", "2", "--gen-len", "4", *args])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, args
    with pytest.raises(SystemExit):  # (argparse's own refusal)
        main(["train-eagle", "--out", str(tmp_path / "p"), "--prompts", "poems"])
    assert "invalid choice: 'poems'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--gen-len must be an integer >= 1"):
        TrainOptions(out=str(tmp_path / "o"), gen_len=0)


def test_chat_prompts_and_sampled_text(heads, tmp_path):
    """`--prompts chat`: the built-in instructions through the target's chat template; with a
    temperature the target's text is sampled (seeded: the same head twice)."""
    from llmserve.spec_train.data import instruction_prompts, prompt_token_ids
    from llmserve.tokenizer import load_tokenizer

    target, _, _ = heads
    messages = instruction_prompts(700, seed=0)
    assert len(set(messages[:640])) == 640 and messages[640] == messages[0]  # (16 x 40 pairs, then again)
    tokenizer = load_tokenizer(target)
    text = tokenizer.decode(prompt_token_ids(tokenizer, messages[:1])[0])
    assert text.startswith("<|user|>") and messages[0] in text and text.rstrip().endswith("<|assistant|>")
    flags = ["--prompts", "chat", "--temperature", "0.8", "--num-prompts", "8", "--epochs", "1"]
    a, b = _train(target, tmp_path / "a", *flags), _train(target, tmp_path / "b", *flags)
    assert load_file(str(a / "model.safetensors"))["fc.weight"].equal(
        load_file(str(b / "model.safetensors"))["fc.weight"]
    )
    training = json.loads((a / "training.json").read_text())
    assert training["options"]["prompts"] == "chat" and training["options"]["temperature"] == 0.8
