"""A kernel's time on the GPU as a captured step sees it: calls captured into one CUDA graph (no launch gaps from the
host), cycling through inputs that together outgrow L2, as a step reads each layer's weights and KV pool once. The
start-up plans (engine/gemm_plan.py, engine/split_plan.py) choose between kernels by it."""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

CALLS = 10  # calls a timed graph holds
REPLAYS = 5  # timed replays of it; the median counts


def time_calls(call: Callable[[Any], Any], inputs: Sequence) -> float:
    """Microseconds a call, as the median of REPLAYS replays of a graph of CALLS calls, call i on inputs[i % n]."""
    call(inputs[0])  # compiles a triton kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(inputs[i % len(inputs)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)
