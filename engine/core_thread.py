"""The engine core on a background thread of the calling process: the in-process mode (tests, benchmarks, one
process for everything). The inline core (core_inline.py) with a thread that steps it; an EngineCore
(core_protocol.py), as ProcessCore is."""
from __future__ import annotations

import logging
import threading
import time

from engine.config import EngineConfig
from engine.core_inline import InlineCore
from engine.core_messages import EngineRequest
from engine.core_protocol import Deliver, OnDeath
from engine.step_recovery import step_problem

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


class ThreadCore(InlineCore):
    def __init__(self, config: EngineConfig, deliver: Deliver, on_death: OnDeath):
        super().__init__(config, deliver, on_death)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_loop, name="engine-step-loop", daemon=True)
            self._thread.start()

    def add(self, request: EngineRequest) -> None:
        super().add(request)
        self._wake.set()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        super().abort(request_id, reason)
        self._wake.set()

    def health_problem(self) -> str | None:
        """Why this engine should be replaced, or None: a dead loop, K steps in a row in which no request could
        run, or one step running past its deadline (a hung kernel or device)."""
        if self._thread is None or not self._thread.is_alive() or self.dead_reason is not None:
            return self.dead_reason or "the engine loop is not running"
        started = self.engine.step_started_at
        return step_problem(self.config, None if started is None else time.monotonic() - started,
                            "an engine step has run for", self.engine.consecutive_failed_steps)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run_loop(self) -> None:
        try:
            self.loop_threads = self.engine.claim_threads()
            while not self._stop.is_set():
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as exc:  # step() contains per-request failures; reaching here means the engine is broken
            log.exception("engine loop died")
            self.dead_reason = f"engine loop died: {type(exc).__name__}: {exc}"
            self._on_death(self.dead_reason)
