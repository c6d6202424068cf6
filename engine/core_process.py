"""The engine core in its own process (`python -m engine.core_process`, started by ProcessCore): its step loop
has an interpreter lock of its own, so the replica's HTTP and Ray messaging never wait on it, nor it on them.

It reads one CoreSetup line from stdin, loads and warms the engine, answers CoreReady, then loops: take what the
front end sent (requests, aborts), run a step, send one CoreOutputs. It exits when told to or when its stdin
closes, which happens when the parent dies however it dies."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import threading

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core_messages import CoreFailed, CoreInputs, CoreOutput, CoreOutputs, CoreReady, CoreSetup
from engine.errors import EngineOverloadedError
from engine.llm_engine import LLMEngine
from engine.metrics import RecordingSink, StepMetrics
from engine.sequence import RequestMetrics, RequestOutput

log = logging.getLogger("engine.core")
IDLE_POLL_MS = 500


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
    except Exception as exc:
        log.exception("the engine core could not start")
        outputs.send(encoder.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        return 1
    loop = CoreLoop(engine, inputs, outputs, loop_threads=engine.claim_threads())
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
    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket, loop_threads: int):
        self.engine = engine
        self.loop_threads = loop_threads
        self.inputs, self.outputs = inputs, outputs
        self.decoder = msgspec.msgpack.Decoder(CoreInputs)
        self.encoder = msgspec.msgpack.Encoder()
        self.refused: list[CoreOutput] = []  # requests the engine would not take, answered with the next message
        self.metrics_sink: RecordingSink | None = None

    def run(self) -> None:
        while True:
            for message in self._receive(wait=not (self.engine.has_unfinished_requests() or self.refused)):
                if message.shutdown:
                    return
                self._apply(message)
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            self._send([*self.refused, *map(to_core_output, outputs)])
            self.refused = []

    def _receive(self, wait: bool) -> list[CoreInputs]:
        messages, timeout = [], IDLE_POLL_MS if wait else 0
        while self.inputs.poll(timeout):
            messages.append(self.decoder.decode(self.inputs.recv()))
            timeout = 0
        return messages

    def _apply(self, message: CoreInputs) -> None:
        if message.metrics_model_name is not None and self.metrics_sink is None:
            self.metrics_sink = RecordingSink()
            self.engine.attach_metrics(StepMetrics(self.metrics_sink, message.metrics_model_name))
        for request in message.requests:
            try:
                self.engine.add_engine_request(request)
            except Exception as exc:  # the front end checks first; this is the rare race, never a lost request
                reason = str(exc) if isinstance(exc, EngineOverloadedError) else f"{type(exc).__name__}: {exc}"
                self.refused.append(CoreOutput(request.request_id, "", [], RequestMetrics(request.arrival_time),
                                               "abort", f"the engine refused the request: {reason}"))
        for request_id in message.aborts:
            self.engine.abort(request_id)

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "metrics_share_of_step": self.engine.metrics_share_of_step,
                "loop_threads": self.loop_threads, "core_pid": os.getpid()}

    def _send(self, outputs: list[CoreOutput]) -> None:
        updates = self.metrics_sink.take() if self.metrics_sink is not None else []
        self.outputs.send(self.encoder.encode(CoreOutputs(outputs, self.stats(), updates)))


def to_core_output(out: RequestOutput) -> CoreOutput:
    """The step's news of one request: its deltas, and its prompt logprobs with its first tokens."""
    new = len(out.delta_token_ids)
    first = new == len(out.token_ids)
    return CoreOutput(out.request_id, out.delta_text, out.delta_token_ids, out.metrics, out.finish_reason, out.error,
                      out.logprobs[len(out.logprobs) - new:] if out.logprobs is not None else None,
                      out.num_cached_tokens, out.prompt_logprobs if first else None)


if __name__ == "__main__":
    sys.exit(main())
