"""The C++ decode-attention kernel for CPU, compiled once on first use and cached by torch.

Without a C++ compiler, attention falls back to the device-agnostic torch path. With one, a failed build is an
error (`build_paged_decode` raises), so a broken kernel can never pass for a missing compiler.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


class KernelBuildError(RuntimeError):
    """A C++ compiler is present, but the kernel did not build."""


def have_compiler() -> bool:
    return shutil.which(os.environ.get("CXX") or "c++") is not None


def cpu_features_tag() -> str:
    """Built with -march=native, a binary from one CPU may not run on another (SIGILL): the cache is per feature set."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.blake2b(" ".join(sorted(flags.split())).encode(), digest_size=6).hexdigest()


@functools.cache
def build_paged_decode():
    """The compiled `paged_decode` function; raises KernelBuildError where there is no compiler or the build fails."""
    if not have_compiler():
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    from torch.utils.cpp_extension import load_inline

    try:
        module = load_inline(
            name=f"engine_paged_attention_cpu_{cpu_features_tag()}",
            cpp_sources=SOURCE.read_text(),
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp", "-lmvec"],
            verbose=False,
        )
    except Exception as exc:
        raise KernelBuildError(f"the C++ paged attention kernel failed to build: {exc}") from exc
    return module.paged_decode


def paged_decode_op():
    """The kernel, or None (logged) where it is unavailable: what attention_backend='auto' uses."""
    try:
        return build_paged_decode()
    except KernelBuildError as exc:
        log.warning("C++ paged attention unavailable (%s); using the torch path", exc)
        return None
