"""The dtype an engine computes in. `auto`: bf16 on CUDA; on a CPU, bf16 where the CPU computes it natively, except
that a GGUF model whose dense copies run faster in fp32 on this CPU gets fp32.

Why GGUF alone: its blocks serve the small batches (up to the timed crossover, `crossover_cache.py`), whatever the
dtype, so the dtype only decides the large batches, where the dense copies run as GEMMs. There bf16 wins where the
CPU's bf16 GEMMs outrun its fp32 ones (AMX; Zen 4 and 5), and loses on an Intel core with AVX-512 bf16 and no AMX
(Cooper Lake; a Sapphire or Emerald Rapids guest with AMX hidden), where oneDNN's bf16 linears took 1.6x fp32's time
from 64 rows up and the chat workload served 1.32x faster in fp32 (BENCHMARKS.md, 2026-12-07). A dense model keeps
bf16: on that same CPU its small batches decode up to 1.58x faster in bf16 (half the bytes), which outweighs the
large batches' loss. So a GGUF model's linears are timed once per CPU at PROBE_ROWS in both dtypes (kept:
`cpu_measurements.py`), and fp32 is kept where bf16 is SLOWER_BY slower and fp32's dense copies take at most
FP32_MEMORY_SHARE of the machine's memory. fp32 also doubles the KV cache's bytes a token: `--dtype bfloat16` keeps
twice the tokens in the same pool."""
from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.models.cpu_measurements import kept_measurement

log = logging.getLogger(__name__)
PROBE_ROWS = 256  # a loaded replica's decode batch, and a prefill chunk's order of size
PROBE_ROUNDS = 5
SLOWER_BY = 1.15  # below this, noise or a near tie: bf16's halved bytes win
FP32_MEMORY_SHARE = 0.25


def cpu_has_bf16() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(config: EngineConfig, device: torch.device, hf_config=None, cache: Path | None = None) -> torch.dtype:
    """`config.dtype` as a torch dtype on `device`; `auto` on a CPU reads `hf_config` (the layer shapes to time)
    where the model is GGUF, and keeps the timing in `cache` (None: timed at every call)."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type != "cpu":
        return torch.bfloat16
    if not cpu_has_bf16():
        return torch.float32
    if config.quantization != "gguf" or hf_config is None:
        return torch.bfloat16
    return gguf_cpu_dtype(hf_config, cache)


def gguf_cpu_dtype(hf_config, cache: Path | None) -> torch.dtype:
    shapes = layer_shapes(hf_config)
    fp32_bytes = 4 * dense_parameters(hf_config, shapes)
    if fp32_bytes > FP32_MEMORY_SHARE * physical_memory():
        return torch.bfloat16
    record, read_back = kept_measurement(cache, "cpu-dtype", ["gguf dense copies", PROBE_ROWS, PROBE_ROUNDS, shapes],
                                         lambda: time_both(shapes, PROBE_ROWS, PROBE_ROUNDS), ("bf16_s", "fp32_s"))
    bf16_s, fp32_s = record["bf16_s"], record["fp32_s"]
    chosen = torch.float32 if bf16_s >= SLOWER_BY * fp32_s else torch.bfloat16
    log.info("dtype auto: %s (a layer's dense linears at %d rows: bf16 %.2f ms, fp32 %.2f ms; %s)",
             str(chosen).removeprefix("torch."), PROBE_ROWS, 1e3 * bf16_s, 1e3 * fp32_s,
             "measured on this CPU before" if read_back else "measured now")
    return chosen


def layer_shapes(hf_config) -> list[tuple[int, int]]:
    """(in, out) of a decoder layer's linears as the native model merges them: q/k/v, o, gate/up, down."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]


def dense_parameters(hf_config, shapes: list[tuple[int, int]]) -> int:
    tied = getattr(hf_config, "tie_word_embeddings", False)
    embeddings = hf_config.vocab_size * hf_config.hidden_size * (1 if tied else 2)
    return embeddings + hf_config.num_hidden_layers * sum(i * o for i, o in shapes)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def time_both(shapes: list[tuple[int, int]], rows: int, rounds: int) -> dict[str, float]:
    """Median seconds of one pass over `shapes`' linears, packed as the engine packs them, at `rows` rows, in bf16
    and in fp32; the two dtypes alternate, so a drift in the machine's speed falls on both."""
    dtypes = (("bf16_s", torch.bfloat16), ("fp32_s", torch.float32))
    sweeps = {name: _sweep(shapes, rows, dtype) for name, dtype in dtypes}
    times: dict[str, list[float]] = {name: [] for name in sweeps}
    with torch.inference_mode():
        for sweep in sweeps.values():
            sweep()  # warm: oneDNN picks and caches its kernels at the first call of a shape
        for _ in range(rounds):
            for name, sweep in sweeps.items():
                start = time.perf_counter()
                sweep()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _sweep(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype):
    linears = []
    for in_features, out_features in shapes:
        linear = Linear(in_features, out_features)
        linear.weight.data = torch.randn(out_features, in_features, dtype=dtype) / in_features**0.5
        linear.pack()
        linears.append((linear, torch.randn(rows, in_features, dtype=dtype)))
    return lambda: [linear.dense_forward(x) for linear, x in linears]
