"""The C++ kernel builds the tests use: the native one and the ISA variants whose code differs from it.

`python -m tests.engine.kernel_builds` builds the native one ahead of the suite: `make test` starts it in the background
once torch is installed, beside the model's conversion, Prometheus' install and pytest's collection, which otherwise
waits on that one compiler process (a module's skip condition asks for it) with the other core idle. A test asking
for a build still in progress waits on torch's build lock and loads the result. The variants stay on demand: built in
the background they took both cores from the suite's first tests for longer than the tests wait on them."""
from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.cpu_kernels import ISA_VARIANTS, build_kernels


def isa_flags(isa: str) -> tuple[str, ...]:
    """build_kernels' flags for "native" or an ISA_VARIANTS key. On a CPU whose best is AVX2 the native build already
    is the AVX2 path: a second build of the same code takes about 48 s on a 2-core AVX2 VM."""
    if isa == "native" or (isa == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2"):
        return ()
    return ISA_VARIANTS[isa]


# the variants whose code differs from the native build (none of AVX2's where the CPU's best is AVX2)
BUILT_ELSEWHERE = [isa for isa in ISA_VARIANTS if isa_flags(isa)]


def kernels_for(isa: str):
    """The C++ kernels built for "native" or an ISA_VARIANTS key. The first variant asked for builds them all at once:
    a build is one compiler process (about 35 s cold), so on two cores both variants take the time of one."""
    return build_kernels() if not isa_flags(isa) else _variants()[isa]


@functools.cache
def _variants() -> dict:
    with ThreadPoolExecutor(len(BUILT_ELSEWHERE)) as pool:
        return dict(zip(BUILT_ELSEWHERE, pool.map(lambda isa: build_kernels(ISA_VARIANTS[isa]), BUILT_ELSEWHERE)))


def main() -> None:
    started = time.monotonic()
    build_kernels()
    print(f"C++ kernels, native: ready in {time.monotonic() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
