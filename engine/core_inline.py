"""The engine core on its caller's thread, stepped by its caller: the offline LLM's core, as vLLM's in-process client
is its LLM's. An EngineCore (core_protocol.py) like the others; `step()` runs one engine step and delivers its
outputs before it returns. ThreadCore is this core with a thread of its own that steps it."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core_messages import EngineRequest
from engine.core_protocol import Deliver, OnDeath
from engine.engine_stats import EngineStats
from engine.llm_engine import LLMEngine
from engine.metrics import StepMetrics
from engine.step_recovery import step_problem


class InlineCore:
    def __init__(self, config: EngineConfig, deliver: Deliver, on_death: OnDeath):
        self.engine = LLMEngine(config)
        self.config = config
        self.grammars = self.engine.grammars
        self.limits = self.engine.limits
        self.settings = self.engine.settings()
        self._deliver = deliver
        self._on_death = on_death
        self.dead_reason: str | None = None
        self.loop_threads = 0  # torch's threads, as the thread that steps the engine sees them

    def warm_up(self) -> None:
        self.engine.warm_up()

    def start(self) -> None:
        """Nothing to start: the caller steps it."""

    def step(self) -> None:
        """One engine step on the calling thread; its outputs are delivered before this returns."""
        outputs = self.engine.step()
        if outputs:
            self._deliver(outputs)

    def add(self, request: EngineRequest) -> None:
        self.engine.add_request(request)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.engine.abort(request_id, reason)

    def attach_metrics(self, metrics: StepMetrics) -> None:
        self.engine.attach_metrics(metrics)

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.loop_threads = self.loop_threads
        return stats

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def health_problem(self) -> str | None:
        """K steps in a row in which no request could run (a step in progress is the caller's own)."""
        return self.dead_reason or step_problem(self.config, None, "", self.engine.consecutive_failed_steps)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Nothing runs between the caller's steps."""
