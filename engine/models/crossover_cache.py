"""Up to how many rows GGUF blocks beat the dense copy (`crossover_rows`), measured once per CPU and kept. Timing it
sweeps the model's every linear at 14 row counts, twice per kernel and count: 5.3 s of an fp32 engine's 7.9 s start
on a Zen 4, 2 of 3.1 in bf16, at every replica start. The key is what the answer depends on: the CPU (model name and
flags), torch's threads and version, the dtype, the matrices' kinds and shapes, the row counts tried and the block
kernels' sources, so a change to any of them measures again; deleting the folder does too."""
from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.cpu_kernels import SOURCES, cpu_features_tag
from engine.layers.quantized import CALIBRATION_ROWS, crossover_rows
from engine.models.cache_files import write_whole

log = logging.getLogger(__name__)
KERNELS = ("quantized_matmul_cpu.cpp", "interleaved_matmul_cpu.cpp")


def kept_crossover_rows(linears: list, dtype: torch.dtype, cache: Path | None) -> int:
    """`crossover_rows(linears, dtype)`, read from `cache` where this CPU measured it before (None: always timed)."""
    if cache is None:
        return crossover_rows(linears, dtype)
    path = cache / "gguf-crossover" / f"{_key(linears, dtype)}.json"
    try:
        kept = json.loads(path.read_text())
        log.info("GGUF blocks up to %d rows (measured on this CPU at %s; %s)", kept["rows"], kept["measured"], path)
        return int(kept["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rows = crossover_rows(linears, dtype)
    log.info("GGUF blocks up to %d rows (measured now, kept in %s)", rows, path)
    _keep(path, {"rows": rows, "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "cpu": _cpu_model(), "threads": torch.get_num_threads(), "dtype": str(dtype)})
    return rows


def _key(linears: list, dtype: torch.dtype) -> str:
    kernels = [(SOURCES / name).read_bytes() for name in KERNELS]
    parts = [_cpu_model(), cpu_features_tag(), torch.__version__, torch.get_num_threads(), str(dtype), CALIBRATION_ROWS,
             [(m.blocks.kind, m.in_features, m.out_features) for m in linears],
             [hashlib.blake2b(source, digest_size=8).hexdigest() for source in kernels]]
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=10).hexdigest()


def _keep(path: Path, record: dict) -> None:
    """A cache that cannot be written only costs the next start the timing."""
    try:
        write_whole(path, lambda staging: staging.write_text(json.dumps(record)))
    except OSError as exc:
        log.warning("could not keep the measured GGUF crossover in %s: %s", path.parent, exc)


def _cpu_model() -> str:
    """The first CPU's name, family and model ("AMD EPYC" alone names Zen 1 to 4 on these VMs)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return " / ".join(fields.get(name, "") for name in ("model name", "cpu family", "model"))
