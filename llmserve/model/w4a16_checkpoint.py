"""4-bit weight-only (W4A16) checkpoints: GPTQ and AWQ as AutoGPTQ / GPTQModel and AutoAWQ write
them, read into the one layout of model/w4a16.py, and written here (round to nearest per group).

The formats (per linear layer, K inputs, N outputs, G = K / group_size groups):
- GPTQ (`quant_method: "gptq"`): `qweight` int32 [K / 8, N], eight 4-bit inputs a word (input
  8 j + i in bits 4 i of word j); `qzeros` int32 [G, N / 8], eight outputs a word, the same
  order; `scales` float16 [G, N]; `g_idx` int32 [K], each input's group (k // group_size, or
  scattered with act-order, `desc_act: true`). `checkpoint_format` "gptq" (v1, the default)
  stores each zero point minus one (AutoGPTQ's convention; symmetric: 8 stored as 7), "gptq_v2"
  the zero point itself. w = (q - z) * s.
- AWQ (`quant_method: "awq"`, `version: "gemm"`): `qweight` int32 [K, N / 8] and `qzeros` int32
  [G, N / 8], eight outputs a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds output
  8 j + ORDER[i]); `scales` float16 [G, N]; zero points as they are; no `g_idx`.
Checked at start: 4 bits, a group size dividing every projection's input (or -1: one group),
symmetric or not (GPTQ; AWQ with zero points), no quantized LM head, no per-module overrides.
At load each tensor's shape is checked against the config (a wrong one is named), q/k/v and
gate/up must share one input order (`g_idx`), and tensor parallelism takes each rank's rows
(column-parallel) or inputs (row-parallel, every group's scales kept).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.model.arch import UnsupportedModelError
from llmserve.model.w4a16 import PACK, W4A16Linear, pack_rows, unpack_rows

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: output 8 j + AWQ_ORDER[i] sits in nibble i of word j
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(PACK))  # the nibble that holds output 8 j + c
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True, slots=True)
class W4A16Checkpoint:
    method: str  # gptq | awq: the engine's quantization (W4A16Linear projections)
    group_size: int  # inputs a group shares a scale and zero point over (-1: all of a row)
    sym: bool = True  # GPTQ: symmetric (zero point 8); AWQ: always zero points
    desc_act: bool = False  # GPTQ act-order: groups scattered over the inputs (g_idx)
    checkpoint_format: str = "gptq"  # gptq (v1: zero points stored minus one) | gptq_v2 | awq
    ignore: tuple[str, ...] = ()  # (none is read yet)

    @property
    def format(self) -> str:
        return f"{self.method}, 4-bit, group {self.group_size}{', act-order' if self.desc_act else ''}"

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else k // self.group_size


def _refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported quantization_config: {why}")


def read_w4a16_quantization(cfg: dict) -> W4A16Checkpoint:
    """A GPTQ or AWQ `quantization_config`, checked against the model's widths."""
    qc = cfg["quantization_config"]
    method = qc["quant_method"]
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} with {bits}-bit weights (4-bit is read)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % PACK)):
        raise _refuse(f"{method} group_size {group!r} (a positive multiple of {PACK}, or -1)")
    if qc.get("lm_head"):
        raise _refuse(f"a 4-bit LM head ({method} lm_head: true)")
    if qc.get("dynamic"):
        raise _refuse(f"{method} per-module overrides (dynamic)")
    kept = [m for m in (qc.get("modules_to_not_convert") or []) if m != "lm_head"]
    if kept:
        raise _refuse(f"{method} modules_to_not_convert {kept} (16-bit projections in a 4-bit checkpoint)")
    widths = [cfg.get("hidden_size"), cfg.get("intermediate_size")]
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):  # o_proj's input, where heads * head_dim != hidden
        widths.append(heads * head_dim)
    for k in widths:
        if group != -1 and isinstance(k, int) and k % group:
            raise _refuse(f"{method} group_size {group} does not divide the projections' input width {k}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(f"AWQ version {version!r} (gemm is read)")
        if not qc.get("zero_point", True):
            raise _refuse("AWQ without zero points (zero_point: false)")
        return W4A16Checkpoint("awq", group, sym=False, checkpoint_format="awq")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} (gptq and gptq_v2 are read)")
    return W4A16Checkpoint("gptq", group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt)


# -- reading tensors into the layout -----------------------------------------------------------


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] (nibble i of word j: column 8 j + AWQ_ORDER[i]) -> uint8 [R, C]."""
    u = unpack_rows(packed)
    return u.reshape(u.shape[0], -1, PACK)[:, :, list(_AWQ_UNDO)].reshape(u.shape[0], -1)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> AWQ's int32 [R, C / 8] (`unpack_awq`'s inverse)."""
    return pack_rows(q.reshape(q.shape[0], -1, PACK)[:, :, list(AWQ_ORDER)].reshape(q.shape[0], -1))


@dataclass
class _Target:
    layer: W4A16Linear
    name: str  # the fused module's name
    part: int  # which output slice
    offset: int  # its first row on this rank
    rows: int  # its rows on this rank
    full_rows: int  # its rows in the checkpoint
    full_k: int  # the checkpoint's input width
    column: bool  # column-parallel (rows split) or row-parallel (inputs split)


class W4A16Loader:
    """Takes a GPTQ / AWQ checkpoint's quantized tensors out of the stream the model loads (the
    rest passes on), repacks each projection part into its `W4A16Linear` and says which
    parameters it filled (`finish`)."""

    def __init__(self, model: torch.nn.Module, scheme: W4A16Checkpoint) -> None:
        from llmserve.model.registry import family_of

        self.scheme = scheme
        tp = model.tp
        self.rank, self.world = tp.rank, tp.world_size
        arch = model.arch
        self.targets: dict[str, _Target] = {}
        for spec in family_of(arch).linears(arch):
            for i in range(arch.num_layers):
                name = f"model.layers.{i}.{spec.path}"
                try:
                    layer = model.get_submodule(name)
                except AttributeError:  # a layer another pipeline stage holds
                    continue
                if not isinstance(layer, W4A16Linear):
                    continue
                column = spec.parallel == "column"
                offset = 0
                for j, (part, width) in enumerate(zip(spec.parts, spec.widths)):
                    rows = width // self.world if column else width
                    self.targets[f"model.layers.{i}.{spec.parent}.{part}"] = _Target(
                        layer, name, j, offset, rows, width, spec.in_features, column
                    )
                    offset += rows
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done: set[str] = set()
        self.g_idx: dict[str, torch.Tensor] = {}  # each fused layer's input groups, as its first part gave them

    def take(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            module, _, kind = name.rpartition(".")
            target = self.targets.get(module)
            if target is None:
                yield name, tensor
                continue
            if kind == "bias" and target.layer.bias is None:
                if tensor.abs().max() != 0:
                    raise ValueError(f"checkpoint tensor {name!r}: a bias for a projection that has none in this model")
                continue  # AutoGPTQ's zero biases
            if kind not in _PARTS:
                yield name, tensor  # a bias (loaded by the model), or a stray 16-bit weight (refused there)
                continue
            got = self.pending.setdefault(module, {})
            got[kind] = tensor
            needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.scheme.method == "gptq" else set())
            if needed <= got.keys():
                self._load(module, target, self.pending.pop(module))
                self.done.add(module)

    def finish(self) -> set[str]:
        """The parameters filled, as `expected_weight_keys` names them; a missing part is an error."""
        missing = [m for m in self.targets if m not in self.done]
        if missing:
            kinds = sorted(set(_PARTS[:3]) - set(self.pending.get(missing[0], {})))
            raise ValueError(f"the {self.scheme.method} checkpoint lacks {missing[0]}.{kinds[0] if kinds else 'g_idx'}"
                             f"{f' (and {len(missing) - 1} more projections)' if len(missing) > 1 else ''}")  # fmt: skip
        loaded = set()
        for t in self.targets.values():
            fused = ".qkv_proj" in t.name or ".gate_up_proj" in t.name
            loaded |= {
                f"{t.name}.{p}#{t.part}" if fused else f"{t.name}.{p}" for p in ("qweight", "scales", "zeros", "g_idx")
            }
        return loaded

    def _load(self, module: str, t: _Target, got: dict[str, torch.Tensor]) -> None:
        s = self.scheme
        k, n = t.full_k, t.full_rows
        groups = s.groups(k)
        if s.method == "gptq":
            shapes = {"qweight": (k // PACK, n), "qzeros": (groups, n // PACK), "scales": (groups, n), "g_idx": (k,)}
        else:
            shapes = {"qweight": (k, n // PACK), "qzeros": (groups, n // PACK), "scales": (groups, n)}
        for kind, shape in shapes.items():
            if tuple(got[kind].shape) != shape:
                raise ValueError(f"{module}.{kind}: checkpoint shape {tuple(got[kind].shape)} != {shape} "
                                 f"({s.method}, group_size {s.group_size}, {k} inputs, {n} outputs)")  # fmt: skip
        if s.method == "gptq":
            q_kn = None
            qweight = got["qweight"].to(torch.int32).t()  # [N, K / 8]: GPTQ's words, output rows first
            zeros = unpack_rows(got["qzeros"].to(torch.int32)).to(torch.int16)  # [G, N]
            if s.checkpoint_format == "gptq":
                zeros = zeros + 1  # v1 stored z - 1
            g_idx = got["g_idx"].to(torch.int32)
            if g_idx.min() < 0 or g_idx.max() >= groups:
                raise ValueError(
                    f"{module}.g_idx: groups {int(g_idx.min())}..{int(g_idx.max())} outside 0..{groups - 1}"
                )
        else:
            q_kn = unpack_awq(got["qweight"].to(torch.int32))  # [K, N]
            qweight = None
            zeros = unpack_awq(got["qzeros"].to(torch.int32)).to(torch.int16)
            g_idx = torch.arange(k, dtype=torch.int32) // (k if s.group_size == -1 else s.group_size)
        scales = got["scales"].t()  # [N, G]
        zeros = zeros.t()
        if t.column:  # this rank's output rows
            rows = slice(self.rank * t.rows, (self.rank + 1) * t.rows)
            scales, zeros = scales[rows], zeros[rows]
            qweight = qweight[rows] if qweight is not None else None
            q_kn = q_kn[:, rows] if q_kn is not None else None
        else:  # this rank's inputs (whole words: the local width is a multiple of 8)
            k_local = k // self.world
            inputs = slice(self.rank * k_local, (self.rank + 1) * k_local)
            g_idx = g_idx[inputs]
            if qweight is not None:
                qweight = qweight[:, self.rank * k_local // PACK : (self.rank + 1) * k_local // PACK]
            else:
                q_kn = q_kn[inputs]
        if qweight is None:
            qweight = pack_rows(q_kn.t().contiguous())
        layer = t.layer
        if layer.scales.shape[1] == 0:
            layer.set_groups(groups, scales.dtype)
        elif layer.scales.shape[1] != groups or layer.scales.dtype != scales.dtype:
            raise ValueError(f"{module}.scales: {groups} groups of {scales.dtype}, unlike the other parts of {t.name}")
        if t.name not in self.g_idx:  # the first part read sets the layer's input order
            self.g_idx[t.name] = g_idx
            layer.g_idx.data.copy_(g_idx)
        elif not torch.equal(self.g_idx[t.name], g_idx):
            raise ValueError(f"{module}.g_idx differs from the other parts of {t.name}: llmserve runs them as one GEMM "
                             "over one input order")  # fmt: skip
        rows = slice(t.offset, t.offset + t.rows)
        with torch.no_grad():
            layer.qweight.data[rows] = qweight.to(layer.qweight.device)
            layer.scales.data[rows] = scales.to(layer.scales.device)
            layer.zeros.data[rows] = zeros.to(torch.uint8).to(layer.zeros.device)


def draw_dummy_w4a16(loader: W4A16Loader, gen: torch.Generator, draw=None) -> None:
    """`load_format dummy` for a 4-bit model: each projection part of the checkpoint drawn in
    float32, uniform(-0.02, 0.02) (`draw(name, shape, device)` instead, where given), on its
    layer's device, rounded to nearest per group (`quantize_groups`, the scheme's group size,
    symmetry and act-order: one random input order a fused layer, as its parts share in a
    checkpoint), written as the checkpoint's tensors (GPTQ v1 / v2, AWQ) and read through
    `loader`, so the layers hold what loading such a checkpoint gives them (the same repacking,
    a rank's share). One part in float32 at a time: the model never has a float copy."""
    s = loader.scheme
    min_zero = int(s.method == "gptq" and s.checkpoint_format == "gptq")  # v1 stores z - 1
    orders: dict[str, torch.Tensor] = {}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for module, t in loader.targets.items():
            device = t.layer.qweight.device
            shape = (t.full_rows, t.full_k)
            if draw is not None:
                w = draw(module, shape, device)
            else:
                w = torch.empty(shape, dtype=torch.float32, device=device).uniform_(-0.02, 0.02, generator=gen)
            importance = None
            if s.desc_act:
                if t.name not in orders:
                    orders[t.name] = torch.rand(t.full_k, generator=gen, device=device)
                importance = orders[t.name]
            q, scales, zeros, g_idx = quantize_groups(w, s.group_size, s.sym, s.desc_act, importance, min_zero)
            del w
            if s.method == "gptq":
                packed = gptq_tensors(q, scales, zeros, g_idx, v1=s.checkpoint_format == "gptq")
            else:
                packed = awq_tensors(q, scales, zeros)
            del q
            for kind, tensor in packed.items():
                yield f"{module}.{kind}", tensor

    for name, _ in loader.take(tensors()):
        raise AssertionError(f"{name}: a drawn 4-bit tensor the loader did not take")
    loader.finish()


def w4a16_loader(model: torch.nn.Module, model_dir: Path) -> W4A16Loader | None:
    """The loader for a model with 4-bit layers (its checkpoint's config read again), or None."""
    if not any(isinstance(m, W4A16Linear) for m in model.modules()):
        return None
    cfg = json.loads((model_dir / "config.json").read_text())
    return W4A16Loader(model, read_w4a16_quantization(cfg))


# -- writing: round to nearest per group --------------------------------------------------------


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool, act_order: bool = False,
                    importance: torch.Tensor | None = None, min_zero: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`w` [N, K] to 4 bits per group of inputs, round to nearest: (q uint8 [N, K], scales float32
    [N, G], zeros uint8 [N, G], g_idx int32 [K]). Symmetric: zero 8, scale = max|w| * 2 / 15 (GPTQ's
    grid); else scale = (max - min) / 15, zero = round(-min / scale). `act_order`: groups are
    formed over the inputs sorted by decreasing `importance` (GPTQ's H[i, i]; default the
    columns' squared norms), so g_idx scatters. `min_zero` 1: GPTQ v1 files store z - 1 in 4 bits,
    so a zero point of 0 (a group without negative weights) cannot be written."""
    w = w.to(torch.float32)
    n, k = w.shape
    size = k if group_size == -1 else group_size
    order = torch.arange(k, device=w.device)  # (all on w's device: dummy weights are rounded on the GPU)
    if act_order:
        score = importance if importance is not None else w.pow(2).sum(0)
        order = torch.argsort(score.to(w.device), descending=True)
    g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
    g_idx[order] = (torch.arange(k, device=w.device) // size).to(torch.int32)
    wg = w[:, order].reshape(n, k // size, size)
    if sym:
        scale = (wg.abs().amax(-1) * 2 / 15).clamp(min=1e-10)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        zero = torch.round(-lo / scale).clamp(min_zero, 15)
    scale = scale.to(torch.float16).to(torch.float32)  # as the checkpoint stores it
    g = g_idx.long()
    q = torch.clamp(torch.round(w / scale[:, g]) + zero[:, g], 0, 15).to(torch.uint8)
    return q, scale, zero.to(torch.uint8), g_idx


_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def act_order_importance(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each projection weight's input importance for act-order without calibration data: the
    squared column norms summed over the projections that read the same input (q/k/v, gate/up),
    so they get one input order, as GPTQ's shared input Hessian gives them."""
    sums: dict[str, torch.Tensor] = {}
    keys = {}
    for name, w in tensors.items():
        module, _, leaf = name.removesuffix(".weight").rpartition(".")
        if name.endswith("_proj.weight"):
            keys[name] = f"{module}.{_SHARED_INPUT.get(leaf, leaf)}"
            sums[keys[name]] = sums.get(keys[name], 0) + w.to(torch.float32).pow(2).sum(0)
    return {name: sums[key] for name, key in keys.items()}


def gptq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                 v1: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """One layer's GPTQ tensors from `quantize_groups`' output (v1: zero points minus one)."""
    z = zeros.to(torch.int16) - (1 if v1 else 0)
    return {"qweight": pack_rows(q).t().contiguous(), "qzeros": pack_rows((z & 0xF).to(torch.uint8).t().contiguous()),
            "scales": scales.t().to(torch.float16).contiguous(), "g_idx": g_idx.clone()}  # fmt: skip


def awq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's AWQ (GEMM) tensors from `quantize_groups`' output."""
    return {"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(zeros.t().contiguous()),
            "scales": scales.t().to(torch.float16).contiguous()}  # fmt: skip


def config_entry(method: str, group_size: int, sym: bool, desc_act: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq", "lm_head": False, "true_sequential": True, "damp_percent": 0.01}  # fmt: skip


def write_w4a16_checkpoint(model_dir: str | Path, out_dir: str | Path, method: str = "gptq", group_size: int = 128,
                           sym: bool = True, desc_act: bool = False, gptq=None, awq=None) -> Path:  # fmt: skip
    """Quantize a model's projections to 4 bits per group (round to nearest, or with `gptq`, an
    fp8_checkpoint.GptqCalibration, by GPTQ on calibration text: model/w4a16_gptq.py) and write
    them as a GPTQ (v1) or AWQ (GEMM) folder: a Hugging Face folder or a GGUF file as the source
    (its other tensors in bfloat16 then), the LM head and embedding as they are. `awq` (AWQ
    only), a w4a16_awq.AwqCalibration: activation-aware scales searched on calibration text and
    folded into the norms / previous projections first (model/w4a16_awq.py), then round to nearest."""
    from safetensors.torch import save_file

    from llmserve.config import read_arch
    from llmserve.model.fp8_checkpoint import _PROJECTIONS, _copy_tokenizer, _source_config
    from llmserve.model.loader import _checkpoint_tensors
    from llmserve.model.quantized_checkpoint import read_checkpoint_quantization

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}")
    if method == "awq" and (sym or desc_act):
        raise ValueError("AWQ checkpoints have zero points (sym False) and no act-order")
    if awq is not None and (method != "awq" or gptq is not None):
        raise ValueError("activation-aware scales are written into AWQ checkpoints rounded to nearest (not with GPTQ)")
    source, out = Path(model_dir), Path(out_dir)
    if not source.is_file() and not (source / "config.json").is_file():
        raise ValueError(f"{str(source)!r} is not a Hugging Face model folder (no config.json) nor a GGUF file")
    cfg = _source_config(source)
    if read_checkpoint_quantization(cfg) is not None:
        raise ValueError(f"{str(source)!r} is already quantized: write a 4-bit checkpoint from its bf16/fp16 source")
    cfg["quantization_config"] = config_entry(method, group_size, sym, desc_act)
    try:
        read_w4a16_quantization(cfg)  # the widths it must divide
    except UnsupportedModelError as e:
        raise ValueError(str(e)) from None
    arch = read_arch(source, own_tokenizer=source.is_file())
    min_zero = int(method == "gptq")
    rounded = {}
    if gptq is not None:
        from llmserve.model.w4a16_gptq import gptq_w4a16_tensors

        rounded = gptq_w4a16_tensors(source, arch, gptq, group_size, sym, desc_act, min_zero)
    source_tensors = dict(_checkpoint_tensors(source, arch, progress=True))
    awq_found = {}
    if awq is not None:
        from llmserve.model.w4a16_awq import awq_scales, fold_scales

        awq_found = awq_scales(source, arch, awq, group_size)
        fold_scales(source_tensors, awq_found, arch)
    importance = act_order_importance(source_tensors) if desc_act else {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in source_tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in _PROJECTIONS:
            q, scales, zeros, g_idx = rounded.get(name) or quantize_groups(tensor, group_size, sym, desc_act,
                                                                           importance.get(name), min_zero=min_zero)  # fmt: skip
            packed = gptq_tensors(q, scales, zeros, g_idx) if method == "gptq" else awq_tensors(q, scales, zeros)
            tensors.update({f"{module}.{kind}": t for kind, t in packed.items()})
        else:
            tensors[name] = tensor.to(torch.bfloat16).contiguous() if source.is_file() else tensor
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    if gptq is not None:  # how the weights were rounded (read by nothing; for people)
        cfg["quantization_config"]["llmserve_rounding"] = {"method": "gptq", "calibration_tokens": gptq.tokens,
                                                           "calibration_texts": [Path(t).name for t in gptq.texts]}  # fmt: skip
    if awq is not None:
        alphas = [found.alpha for found in awq_found.values()]
        cfg["quantization_config"]["llmserve_rounding"] = {
            "method": "awq activation-aware scales, round to nearest", "calibration_tokens": awq.tokens,
            "calibration_texts": [Path(t).name for t in awq.texts], "mean_alpha": sum(alphas) / max(len(alphas), 1),
            "alphas": {name: found.alpha for name, found in awq_found.items()}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(source, out)
    return out
