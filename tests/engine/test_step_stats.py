"""The step's own cost accounting: phase timers, garbage-collector pauses, resident memory."""
import gc
import mmap
import time

from engine.step_stats import GcPauses, PhaseTimer, resident_bytes


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
    callbacks = len(gc.callbacks)
    del pauses
    later = GcPauses()  # the dead one's callback goes when the next is made
    assert len(gc.callbacks) == callbacks
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
