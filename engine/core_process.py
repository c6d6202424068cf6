"""The engine core in its own process (`python -m engine.core_process`, started by ProcessCore): its step loop
has an interpreter lock of its own, so the replica's HTTP and Ray messaging never wait on it, nor it on them.

It reads one CoreSetup line from stdin, loads and warms the engine, answers CoreReady, then loops: take what the
front end sent (requests, aborts), run a step, send one CoreOutputs. It exits when told to or when its stdin
closes, which happens when the parent dies however it dies."""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch
import zmq

from engine.config import EngineConfig
from engine.core_messages import CoreFailed, CoreInputs, CoreOutput, CoreOutputs, CoreReady, CoreSetup, EngineRequest
from engine.cpu_contention import threads_runnable_elsewhere
from engine.engine_stats import EngineStats
from engine.errors import EngineOverloadedError
from engine.llm_engine import LLMEngine
from engine.metrics import RecordingSink, StepMetrics
from engine.sequence import RequestMetrics
from engine.step_stats import freeze_gc_heap

log = logging.getLogger("engine.core")
IDLE_POLL_MS = 500
COMPILE_POLL_MS = 5  # how often an otherwise idle loop looks for a finished grammar
# Past this many tokens to compute a step's ops are long enough between barriers that two threads sharing a core
# beat one: with other processes runnable (served, on 2 cores), one thread fewer matched two at 8 and 32 decoding
# streams with a lower p95, but cost 7-19% of decode speed at 64 streams and 45% of a step's time beside scored
# 4,090-token prompts (BENCHMARKS.md, forty-sixth session).
SHARE_WITH_OTHERS_MAX_TOKENS = 32


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    setup = msgspec.json.decode(sys.stdin.buffer.readline(), type=CoreSetup)
    socket_dir = os.path.dirname(setup.inputs_address.removeprefix("ipc://"))
    threading.Thread(target=_exit_with_parent, args=(socket_dir,), name="parent-watch", daemon=True).start()
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.setsockopt(zmq.RCVHWM, 0)
    outputs.setsockopt(zmq.SNDHWM, 0)  # one message a step; the parent reads them as they come
    inputs.connect(setup.inputs_address)
    outputs.connect(setup.outputs_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = LLMEngine(EngineConfig.model_validate_json(setup.config_json))
        engine.warm_up()  # before answering ready
        engine.grammars.warm_up()  # llguidance's tokenizer: about a second, not paid by the first structured request
    except Exception as exc:
        log.exception("the engine core could not start")
        outputs.send(encoder.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        return 1
    loop = CoreLoop(engine, inputs, outputs, loop_threads=engine.claim_threads())
    freeze_gc_heap()
    outputs.send(encoder.encode(CoreReady(engine.limits, engine.settings(), loop.stats())))
    try:
        loop.run()
    except Exception as exc:  # step() contains per-request failures; reaching here means the engine is broken
        log.exception("engine core loop died")
        outputs.send(encoder.encode(CoreFailed(f"engine loop died: {type(exc).__name__}: {exc}")))
        return 1
    finally:
        outputs.close(linger=1000)
        inputs.close(linger=0)
    return 0


def _exit_with_parent(socket_dir: str) -> None:
    """The parent holds the other end of stdin; EOF means it is gone (or done), and so is this process. A parent
    that was killed could not remove the sockets' directory: the core does."""
    while os.read(sys.stdin.fileno(), 4096):  # unbuffered: a buffered reader's lock would stall shutdown
        pass
    shutil.rmtree(socket_dir, ignore_errors=True)
    os._exit(0)


class CoreLoop:
    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket, loop_threads: int,
                 runnable_elsewhere: Callable[[], int] = threads_runnable_elsewhere):
        self.engine = engine
        self.loop_threads = loop_threads
        self.runnable_elsewhere = runnable_elsewhere
        self.inputs, self.outputs = inputs, outputs
        self.decoder = msgspec.msgpack.Decoder(CoreInputs)
        self.encoder = msgspec.msgpack.Encoder()
        self.refused: list[CoreOutput] = []  # requests the engine would not take, answered with the next message
        self.metrics_sink: RecordingSink | None = None
        # Grammars compile on a thread of their own: a request whose grammar is new waits there, not in a step, so
        # a client sending a new schema each time stalls no one else's decoding (as vLLM's requests wait for their
        # FSM). llguidance drops the interpreter lock while it compiles, and steps leave it a core (_share_cores).
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.compiling: list[tuple[EngineRequest, Future]] = []

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests() or self.refused
            for message in self._receive(timeout=0 if busy else COMPILE_POLL_MS if self.compiling else IDLE_POLL_MS):
                if message.shutdown:
                    return
                self._apply(message)
            self._admit_compiled()
            self._share_cores()
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            self._send([*self.refused, *outputs])
            self.refused = []

    def _receive(self, timeout: int) -> list[CoreInputs]:
        messages = []
        while self.inputs.poll(timeout):
            raw = self.inputs.recv()
            try:
                messages.append(self.decoder.decode(raw))
            except msgspec.DecodeError as exc:  # one bad message is dropped and logged; the loop serves on
                log.error("dropped a message the core could not decode (%d bytes): %s", len(raw), exc)
            timeout = 0
        return messages

    def _apply(self, message: CoreInputs) -> None:
        if message.metrics_model_name is not None and self.metrics_sink is None:
            self.metrics_sink = RecordingSink()
            self.engine.attach_metrics(StepMetrics(self.metrics_sink, message.metrics_model_name))
        for request in message.requests:
            spec = request.params.structured_output
            if spec is not None and not self.engine.grammars.is_compiled(spec):
                self.compiling.append((request, self.compiler.submit(self.engine.grammars.prepare, spec)))
            else:
                self._add(request)
        ended = message.aborts
        for entry in [entry for entry in self.compiling if entry[0].request_id in ended]:
            self.compiling.remove(entry)  # never reached the engine: it finishes here
            request_id = entry[0].request_id
            self.refused.append(CoreOutput(request_id, [], RequestMetrics(entry[0].arrival_time), ended[request_id]))
        for request_id, reason in ended.items():
            self.engine.abort(request_id, reason)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is now compiled join the engine (a copy of the compiled matcher each)."""
        ready = [entry for entry in self.compiling if entry[1].done()]
        for request, compiled in ready:
            self.compiling.remove((request, compiled))
            self._add(request)  # a grammar that failed to compile fails again here, as this request's refusal

    def _share_cores(self) -> None:
        """On a CPU, a step leaves one core to whoever else wants one as it starts: a running compile here, or,
        while the requests in have few tokens left to compute, another process (the replica checking new schemas,
        the ingress reading bodies, Ray's daemons). Sharing a core would slow a small step far more than the core it
        gives up: its OpenMP threads split each op evenly and wait for the slowest at every barrier (one decode
        beside 24 compiles: 28 ms a step alone, 150-290 ms at p90/max sharing, 44-46 ms median on one core fewer;
        beside the replica's schema checks, steps of 0.28-0.72 s where they take 40 ms; BENCHMARKS.md)."""
        if self.engine.device.type != "cpu" or self.loop_threads < 2:
            return
        shared = self.compiling or (self._few_tokens_to_compute() and self.runnable_elsewhere() > 0)
        threads = self.loop_threads - 1 if shared else self.loop_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # under a microsecond; OpenMP keeps its pool

    def _few_tokens_to_compute(self) -> bool:
        """Whether the requests in, running or waiting, have at most SHARE_WITH_OTHERS_MAX_TOKENS left to compute."""
        tokens = 0
        for seq in itertools.chain(self.engine.scheduler.running, self.engine.scheduler.waiting):
            tokens += seq.num_uncomputed_tokens
            if tokens > SHARE_WITH_OTHERS_MAX_TOKENS:
                return False
        return True

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # the front end checks first; this is the rare race, never a lost request
            reason = str(exc) if isinstance(exc, EngineOverloadedError) else f"{type(exc).__name__}: {exc}"
            self.refused.append(CoreOutput(request.request_id, [], RequestMetrics(request.arrival_time),
                                           "abort", f"the engine refused the request: {reason}"))

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.loop_threads, stats.core_pid = self.loop_threads, os.getpid()
        return stats

    def _send(self, outputs: list[CoreOutput]) -> None:
        updates = self.metrics_sink.take() if self.metrics_sink is not None else []
        self.outputs.send(self.encoder.encode(CoreOutputs(outputs, self.stats(), updates)))


if __name__ == "__main__":
    sys.exit(main())
