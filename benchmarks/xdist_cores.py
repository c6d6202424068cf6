"""A pytest plugin for `make gpu-check`: `-p benchmarks.xdist_cores` gives each pytest-xdist worker its own share of
the machine's cores. An engine runs one torch thread per core it may run on (`EngineConfig.resolved_num_threads`
reads the affinity mask), so N workers sharing every core start N times too many OpenMP threads, and OpenMP's
barriers make an oversubscribed CPU step far slower than N-fold (design.md's pitfalls: two torch processes on 2
cores). The GPU list holds CPU cases too (torch and C++ parity, the HF references): on the H200, 8 unpinned workers
(16 threads each, on 16 cores) ran out of the check's budget, the first suspect for why."""
from __future__ import annotations

import os
import sys


def pytest_configure(config):
    worker = getattr(config, "workerinput", None)  # set in xdist's workers only
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = share(sorted(os.sched_getaffinity(0)), int(worker["workerid"].removeprefix("gw")), worker["workercount"])
    os.sched_setaffinity(0, cores)
    if "torch" in sys.modules:  # OpenMP counted the cores when it loaded: tell it again
        sys.modules["torch"].set_num_threads(len(cores))


def share(cores: list[int], index: int, count: int) -> list[int]:
    """Worker `index`'s cores of `cores`, split in `count` contiguous runs (a worker started again in place of a lost
    one may have a higher index: it takes the share of index mod count)."""
    per = max(1, len(cores) // count)
    start = (index % count) * per % len(cores)
    return cores[start : start + per]
