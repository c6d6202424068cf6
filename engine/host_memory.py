"""Host memory for a CPU step: freed blocks kept in the process, and 2 MB pages where the kernel gives them.

By default glibc returns big blocks (the logits, the sampler's float copy) to the kernel on free, and every step
then pays page faults to get them back: about 10% of a CPU step (benchmarks/step_time.py, BENCHMARKS.md).

A step reads every weight and much of the KV pool; on 4 KB pages that is a TLB miss every 4 KB. Where transparent
huge pages are `madvise` only (the common default), memory takes 2 MB pages only when asked before it is touched:
the pool is asked here; the heap (weights, per-step tensors) only through glibc's tunable, read at process start,
so the engine core's child process is started with it (BENCHMARKS.md, 2026-11-25: a batch-48 step 5% faster).

On CUDA, the step's small host tensors go up through pinned memory (`to_device`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the core's client spawns the core before the front end imports torch
    import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest value older glibc accepts; holds 128 rows of the default vocabulary in fp32
TRIM_THRESHOLD = 1 << 30
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
HEAP_ON_HUGE_PAGES = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) on every heap extension


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def keep_freed_memory() -> bool:
    """True where glibc took both settings; anywhere else (musl, macOS) nothing changes."""
    try:
        libc = _libc()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("glibc malloc keeps freed memory: %s", applied)
    return applied


def with_huge_page_heap(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child process whose heap glibc backs with huge pages; other tunables are kept."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    return {**env, "GLIBC_TUNABLES": ":".join(tunables + [HEAP_ON_HUGE_PAGES])}


def heap_on_huge_pages() -> bool:
    """Whether this process was started with the tunable (glibc reads it once, at start)."""
    return HEAP_ON_HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "").split(":")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for it: through pinned memory on CUDA, where a copy from pageable
    memory waits for all work queued before it (with async scheduling, the step in flight)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def ask_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for 2 MB pages under a CPU tensor not yet touched (torch.empty); the whole 2 MB pages inside it only."""
    if tensor.device.type != "cpu":
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        madvise = _libc().madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, MADV_HUGEPAGE) == 0  # EINVAL where THP is compiled out: 4 KB pages, as before
