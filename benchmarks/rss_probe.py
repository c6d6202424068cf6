"""Where a serving run's resident memory goes: the engine alone on the load-test mix (benchmarks/closed_loop.py's
loop) at a few users, RSS and live Python objects every 30 s, then what glibc's malloc_trim gives back.
Run it twice, the second time with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0, to see oneDNN's primitive cache.

python benchmarks/rss_probe.py --users 6 --seconds 420
"""
from __future__ import annotations

import ctypes
import gc
import os
import time

import typer

from closed_loop import ClosedLoop

cli = typer.Typer(add_completion=False)


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@cli.command()
def main(users: int = 6, seconds: float = 420, every: float = 30, threads: int = 1):
    loop = ClosedLoop(threads=threads, users=users)
    start = last = time.time()
    done = 0
    print(f"start: {rss_mib():.0f} MiB resident, {len(gc.get_objects())} objects", flush=True)
    while time.time() - start < seconds:
        done += loop.step()
        if time.time() - last > every:
            last = time.time()
            print(f"{last - start:5.0f} s: {done} done, {rss_mib():.0f} MiB resident, {len(gc.get_objects())} objects",
                  flush=True)
    before = rss_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"malloc_trim: {before:.0f} -> {rss_mib():.0f} MiB", flush=True)


if __name__ == "__main__":
    cli()
