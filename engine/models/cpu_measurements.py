"""Figures timed once per CPU and set-up, then kept in the engine's cache and read back at every later start (the GGUF
crossover, the CPU dtype `auto` picks). A figure's key is everything it depends on (the CPU's model and flags,
torch's version and threads, plus what the caller names), so a change to any of them times it again; deleting the
folder does too, and a file that does not read, or lacks a number the caller needs, is timed again and rewritten
whole."""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from engine.cpu_kernels import cpu_features_tag
from engine.models.cache_files import write_whole

log = logging.getLogger(__name__)


def kept_measurement(cache: Path | None, folder: str, depends_on: list, measure: Callable[[], dict[str, Any]],
                     numbers: tuple[str, ...]) -> tuple[dict, bool]:
    """`measure()`'s record, read from `cache/folder` where this CPU timed it before (None: always timed), and
    whether it was read back rather than timed now. `numbers`: the fields a kept record must hold as numbers."""
    if cache is None:
        return measure(), False
    path = cache / folder / f"{_key(depends_on)}.json"
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and all(isinstance(kept.get(name), (int, float)) for name in numbers):
            return kept, True
    except (OSError, ValueError):
        pass
    record = measure() | {"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
                          "threads": torch.get_num_threads()}
    _keep(path, record)
    return record, False


def _key(depends_on: list) -> str:
    parts = [cpu_model(), cpu_features_tag(), torch.__version__, torch.get_num_threads(), depends_on]
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=10).hexdigest()


def _keep(path: Path, record: dict) -> None:
    """A cache that cannot be written only costs the next start the timing."""
    try:
        write_whole(path, lambda staging: staging.write_text(json.dumps(record)))
    except OSError as exc:
        log.warning("could not keep a measurement in %s: %s", path.parent, exc)


def cpu_model() -> str:
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
