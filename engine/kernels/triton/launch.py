"""A kernel launch as data: the kernel, its grid, its arguments and compile-time constants. `run()` launches it;
`compile_for(target)` builds the same launch for a GPU architecture on any machine, GPU or not, which is how every
machine checks that the kernels compile for sm_80, sm_89 and sm_90 (`tests/engine/kernels/test_triton_compile.py`).
Compiling needs a process without triton's interpreter, which swaps triton.language's own helpers for Python.

It compiles what triton's JIT would build for the same arguments on that GPU: the JIT specializes pointers aligned to
16 bytes and integers divisible by 16 (or equal to 1), and only with those facts does it vectorise loads into 16-byte
copies and pipeline them (cp.async). Compiled without them the prefill kernel's K/V gather was scalar 2-byte loads."""
from __future__ import annotations

from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

GPU_TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_89": GPUTarget("cuda", 89, 32), "sm_90": GPUTarget("cuda", 90, 32)}


@dataclass
class Launch:
    kernel: object  # a @triton.jit function (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)  # num_warps, num_stages: triton's defaults where absent

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)

    def compile_for(self, target: GPUTarget):
        """The compiled kernel (its `.asm` holds the PTX and cubin) for `target`, specialized on the arguments as
        `JITFunction.run` specializes them (its own binder and `_pack_args`); raises on any compile error."""
        fn = self.kernel
        if not isinstance(fn, JITFunction):
            raise RuntimeError("triton's interpreter is on (TRITON_INTERPRET=1): compile in a process without it")
        backend = make_backend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*self.args, **self.constexprs, **self.options)
        options, signature, constexprs, attrs = fn._pack_args(backend, dict(self.options), bound, specialization,
                                                              options)
        return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
