"""What the step loop costs, for `EngineStats` and the metrics: seconds by phase of the step, garbage-collector
pauses, and the process's resident memory. A slow drift in any of them shows on the per-replica dashboard."""
from __future__ import annotations

import contextlib
import gc
import os
import time
import weakref

PHASES = ("schedule", "prepare", "forward", "sample", "output")
DEVICE_PHASES = ("prepare", "forward", "sample")  # the ones that queue device work
GENERATIONS = (0, 1, 2)
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PhaseTimer:
    """Seconds spent in each phase of the step, summed since the engine started. With `cuda`, phases are timed by
    CUDA events on the device's stream: the host returns from a forward long before the GPU finishes it, so a host
    clock would put the forward's time under whichever phase waits for it first (the sampler's). Host-only phases
keep the host clock: events between which the device runs nothing measure nothing."""

    def __init__(self, cuda: bool = False):
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._pending: list[tuple[str, object, object]] = []  # (phase, start event, end event) not yet read
        self.cuda = cuda

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.cuda and phase in DEVICE_PHASES:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((phase, start, end))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - start

    @property
    def seconds(self) -> dict[str, float]:
        """The totals, with every phase the device has finished since the last read."""
        while self._pending and self._pending[0][2].query():
            phase, start, end = self._pending.pop(0)
            self._seconds[phase] += start.elapsed_time(end) / 1e3
        return self._seconds


class GcPauses:
    """Collections and their summed pause by generation, from `gc.callbacks`, since this object was made. The
    callback holds only a weak reference; those whose owner is gone are dropped when the next one is made."""

    def __init__(self):
        self.collections = dict.fromkeys(GENERATIONS, 0)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self._started: float | None = None
        owner = weakref.ref(self)

        def callback(phase: str, info: dict) -> None:
            pauses = owner()
            if pauses is not None:
                pauses.record(phase, info["generation"])

        callback.gc_pauses_owner = owner
        gc.callbacks[:] = [cb for cb in gc.callbacks if getattr(cb, "gc_pauses_owner", _alive)() is not None] + [callback]

    def record(self, phase: str, generation: int) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            self.collections[generation] += 1
            self.seconds[generation] += now - self._started
            self._started = None


def freeze_gc_heap() -> None:
    """Move everything start-up made (modules, the model's Python objects, Ray's and FastAPI's state: about 450,000
    objects in a replica) out of the collector's reach, so a full collection walks only what serving allocates. A
    serving process calls it once, when it is ready. Unfrozen, the replica's and the ingress's full collections took
    0.1-0.3 s each, on the event loop every stream passes through (measured under the echo attack); vLLM's core and
    API server freeze theirs likewise."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen_during():
    """Keep every object that exists now out of the collector's reach while the block runs, then hand them back (an
    O(1) move each way). A full collection walks every tracked object: in an offline process with torch and
    transformers loaded that is ~400,000, a 190 ms stall, and at batch 256 one came every ~430 decode steps, 7% of a
    generate's time (BENCHMARKS.md, 2026-12-02). Cyclic garbage among the older objects waits for the block's end.
    A process that froze its heap for good (freeze_gc_heap: the serving ones) is left so."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class ResidentMemory:
    """`resident_bytes`, read again once `every_s` has passed: a read of /proc costs ~15-25 us, and the stats are
    built once or twice a step (the metrics' flush, the core's reply), which on a GPU's ~3 ms step is host time the
    GPU waits for; the gauge is scraped every few seconds."""

    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self._value, self._read_at = 0, float("-inf")

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self._read_at >= self.every_s:
            self._value, self._read_at = resident_bytes(), now
        return self._value


def stats_of(phases: PhaseTimer, gc_pauses: GcPauses, resident: ResidentMemory) -> dict[str, object]:
    """Their running totals and the resident memory, as `EngineStats` fields."""
    return {"step_seconds": dict(phases.seconds), "gc_collections": dict(gc_pauses.collections),
            "gc_pause_seconds": dict(gc_pauses.seconds), "resident_bytes": resident()}


def _alive() -> bool:
    return True


def resident_bytes() -> int:
    """This process's resident set (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0
