"""A continuous-batching LLM engine with a paged KV cache. Pure PyTorch + transformers; never imports Ray."""
from engine.async_engine import AsyncLLMEngine
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.errors import EngineDeadError, EngineInputError, EngineOverloadedError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.sequence import RequestOutput

__all__ = [
    "AsyncLLMEngine", "DEFAULT_MODEL", "EngineConfig", "EngineDeadError", "EngineInputError", "EngineOverloadedError",
    "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutput",
]
