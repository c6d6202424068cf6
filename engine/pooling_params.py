"""PoolingParams: what an embedding request asks (vLLM's PoolingParams for its embed task). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineInputError
from engine.sampling_params import is_int64


@dataclass(frozen=True)
class PoolingParams:
    """The final hidden state of the prompt's last token (vLLM's LAST pooling, what decoder embedding models such as
    Qwen3-Embedding and e5-mistral are trained for), cut to its first `dimensions` values where the model was trained
    for that (Matryoshka), then scaled to unit length where `normalize`."""

    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as the context holds)

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise EngineInputError(f"normalize must be true or false, got {self.normalize!r}", "normalize")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not is_int64(value):
                raise EngineInputError(f"{name} must be a 64-bit integer, got {value!r}", name)
        if self.dimensions is not None and self.dimensions < 1:
            raise EngineInputError(f"dimensions must be at least 1, got {self.dimensions}", "dimensions")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
            raise EngineInputError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}",
                                   "truncate_prompt_tokens")
