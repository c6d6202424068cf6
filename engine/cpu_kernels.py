"""The optional C++ decode-attention kernel for CPU, compiled once on first use and cached by torch.

Everything works without it: where it cannot be built, attention falls back to the device-agnostic torch path.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def paged_decode_op():
    """The compiled `paged_decode` function, or None where no compiler is at hand."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="engine_paged_attention_cpu",
            cpp_sources=SOURCE.read_text(),
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp", "-lmvec"],
            verbose=False,
        )
        return module.paged_decode
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        log.warning("C++ paged attention unavailable (%s); using the torch path", exc)
        return None
