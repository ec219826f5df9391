"""The checkpoint formats of EAGLE and EAGLE-3 heads (as vLLM and SGLang load them), read and
checked against the target before anything is built: a head that does not fit is refused at
start, naming the config key or the tensor.

EAGLE-1 (`"method": "eagle"`, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): a config.json of a Llama
model (`num_hidden_layers` decoder layers, usually 1) and the tensors
  fc.weight [hidden, 2 * hidden] (fc.bias [hidden] where the head was trained with one)
  layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm,
            input_layernorm (not layer 0: the first layer takes fc's output unnormalised)}.weight
over concat(token embedding, the target's final hidden state after its final norm); its output
(no final norm) goes through the target's LM head.

EAGLE-3 (`"method": "eagle3"`, config `architectures: ["LlamaForCausalLMEagle3"]`, e.g.
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): one decoder layer `midlayer.*` (or `layers.0.*`) whose
q/k/v take concat(input_layernorm(embedding), hidden_norm(hidden)) (2 * hidden wide), with
  fc.weight [hidden, 3 * hidden]: the target's states entering three of its layers, concatenated
  norm.weight, lm_head.weight [draft_vocab_size, hidden]
  d2t [draft_vocab_size]: draft id + d2t[draft id] = target id (absent: the full vocabulary)
  t2d [vocab_size]: its inverse as a mask (not needed here)
The three layers: config `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`),
else (2, L // 2, L - 3) of the target's L layers, as vLLM picks them.

Either head may carry `embed_tokens.weight`: the target's embedding is used instead (heads are
trained over the target's frozen embedding). Names may start with `model.`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.model.arch import ModelArch, UnsupportedModelError

EAGLE_METHODS = ("eagle", "eagle3")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
IGNORED = ("embed_tokens.weight", "t2d")  # the target's embedding is used; t2d is d2t's inverse


class EagleHeadError(ValueError):
    """A head folder that cannot serve this target (the message names what is wrong)."""


@dataclass(frozen=True)
class EagleSpec:
    """A checked head: its method, folder, decoder shape and what it reads from the target."""

    method: str  # eagle | eagle3
    folder: str
    arch: ModelArch  # its decoder layers' shape (Llama layers)
    aux_layers: tuple[int, ...]  # eagle3: the target layers whose input states it reads, in order
    draft_vocab_size: int  # eagle3: its LM head's rows (d2t maps them to target ids)
    fc_bias: bool
    norm_before_residual: bool  # eagle3: the residual is the normalised hidden state
    has_d2t: bool

    @property
    def eagle3(self) -> bool:
        return self.method == "eagle3"


def read_eagle_head(folder: str | Path, method: str, target: ModelArch) -> EagleSpec:
    """The head in `folder` for `target`, checked: its config, and every tensor's name and shape."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise EagleHeadError(f"the EAGLE head folder {folder} has no config.json")
    cfg = json.loads(config_file.read_text())
    is3 = any(a in EAGLE3_ARCHITECTURES for a in cfg.get("architectures") or ())
    if is3 and method == "eagle":
        raise EagleHeadError(f'{folder} is an EAGLE-3 head ({cfg["architectures"][0]}): use "method": "eagle3"')
    if cfg.get("add_para_norm"):
        raise EagleHeadError(f"{folder}: HASS heads (add_para_norm) are not supported yet")
    from llmserve.model.llama import parse_config

    try:
        arch = parse_config({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    except (KeyError, UnsupportedModelError) as exc:
        raise EagleHeadError(f"{folder}: config.json is not a Llama head's ({exc})") from None
    if arch.hidden_size != target.hidden_size:
        raise EagleHeadError(f"{folder}: hidden_size {arch.hidden_size} differs from the target's "
                             f"{target.hidden_size} (the head reads the target's states and embedding)")  # fmt: skip
    if arch.vocab_size != target.vocab_size:
        raise EagleHeadError(f"{folder}: vocab_size {arch.vocab_size} differs from the target's {target.vocab_size}")
    if method == "eagle3" and arch.num_layers != 1:
        raise EagleHeadError(f"{folder}: EAGLE-3 heads of {arch.num_layers} layers are not supported yet (1 layer)")
    aux = _aux_layers(cfg, target) if method == "eagle3" else ()
    draft_vocab = int(cfg.get("draft_vocab_size") or arch.vocab_size) if method == "eagle3" else arch.vocab_size
    shapes = head_tensor_shapes(folder)
    spec = EagleSpec(method, str(folder), arch, aux, draft_vocab, "fc.bias" in shapes,
                     bool(cfg.get("norm_before_residual", False)), "d2t" in shapes)  # fmt: skip
    check_tensors(spec, shapes)
    return spec


def _aux_layers(cfg: dict, target: ModelArch) -> tuple[int, ...]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    n = target.num_layers
    layers = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
    if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= i < n for i in layers):
        where = "eagle_aux_hidden_state_layer_ids" if ids else f"the default (2, L // 2, L - 3) for L = {n}"
        raise EagleHeadError(f"EAGLE-3 reads the states entering 3 distinct layers of the target's {n}; "
                             f"{where} gives {layers}")  # fmt: skip
    return tuple(sorted(layers))  # (read in layer order, as vLLM concatenates them)


def canonical_name(name: str) -> str:
    """A head tensor's name without `model.`, its `midlayer.` as `layers.0.`."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def expected_shapes(spec: EagleSpec) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(required tensor -> shape, optional tensors) of the head."""
    a = spec.arch
    h, q, kv, inter = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    attn_in = 2 * h if spec.eagle3 else h
    shapes: dict[str, tuple[int, ...]] = {}
    optional = {"fc.bias"} if not spec.eagle3 else set()
    shapes["fc.weight"] = (h, 3 * h) if spec.eagle3 else (h, 2 * h)
    if "fc.bias" in optional:
        shapes["fc.bias"] = (h,)
    for i in range(a.num_layers):
        p = f"layers.{i}."
        layer = {"self_attn.q_proj.weight": (q, attn_in), "self_attn.k_proj.weight": (kv, attn_in),
                 "self_attn.v_proj.weight": (kv, attn_in), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter), "post_attention_layernorm.weight": (h,),
                 "input_layernorm.weight": (h,)}  # fmt: skip
        if a.attention_bias:
            layer.update(
                {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
            )
        if spec.eagle3:
            layer["hidden_norm.weight"] = (h,)
        elif i == 0:  # EAGLE-1's first layer has no input norm (a checkpoint's copy is not read)
            optional.add(p + "input_layernorm.weight")
            shapes[p + "input_layernorm.weight"] = (h,)
            del layer["input_layernorm.weight"]
        shapes.update({p + k: v for k, v in layer.items()})
    if spec.eagle3:
        shapes.update({"norm.weight": (h,), "lm_head.weight": (spec.draft_vocab_size, h), "d2t": (spec.draft_vocab_size,),
                       "t2d": (a.vocab_size,)})  # fmt: skip
        optional.add("t2d")
        if spec.draft_vocab_size == a.vocab_size:
            optional.add("d2t")
    shapes["embed_tokens.weight"] = (a.vocab_size, h)
    optional.add("embed_tokens.weight")
    return shapes, optional


def check_tensors(spec: EagleSpec, found: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the head needs, in its shape; none it cannot place."""
    kind = "EAGLE-3" if spec.eagle3 else "EAGLE"
    shapes, optional = expected_shapes(spec)
    for name, shape in found.items():
        if name not in shapes:
            raise EagleHeadError(f"{spec.folder}: tensor {name!r} has no place in an {kind} head")
        if tuple(shape) != shapes[name]:
            raise EagleHeadError(f"{spec.folder}: tensor {name!r} has shape {tuple(shape)}, an {kind} head of this "
                                 f"target needs {shapes[name]}")  # fmt: skip
    missing = sorted(set(shapes) - optional - set(found))
    if missing:
        raise EagleHeadError(f"{spec.folder}: the {kind} head lacks tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))  # fmt: skip
    if spec.eagle3 and not spec.has_d2t and spec.draft_vocab_size != spec.arch.vocab_size:
        raise EagleHeadError(f"{spec.folder}: draft_vocab_size {spec.draft_vocab_size} needs tensor 'd2t'")


_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt)$")


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if _WEIGHT_FILES.fullmatch(p.name) and "training" not in p.name)
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    if safetensors:
        return safetensors
    if not files:
        raise EagleHeadError(f"the EAGLE head folder {folder} has no *.safetensors or pytorch_model.bin weights")
    return files


def head_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """The head's tensors by canonical name (safetensors, or PyTorch .bin files as EAGLE publishes them)."""
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        out.update({canonical_name(k): v for k, v in tensors.items()})
    return out


def head_tensor_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the safetensors headers (no weights read) or a mapped .bin."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(Path(folder)):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                shapes.update({canonical_name(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            shapes.update({canonical_name(k): tuple(v.shape) for k, v in tensors.items()})
    return shapes
