"""Host memory on CPU: the KV pool asks for 2 MB pages before it is touched, and the engine core's child process
starts with glibc's heap on huge pages, other tunables kept."""
from pathlib import Path

import pytest

from engine.host_memory import HEAP_ON_HUGE_PAGES, with_huge_page_heap

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_bytes_under(start: int, length: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, start + length)."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            overlaps = low < start + length and high > start
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_child_heap_on_huge_pages_keeps_the_other_tunables():
    env = with_huge_page_heap({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"})
    assert env["PATH"] == "/bin"
    assert env["GLIBC_TUNABLES"].split(":") == ["glibc.malloc.arena_max=2", HEAP_ON_HUGE_PAGES]
    assert with_huge_page_heap({})["GLIBC_TUNABLES"] == HEAP_ON_HUGE_PAGES
    assert with_huge_page_heap(env) == env


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="the kernel gives no huge pages")
def test_the_kv_pool_sits_on_huge_pages(llm32):
    pool = llm32.engine.runner.kv_cache
    size = pool.numel() * pool.element_size()
    assert size > 64 << 20
    assert huge_bytes_under(pool.data_ptr(), size) > size // 2
