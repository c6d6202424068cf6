"""ProcessCore: the front end's handle on an engine core running in a child process (engine/core_process.py).
An EngineCore (core_protocol.py), as ThreadCore is: validated requests go in, each step's CoreOutputs come out
through `deliver`, on a receiver thread.

One ZMQ PUSH/PULL pair over ipc carries msgpack messages: requests and aborts as they come, one CoreOutputs per
step back. The child dies with this process (its stdin is our pipe)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq

from engine.admission import check_admission
from engine.config import EngineConfig
from engine.core_protocol import Deliver, OnDeath
from engine.core_messages import CoreFailed, CoreInputs, CoreOutputs, CoreReady, CoreSetup, EngineRequest, FromCore
from engine.engine_stats import EngineStats
from engine.errors import EngineDeadError
from engine.host_memory import with_huge_page_heap
from engine.metrics import MetricsSink, StepMetrics, replay
from engine.step_recovery import step_problem

log = logging.getLogger(__name__)
POLL_MS = 200  # how often the receiver looks at the child while no message comes
START_TIMEOUT_S = 900  # a first start converts the embedded GGUF and builds the kernels


def core_environment(env) -> dict[str, str]:
    """The core's environment: the caller's, less the secrets it has no use for (the serving key, Ray's token, any
    *_API_KEY, *SECRET*, *PASSWORD*), with glibc's heap on huge pages. Hub tokens stay: the core loads the weights."""
    def withheld(name: str) -> bool:
        upper = name.upper()
        return upper.endswith("API_KEY") or "SECRET" in upper or "PASSWORD" in upper or upper.startswith("RAY_AUTH_TOKEN")

    return with_huge_page_heap({name: value for name, value in env.items() if not withheld(name)})


class ProcessCore:
    def __init__(self, config: EngineConfig, deliver: Deliver, on_death: OnDeath):
        self.config = config
        self._deliver, self._on_death = deliver, on_death
        self._dir = tempfile.mkdtemp(prefix="engine-core-")
        self._context = zmq.Context()
        self._to_core = self._bind(zmq.PUSH, "inputs")
        self._from_core = self._bind(zmq.PULL, "outputs")
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._in_flight: set[str] = set()  # request ids sent and not yet reported finished
        self._metrics_sink: MetricsSink | None = None
        self._closing = False
        self.dead_reason: str | None = None
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "engine.core_process"], stdin=subprocess.PIPE,
                                            env=core_environment(os.environ))
        except BaseException:  # no child to shut down: its sockets' directory would be left behind
            self._context.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        setup = CoreSetup(config.model_dump_json(), f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs")
        self.process.stdin.write(msgspec.json.encode(setup) + b"\n")
        self.process.stdin.flush()
        try:
            ready = self._wait_ready()
        except BaseException:
            self.shutdown(timeout=1.0)
            raise
        self.limits, self.settings, self._stats = ready.limits, ready.settings, ready.stats
        self.grammars = None  # the core compiles its own, in its process
        self._last_progress = time.monotonic()
        self._receiver = threading.Thread(target=self._receive_loop, name="engine-core-receiver", daemon=True)
        self._receiver.start()

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # bounded upstream, by max_waiting
        socket.bind(f"ipc://{self._dir}/{name}")
        return socket

    def _wait_ready(self) -> CoreReady:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._from_core.poll(POLL_MS):
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine core process exited with code {self.process.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core did not start within {START_TIMEOUT_S} s")
        message = self._decoder.decode(self._from_core.recv())
        if isinstance(message, CoreFailed):
            raise RuntimeError(f"the engine core could not start: {message.error}")
        return message

    # -- the front end's calls -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """The core warms itself up before it answers ready."""

    def start(self) -> None:
        """The core runs from construction on."""

    def add(self, request: EngineRequest) -> None:
        """Checks what only the core could otherwise: a duplicate id, a full queue (counting every request in
        flight not known to be running, so the core itself never has to refuse)."""
        check_admission(request.request_id, self._in_flight, len(self._in_flight) - self._stats.num_running,
                        self.config.max_waiting)
        if not self._in_flight:
            self._last_progress = time.monotonic()  # the core was idle: the wait for a step starts now
        self._in_flight.add(request.request_id)
        try:
            self._send(CoreInputs(requests=[request]))
        except BaseException:
            self._in_flight.discard(request.request_id)
            raise

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._send(CoreInputs(aborts={request_id: reason}))

    def attach_metrics(self, metrics: StepMetrics) -> None:
        """The core's StepMetrics records; its updates are replayed here, on `metrics.sink`."""
        self._metrics_sink = metrics.sink
        self._send(CoreInputs(metrics_model_name=metrics.model_name))

    def stats(self) -> EngineStats:
        return self._stats

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight)

    def health_problem(self) -> str | None:
        """A dead core, a core with work that has not finished a step within step_timeout_s, or K failed steps."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.process.poll() is not None:
            return f"the engine core process exited with code {self.process.returncode}"
        waited = time.monotonic() - self._last_progress if self._in_flight else None
        return step_problem(self.config, waited, "with requests in flight, no engine step finished in",
                            self._stats.consecutive_failed_steps)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._send(CoreInputs(shutdown=True))
            self.process.wait(timeout)
        except Exception:  # a core that will not stop is killed
            self.process.kill()
            self.process.wait()
        finally:
            self.process.stdin.close()
            receiver = getattr(self, "_receiver", None)
            if receiver is not None and receiver is not threading.current_thread():
                receiver.join(2 * POLL_MS / 1000)
            self._context.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, message: CoreInputs) -> None:
        """Never blocks: without a high-water mark a PUSH socket only refuses when no core is connected."""
        try:
            with self._send_lock:
                self._to_core.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("the engine core process is not connected")

    # -- the receiver thread ---------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        try:
            while not self._closing and self.dead_reason is None:
                if self._from_core.poll(POLL_MS):
                    self._handle(self._decoder.decode(self._from_core.recv()))
                elif self.process.poll() is not None:
                    self._die(f"the engine core process exited with code {self.process.returncode}")
        except Exception as exc:
            if not self._closing:
                log.exception("the engine core's receiver failed")
                self._die(f"the engine core's receiver failed: {type(exc).__name__}")

    def _handle(self, message: CoreOutputs | CoreFailed | CoreReady) -> None:
        if isinstance(message, CoreFailed):
            self._die(message.error)
            return
        self._last_progress = time.monotonic()
        self._stats = message.stats
        if self._metrics_sink is not None:
            replay(message.metric_updates, self._metrics_sink)
        for out in message.outputs:
            if out.finish_reason is not None:
                self._in_flight.discard(out.request_id)
        self._deliver(message.outputs)

    def _die(self, reason: str) -> None:
        if self.dead_reason is None and not self._closing:
            log.error("engine core lost: %s", reason)
            self.dead_reason = reason
            self._on_death(reason)
