"""What the front end asks of an engine core, wherever the core runs. InlineCore (stepped on its caller's thread),
ThreadCore (a thread of this process) and ProcessCore (a child process over ZMQ) implement it; AsyncLLMEngine and the
offline LLM each hold one and ask which only to know whether to step it themselves (the LLM, an inline core)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core_messages import CoreOutput, EngineRequest, ModelLimits
    from engine.engine_stats import EngineStats
    from engine.metrics import StepMetrics
    from engine.structured_output import GrammarCompiler

Deliver = Callable[["list[CoreOutput]"], None]  # a step's outputs, called from the core's own thread
OnDeath = Callable[[str], None]  # the reason the core stopped for good


class EngineCore(Protocol):
    """Built with (config, deliver, on_death); ready to take requests once `start` returns."""

    config: EngineConfig
    limits: ModelLimits
    grammars: GrammarCompiler | None  # the core's compile cache, where the front end can share it (in-process)
    settings: dict[str, Any]  # what the running engine actually uses

    def warm_up(self) -> None: ...

    def start(self) -> None: ...

    def add(self, request: EngineRequest) -> None:
        """Queue a validated request; raises EngineOverloadedError when the waiting queue is full."""

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request; the front end ends one that reached a stop string with reason "stop"."""

    def attach_metrics(self, metrics: StepMetrics) -> None: ...

    def stats(self) -> EngineStats: ...

    def has_unfinished_requests(self) -> bool: ...

    def health_problem(self) -> str | None:
        """Why this core should be replaced, or None (step_recovery.step_problem decides for both)."""

    def shutdown(self, timeout: float = 5.0) -> None: ...
