"""Up to how many rows GGUF blocks beat the dense copy (`crossover_rows`), measured once per CPU and kept
(`cpu_measurements.py`). Timing it sweeps the model's every linear at 14 row counts, twice per kernel and count: 5.3 s
of an fp32 engine's 7.9 s start on a Zen 4, 2 of 3.1 in bf16, at every replica start. Besides the CPU and torch's
set-up, the answer depends on the dtype, the matrices' kinds and shapes, the row counts tried and the block kernels'
sources, so a change to any of them measures again."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from engine.cpu_kernels import SOURCES
from engine.layers.quantized import CALIBRATION_ROWS, crossover_rows
from engine.models.cpu_measurements import kept_measurement

log = logging.getLogger(__name__)
KERNELS = ("quantized_matmul_cpu.cpp", "interleaved_matmul_cpu.cpp")


def kept_crossover_rows(linears: list, dtype: torch.dtype, cache: Path | None) -> int:
    """`crossover_rows(linears, dtype)`, read from `cache` where this CPU measured it before (None: always timed)."""
    depends_on = [str(dtype), CALIBRATION_ROWS, [(m.blocks.kind, m.in_features, m.out_features) for m in linears],
                  [hashlib.blake2b((SOURCES / name).read_bytes(), digest_size=8).hexdigest() for name in KERNELS]]
    measure = lambda: {"rows": crossover_rows(linears, dtype), "dtype": str(dtype)}  # noqa: E731
    record, read_back = kept_measurement(cache, "gguf-crossover", depends_on, measure, ("rows",))
    rows = int(record["rows"])
    how = f"measured on this CPU at {record.get('measured')}" if read_back else "measured now"
    log.info("GGUF blocks up to %d rows (%s)", rows, how)
    return rows
