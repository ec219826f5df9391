"""Typed settings for a Triton model repository, rendered as config.pbtxt text.

Only the parts of Triton's model configuration llmserve uses are modelled; each
dataclass renders its own protobuf-text block so a config reads the same as the
hand-written ones in Triton's docs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmserve.pooling import default_embedding_model_dir

# model kinds this package ships a model.py for
MODEL_KINDS = ("chat", "embed", "rerank")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class TensorSpec:
    name: str
    data_type: str  # TYPE_STRING, TYPE_FP32, TYPE_INT32, ...
    dims: list[int]
    optional: bool = False

    def render(self) -> str:
        parts = [f"name: {_quote(self.name)}", f"data_type: {self.data_type}",
                 f"dims: [ {', '.join(str(d) for d in self.dims)} ]"]  # fmt: skip
        if self.optional:
            parts.append("optional: true")
        return "  {\n    " + "\n    ".join(parts) + "\n  }"


@dataclass
class InstanceGroup:
    kind: str = "KIND_CPU"  # KIND_CPU | KIND_GPU
    count: int = 1
    gpus: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("KIND_CPU", "KIND_GPU"):
            raise ValueError(f"instance kind must be KIND_CPU or KIND_GPU, got {self.kind!r}")
        if self.count < 1:
            raise ValueError("instance count must be >= 1")

    def render(self) -> str:
        gpus = f" gpus: [ {', '.join(map(str, self.gpus))} ]" if self.gpus else ""
        return f"instance_group [ {{ kind: {self.kind} count: {self.count}{gpus} }} ]"


@dataclass
class QueuePolicy:
    max_queue_size: int = 0  # 0 = unbounded
    timeout_action: str = "REJECT"  # REJECT | DELAY
    default_timeout_microseconds: int = 0

    def render(self) -> str:
        return (f"default_queue_policy {{ max_queue_size: {self.max_queue_size} "
                f"timeout_action: {self.timeout_action} "
                f"default_timeout_microseconds: {self.default_timeout_microseconds} }}")  # fmt: skip


@dataclass
class DynamicBatching:
    preferred_batch_size: list[int] = field(default_factory=lambda: [8, 16])
    max_queue_delay_microseconds: int = 2000
    priority_levels: int = 0  # 0 = no priorities
    default_priority_level: int = 0
    queue_policy: QueuePolicy | None = None

    def render(self) -> str:
        lines = [f"  max_queue_delay_microseconds: {self.max_queue_delay_microseconds}"]
        if self.preferred_batch_size:
            sizes = ", ".join(map(str, self.preferred_batch_size))
            lines.insert(0, f"  preferred_batch_size: [ {sizes} ]")
        if self.priority_levels:
            lines.append(f"  priority_levels: {self.priority_levels}")
            lines.append(f"  default_priority_level: {self.default_priority_level or 1}")
        if self.queue_policy is not None:
            lines.append("  " + self.queue_policy.render())
        return "dynamic_batching {\n" + "\n".join(lines) + "\n}"


@dataclass
class ModelConfig:
    """One model of the repository: its config.pbtxt and which model.py it runs."""

    name: str
    kind: str  # chat | embed | rerank: which shipped model.py
    max_batch_size: int = 0
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    instance_group: InstanceGroup = field(default_factory=InstanceGroup)
    dynamic_batching: DynamicBatching | None = None
    decoupled: bool = False
    version_policy: str = "latest { num_versions: 1 }"  # or "all { }", "specific { versions: [1] }"
    parameters: dict[str, str] = field(default_factory=dict)  # read by model.py

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        if self.dynamic_batching is not None and self.max_batch_size < 1:
            raise ValueError(f"{self.name}: dynamic batching needs max_batch_size >= 1")

    def render(self) -> str:
        blocks = [
            f"name: {_quote(self.name)}",
            'backend: "python"',
            f"max_batch_size: {self.max_batch_size}",
            f"version_policy: {{ {self.version_policy} }}",
            "input [\n" + ",\n".join(t.render() for t in self.inputs) + "\n]",
            "output [\n" + ",\n".join(t.render() for t in self.outputs) + "\n]",
            self.instance_group.render(),
        ]
        if self.decoupled:
            blocks.append("model_transaction_policy { decoupled: true }")
        if self.dynamic_batching is not None:
            blocks.append(self.dynamic_batching.render())
        for key, value in self.parameters.items():
            value = _quote(str(value))
            blocks.append(f"parameters {{ key: {_quote(key)} value: {{ string_value: {value} }} }}")
        return "\n".join(blocks) + "\n"


def _param(value: Any) -> str:
    """A config.pbtxt string parameter: booleans as the model reads them, and `lora_modules`
    given as {name: path} as "name=path,name=path"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return ",".join(f"{name}={path}" for name, path in value.items())
    return str(value)


def chat_config(model_dir: str | None = None, max_model_len: int = 2048, name: str = "chat",
                instances: int = 1, instance_kind: str = "KIND_CPU", **engine_args: Any) -> ModelConfig:  # fmt: skip
    """The chat model over an llmserve engine: `model_dir` is a Hugging Face folder or a GGUF
    file (default: the default model, SmolLM2-135M-Instruct). It takes an OpenAI request body
    (`request`, JSON) for an `endpoint` and answers what `llmserve serve` answers (`status`,
    `response`: the JSON body, or server-sent events, one or more a response; `keepalive_s` > 0: a
    ": keep-alive" response whenever a call has sent nothing for that long); `tool_call_parser`
    (hermes, llama3_json, mistral, pythonic, qwen3_coder) serves tool_choice "auto";
    `reasoning_parser` (deepseek_r1, qwen3) puts chat replies' thoughts apart from the answer
    (`reasoning` and `reasoning_content`, as `llmserve serve --reasoning-parser`); `enable_lora=True, lora_modules={name: path}` serves
    LoRA adapters a request names as its model. `instance_kind` KIND_GPU: Triton places each
    instance on a GPU and the engine runs there (the instance's GPU is the only one it sees)."""
    from llmserve.config import DEFAULT_MODEL
    from llmserve.openai.tool_parsers import PARSERS as TOOL_PARSERS
    from llmserve.reasoning import REASONING_PARSERS

    for key, known in (("reasoning_parser", REASONING_PARSERS), ("tool_call_parser", tuple(TOOL_PARSERS))):
        if engine_args.get(key) is not None and engine_args[key] not in known:  # refused before Triton starts
            raise ValueError(f"{name}: unknown {key} {engine_args[key]!r}; known: {', '.join(known)}")
    params = {"model_dir": str(model_dir or DEFAULT_MODEL), "max_model_len": str(max_model_len)}
    params.update({k: _param(v) for k, v in engine_args.items()})
    return ModelConfig(
        name=name, kind="chat", max_batch_size=0,
        inputs=[TensorSpec("request", "TYPE_STRING", [1]), TensorSpec("endpoint", "TYPE_STRING", [1], optional=True),
                TensorSpec("keepalive_s", "TYPE_FP32", [1], optional=True)],
        outputs=[TensorSpec("status", "TYPE_INT32", [1]), TensorSpec("response", "TYPE_STRING", [1])],
        instance_group=InstanceGroup(kind=instance_kind, count=instances), decoupled=True, parameters=params,
    )  # fmt: skip


def embed_config(model_dir: str | None = None, name: str = "embed", dim: int = 384,
                 max_batch_size: int = 32, batching: DynamicBatching | None = None, instances: int = 1,
                 version_policy: str = "latest { num_versions: 1 }",
                 dynamic_batching: bool = True) -> ModelConfig:  # fmt: skip
    """The embedding model; `dynamic_batching=False` runs each request on its own
    (the baseline the batching benchmark compares against). A request gives `text` or
    `token_ids` (-1 pads a shorter row); `tokens` says how many tokens each row was."""
    batching = batching or DynamicBatching(
        preferred_batch_size=[8, 16, 32], max_queue_delay_microseconds=5000,
        priority_levels=2, default_priority_level=2, queue_policy=QueuePolicy(max_queue_size=1024),
    )  # fmt: skip
    return ModelConfig(
        name=name, kind="embed", max_batch_size=max_batch_size,
        inputs=[TensorSpec("text", "TYPE_STRING", [1], optional=True),
                TensorSpec("token_ids", "TYPE_INT64", [-1], optional=True)],
        outputs=[TensorSpec("embedding", "TYPE_FP32", [dim]), TensorSpec("tokens", "TYPE_INT32", [1])],
        instance_group=InstanceGroup(count=instances),
        dynamic_batching=batching if dynamic_batching else None,
        version_policy=version_policy,
        parameters={"model_dir": model_dir or default_embedding_model_dir()},
    )  # fmt: skip


def rerank_config(model_dir: str | None = None, name: str = "rerank", cross_encoder: str = "",
                  max_batch_size: int = 8, instances: int = 1) -> ModelConfig:  # fmt: skip
    params = {"model_dir": model_dir or default_embedding_model_dir()}
    if cross_encoder:
        params["cross_encoder_dir"] = cross_encoder
    return ModelConfig(
        name=name, kind="rerank", max_batch_size=max_batch_size,
        inputs=[TensorSpec("query", "TYPE_STRING", [1]), TensorSpec("documents", "TYPE_STRING", [-1])],
        outputs=[TensorSpec("scores", "TYPE_FP32", [-1]), TensorSpec("tokens", "TYPE_INT32", [1])],
        instance_group=InstanceGroup(count=instances),
        dynamic_batching=DynamicBatching(preferred_batch_size=[], max_queue_delay_microseconds=2000),
        parameters=params,
    )  # fmt: skip


_BUILDERS = {"chat": chat_config, "embed": embed_config, "rerank": rerank_config}


def _nested(cls, value):
    """Build a dataclass (possibly nested) from a plain dict read from YAML."""
    if not isinstance(value, dict):
        return value
    kwargs = {}
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for key, item in value.items():
        if key not in hints:
            raise ValueError(f"unknown {cls.__name__} setting {key!r}")
        sub = {"queue_policy": QueuePolicy}.get(key)
        kwargs[key] = _nested(sub, item) if sub else item
    return cls(**kwargs)


def platform_models(spec: dict[str, Any] | None = None) -> list[ModelConfig]:
    """The repository's models: the three defaults, or those a platform.yaml names.

    spec: {"models": {NAME: {"kind": chat|embed|rerank, ...builder keyword arguments}}};
    `batching:` takes DynamicBatching fields. With no spec: chat, embed and rerank.
    """
    if not spec or not spec.get("models"):
        return [chat_config(), embed_config(), rerank_config()]
    models = []
    for name, settings in spec["models"].items():
        settings = dict(settings or {})
        kind = settings.pop("kind", name)
        if kind not in _BUILDERS:
            raise ValueError(f"model {name!r}: kind must be one of {MODEL_KINDS}, got {kind!r}")
        if "batching" in settings:
            settings["batching"] = _nested(DynamicBatching, settings["batching"])
        try:
            models.append(_BUILDERS[kind](name=name, **settings))
        except TypeError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None
    return models
