"""Triton Inference Server: model repository generation, Python-backend models, launcher."""

from llmserve.triton.build_repo import build_repo, write_model
from llmserve.triton.repo_config import (
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    QueuePolicy,
    TensorSpec,
    chat_config,
    embed_config,
    platform_models,
    rerank_config,
)  # fmt: skip
from llmserve.triton.server import TritonServer

__all__ = [
    "DynamicBatching", "InstanceGroup", "ModelConfig", "QueuePolicy", "TensorSpec", "TritonServer",
    "build_repo", "chat_config", "embed_config", "platform_models", "rerank_config", "write_model",
]  # fmt: skip
