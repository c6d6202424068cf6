"""The C++ CPU kernels (decode attention; bf16 prefill attention on AVX512-BF16; matmuls over GGUF blocks; fused
per-layer ops; every decoder layer of a decode step in one call; top-p's threshold; greedy picks), compiled once on
first use into one module and cached by torch.

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

from engine.extension_build import load_inline_locked

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "csrc"


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


# One translation unit, in this order: the decoder (last) calls the others' kernels directly.
UNIT = ("python_bindings.h", "release_gil.h", "fused_ops_cpu.cpp", "nucleus_cpu.cpp", "paged_attention_cpu.cpp",
        "prefill_attention_cpu.cpp", "prefill_attention_amx.cpp", "quantized_matmul_cpu.cpp",
        "interleaved_matmul_cpu.cpp", "decode_region_cpu.cpp", "decoder_cpu.cpp", "greedy_cpu.cpp")
FUNCTIONS = ["add_rms_norm", "rotary_inplace", "silu_and_mul", "write_kv", "paged_decode", "paged_prefill",
             "paged_prefill_batch", "has_bf16_prefill", "paged_prefill_amx", "paged_prefill_amx_batch",
             "has_amx_prefill", "q4_matmul", "q8_matmul", "interleaved_rows", "decode_layers", "nucleus_mask_",
             "greedy_or_invalid_cpu"]
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
LDFLAGS = ("-fopenmp", "-lmvec")
# extra_cflags that switch wider ISAs off, for the paths other CPUs take (tests, benchmarks/tree_kernels.py)
ISA_VARIANTS = {"avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2")}


def kernels_name(extra_cflags: tuple[str, ...] = ()) -> str:
    """The extension's name, one per CPU feature set and variant: its build folder's."""
    variant = hashlib.blake2b(" ".join(extra_cflags).encode(), digest_size=3).hexdigest() if extra_cflags else ""
    return f"engine_cpu_kernels_{cpu_features_tag()}{variant}"


@functools.cache
def build_kernels(extra_cflags: tuple[str, ...] = ()):
    """The compiled module of every kernel; raises KernelBuildError where there is no compiler or the build fails.
    extra_cflags (tests) builds a variant under its own name, e.g. `-mno-avx512f` for the AVX2 paths on an AVX-512 CPU."""
    if not have_compiler():
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    try:
        return load_inline_locked(
            name=kernels_name(extra_cflags),
            cpp_sources=[(SOURCES / name).read_text() for name in UNIT],
            functions=FUNCTIONS,
            extra_cflags=[*CFLAGS, *extra_cflags],
            extra_ldflags=list(LDFLAGS),
            verbose=False,
            no_implicit_headers=True,  # the unit includes what it uses (csrc/python_bindings.h), not torch/extension.h
        )
    except Exception as exc:
        raise KernelBuildError(f"the C++ kernels in {SOURCES} failed to build: {exc}") from exc


def build_paged_decode():
    """The compiled `paged_decode` function."""
    return build_kernels().paged_decode


def build_block_matmul(extra_cflags: tuple[str, ...] = ()):
    """The compiled module with `q4_matmul` and `q8_matmul` (GGUF block weights)."""
    return build_kernels(extra_cflags)


def build_fused_ops():
    """The compiled module with `add_rms_norm`, `rotary_inplace`, `silu_and_mul`, `write_kv` and `decode_layers`."""
    return build_kernels()


def fused_ops():
    """The fused per-layer ops, or None (logged) where they are unavailable: the layers then use torch ops."""
    return _built_or_none(build_fused_ops, "fused CPU ops", "torch ops")


def paged_decode_op():
    """The kernel, or None (logged) where it is unavailable: what attention_backend='auto' uses."""
    return _built_or_none(build_paged_decode, "C++ paged attention", "the torch path")


def nucleus_mask_op():
    """Top-p in place (csrc/nucleus_cpu.cpp: each row's threshold, and what is below it zeroed), or None (logged)
    where the kernels do not build: the sampler then takes its torch tiers."""
    kernels = _built_or_none(build_kernels, "C++ top-p", "torch's topk tiers")
    return kernels.nucleus_mask_ if kernels is not None else None


def greedy_op():
    """Greedy rows' tokens in one pass (csrc/greedy_cpu.cpp: argmax, or the invalid id for a row not finite), or None
    (logged) where the kernels do not build: the sampler then takes torch's max and amin."""
    kernels = _built_or_none(build_kernels, "C++ greedy", "torch's reductions")
    return kernels.greedy_or_invalid_cpu if kernels is not None else None


def paged_prefill_op(dtype, head_dim: int, block_size: int, pool_dtype=None):
    """The bf16 prefill kernel where the model and pool fit it, taking all of a step's chunks in one call
    (`paged_prefill_batch`'s arguments): on AMX tiles where the CPU has them and Linux grants them (4-5x the
    AVX512-BF16 kernel there, which ran at half of SDPA's speed on those CPUs), else on AVX512-BF16, else None (SDPA).
    `pool_dtype` (the model's where None): an fp8 pool (kv_cache_dtype) only the AMX kernel reads."""
    import torch

    if dtype != torch.bfloat16 or head_dim not in (64, 128) or block_size % 16:
        return None
    kernels = _built_or_none(build_kernels, "C++ prefill attention", "SDPA")
    if kernels is None or not kernels.has_bf16_prefill():
        return None
    if kernels.has_amx_prefill():
        return kernels.paged_prefill_amx_batch
    return kernels.paged_prefill_batch if pool_dtype in (None, dtype) else None


def _built_or_none(build, what: str, fallback: str):
    try:
        return build()
    except KernelBuildError as exc:
        log.warning("%s unavailable (%s); using %s", what, exc, fallback)
        return None
