"""A continuous-batching LLM engine with a paged KV cache. Pure PyTorch + transformers; never imports Ray.

Names load on first use (PEP 562), so a process that needs only the torch-free parts (the Serve ingress: sampling
parameters, errors, tool-call parsing) never imports torch."""
from importlib import import_module

_HOMES = {
    "AsyncLLMEngine": "engine.async_engine", "BeamSearchParams": "engine.beam_search", "DEFAULT_MODEL": "engine.config",
    "EngineConfig": "engine.config", "EngineDeadError": "engine.errors", "EngineInputError": "engine.errors",
    "EngineOverloadedError": "engine.errors", "LLM": "engine.llm", "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.output_processor", "PoolingParams": "engine.pooling_params",
    "RepetitionDetection": "engine.repetition", "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "engine.sampling_params", "ThinkingBudget": "engine.thinking_budget",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
