"""Keep freed host memory in the process on glibc, so per-step tensors reuse warm pages.

By default glibc returns big blocks (the logits, the sampler's float copy) to the kernel on free, and every step
then pays page faults to get them back: about 10% of a CPU step (benchmarks/step_time.py, BENCHMARKS.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest value older glibc accepts; holds 128 rows of the default vocabulary in fp32
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """True where glibc took both settings; anywhere else (musl, macOS) nothing changes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("glibc malloc keeps freed memory: %s", applied)
    return applied
