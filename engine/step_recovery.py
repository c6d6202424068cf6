"""When a step raises, find the requests that broke it, fail only those, and serve the rest in the same step; and
what the record of steps says against the engine (its health)."""
from __future__ import annotations

import logging
from typing import Callable

from engine.config import EngineConfig
from engine.core_messages import CoreOutput
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)


def retry_in_groups(batch: ScheduledBatch, execute: Callable[[ScheduledBatch], list[CoreOutput]],
                    fail: Callable[[Sequence, str], CoreOutput]) -> tuple[list[CoreOutput], bool]:
    """Retry the step once without the sequences still in prefill (the newest admissions, where bad input shows
    first), then each of those alone; only a group that fails again is failed. Nothing was committed by the failed
    attempt (computed counts advance after sampling), so a retry recomputes the same KV slots. Returns the outputs
    and whether the engine is at fault: every group failed (a lost device fails everything), or the group of
    requests that had already decoded did (their input ran before; a broken decode path fails them while each
    newcomer's prefill still passes alone, which would otherwise look healthy under steady traffic)."""
    newest, older = [], []
    for i, seq in enumerate(batch.seqs):
        (newest if seq.num_output_tokens == 0 else older).append(i)
    groups = ([older] if older else []) + [[i] for i in newest]
    outputs, failed = [], []
    for group in groups:
        part = batch.subset(group)
        try:
            outputs += execute(part)
        except Exception as exc:
            log.warning("a retried group of %d requests failed again (%s)", len(group), type(exc).__name__)
            failed.append(group)
            outputs += [fail(seq, f"engine step failed: {type(exc).__name__}") for seq in part.seqs]
    return outputs, len(failed) == len(groups) or (bool(older) and older in failed)


def step_problem(config: EngineConfig, stalled_s: float | None, stall: str, failed_steps: float) -> str | None:
    """What the step loop's own record says against the engine, or None: a step (or the wait for one) past its
    deadline, described by `stall`, or too many failed steps in a row. Both cores, thread and process, ask it."""
    if stalled_s is not None and stalled_s > config.step_timeout_s:
        return f"{stall} {stalled_s:.0f} s (limit {config.step_timeout_s:g} s)"
    if failed_steps >= config.max_consecutive_failed_steps:
        return f"{failed_steps:.0f} engine steps in a row failed"
    return None
