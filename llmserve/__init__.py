"""llmserve: serve large language models fast."""

from llmserve.config import EngineArgs
from llmserve.engine.async_engine import AsyncEngine
from llmserve.llm import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
