"""The C++ kernels of any source tree (e.g. a `git worktree` at an older commit) and ISA build, each its own module,
so benchmarks time two trees or ISAs alternated in one process (a VM's speed drifts between processes more than the
kernels differ). This tree's native build is the engine's own cached module."""
from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable
from pathlib import Path

from engine.cpu_kernels import CFLAGS, ISA_VARIANTS, LDFLAGS, UNIT, build_kernels

ROOT = Path(__file__).resolve().parents[1]
ISA_FLAGS = {"native": (), **ISA_VARIANTS}


def build_tree_kernels(tree: Path, isa: str, functions: list[str]):
    """The module of `tree`'s kernels built for `isa` (a key of ISA_FLAGS), binding `functions`."""
    if tree.resolve() == ROOT and isa == "native":
        return build_kernels()
    from engine.extension_build import load_inline_locked

    sources = [(tree / "engine" / "csrc" / name).read_text() for name in UNIT]
    tag = hashlib.blake2b(f"{tree.resolve()} {isa} {functions}".encode(), digest_size=4).hexdigest()
    return load_inline_locked(name=f"tree_kernels_{tag}", cpp_sources=sources, functions=functions,
                              extra_cflags=[*CFLAGS, *ISA_FLAGS[isa]], extra_ldflags=list(LDFLAGS),
                              no_implicit_headers=True)


def alternated_medians(timers: dict[object, Callable[[], float]], rounds: int, warm: int) -> dict[object, float]:
    """Each timer (key -> a call returning its elapsed time) run once a round, all alternated, for `warm` untimed
    rounds and then `rounds` timed ones -> key -> the median of its timed rounds."""
    times = {key: [] for key in timers}
    for round_ in range(warm + rounds):
        for key, timer in timers.items():
            elapsed = timer()
            if round_ >= warm:
                times[key].append(elapsed)
    return {key: statistics.median(v) for key, v in times.items()}
