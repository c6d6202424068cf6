"""The step's own cost accounting: phase timers, garbage-collector pauses, resident memory."""
import gc
import mmap
import time
import weakref

from engine import SamplingParams
from engine.step_stats import GcPauses, PhaseTimer, ResidentMemory, heap_frozen_during, resident_bytes


def test_phase_timer_adds_up_each_phase_even_when_it_raises():
    timer = PhaseTimer()
    with timer("forward"):
        time.sleep(0.01)
    try:
        with timer("sample"):
            raise ValueError
    except ValueError:
        pass
    assert timer.seconds["forward"] >= 0.01 and timer.seconds["sample"] > 0 and timer.seconds["schedule"] == 0


def test_gc_pauses_count_collections_and_leave_no_callback_behind():
    pauses = GcPauses()
    gc.collect()
    assert pauses.collections[2] >= 1 and pauses.seconds[2] > 0
    owners = lambda: [cb.gc_pauses_owner for cb in gc.callbacks if hasattr(cb, "gc_pauses_owner")]  # noqa: E731
    assert any(owner() is pauses for owner in owners())
    del pauses
    later = GcPauses()  # the dead one's callback goes when the next is made (and any other dead engine's)
    assert all(owner() is not None for owner in owners())
    gc.collect(0)
    assert later.collections[0] >= 1


def test_resident_bytes_grow_with_touched_memory():
    # a fresh mapping, not malloc: the engine keeps freed heap memory resident, so a bytearray may reuse it
    block = mmap.mmap(-1, 64 << 20)
    before = resident_bytes()
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert resident_bytes() - before > 32 << 20
    block.close()


def test_the_resident_gauge_reads_proc_again_only_once_its_interval_has_passed():
    block = mmap.mmap(-1, 64 << 20)
    every_step, once_a_minute = ResidentMemory(every_s=0.0), ResidentMemory(every_s=60.0)
    before = every_step(), once_a_minute()
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert every_step() - before[0] > 32 << 20 and once_a_minute() == before[1]
    block.close()


class _Cycle:
    def __init__(self):
        self.me = self


def _dropped_cycle() -> weakref.ref:
    """A weak reference to an object only a reference cycle keeps (only the cyclic collector frees it)."""
    return weakref.ref(_Cycle())


def test_the_heap_older_than_a_block_is_out_of_the_collectors_reach_during_it_and_back_after():
    assert gc.get_freeze_count() == 0, "an earlier test left the heap frozen"
    older = _dropped_cycle()
    with heap_frozen_during():
        assert gc.get_freeze_count() > 0
        younger = _dropped_cycle()
        gc.collect()
        assert younger() is None  # what the block makes is collected as usual
        assert older() is not None  # what was there before is not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert older() is None


def test_a_heap_frozen_for_good_stays_frozen_after_the_block():
    gc.freeze()
    try:
        with heap_frozen_during():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_generate_steps_with_the_older_heap_frozen_and_hands_it_back(llm32, monkeypatch):
    older, frozen_at_steps, step = _dropped_cycle(), [], llm32.step

    def watched_step():
        frozen_at_steps.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(llm32, "step", watched_step)
    llm32.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert frozen_at_steps and all(count > 0 for count in frozen_at_steps)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert older() is None  # the cycle older than the call is collected once it is over
