"""The KV pool sized by profiling on CUDA (`engine/kv_budget.py`): each engine takes its own share of the device,
`gpu_memory_utilization` of its total as vLLM reads it, whatever other processes held when it began, so two models
on one GPU (`num_gpus: 0.5` each) can each be given half."""
import gc

import pytest

from engine.kv_budget import DeviceMemoryAtStart, kv_budget_bytes
from tests.fixtures.tiny_models import tiny_checkpoint

GiB = 1 << 30


def test_memory_held_before_the_engine_began_is_not_counted_against_its_share():
    at_start = DeviceMemoryAtStart(free=60 * GiB, total=100 * GiB, torch_reserved=0)  # another engine holds 40
    # the engine took 10 (weights, workspaces); its costliest step peaks at 5 more
    assert kv_budget_bytes(0.5, at_start, 50 * GiB, 10 * GiB, 5 * GiB) == 35 * GiB


def test_another_process_allocating_meanwhile_makes_the_pool_smaller():
    at_start = DeviceMemoryAtStart(free=100 * GiB, total=100 * GiB, torch_reserved=0)
    assert kv_budget_bytes(0.5, at_start, 70 * GiB, 10 * GiB, 5 * GiB) == 15 * GiB  # 20 of the 30 were another's


def test_another_process_freeing_meanwhile_never_makes_the_pool_larger():
    at_start = DeviceMemoryAtStart(free=60 * GiB, total=100 * GiB, torch_reserved=2 * GiB)
    # 20 freed elsewhere while the engine's own allocator grew by 10: the fall in free memory (-10) would say it took
    # nothing
    assert kv_budget_bytes(0.5, at_start, 70 * GiB, 12 * GiB, 5 * GiB) == 35 * GiB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("kv-budget"), "qwen2-hd128")


@pytest.mark.gpu
@pytest.mark.slow
def test_an_engine_takes_its_share_beside_memory_held_before_it(checkpoint):
    import torch

    from engine import LLM, SamplingParams

    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    held = torch.empty(int(0.3 * total), dtype=torch.uint8, device="cuda")  # another model's, as far as it knows
    llm = LLM(model=checkpoint, dtype="float32", device="cuda", attention_backend="triton", enforce_eager=True,
              gpu_memory_utilization=0.5)
    try:
        pool = llm.engine.runner.kv_cache
        # the share less the tiny model's weights and warm-up peak, and whatever other tests' processes (make
        # gpu-check's xdist workers) took meanwhile; counting the 30% held before it began left under 20%
        assert 0.4 * total <= pool.numel() * pool.element_size() <= 0.5 * total, llm.engine.runner.num_blocks
        out = llm.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 4
    finally:
        del llm, held
        gc.collect()  # the engine's cycles hold its pool
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_share_larger_than_the_free_memory_is_refused_at_start(checkpoint):
    import torch

    from engine import LLM

    torch.cuda.empty_cache()
    held = torch.empty(int(0.3 * torch.cuda.mem_get_info()[1]), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(ValueError, match="gpu_memory_utilization 0.75 asks for"):
            LLM(model=checkpoint, dtype="float32", device="cuda", attention_backend="triton", enforce_eager=True,
                gpu_memory_utilization=0.75)
    finally:
        del held
        torch.cuda.empty_cache()
