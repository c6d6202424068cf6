"""A kernel launch as data: the kernel, its grid, its arguments and compile-time constants. `run()` launches it;
`compile_for(target)` builds the same launch for a GPU architecture on any machine, GPU or not, which is how every
machine checks that the kernels compile for sm_80, sm_89 and sm_90 (`tests/engine/kernels/test_triton_compile.py`).
Compiling needs a process without triton's interpreter, which swaps triton.language's own helpers for Python."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

GPU_TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_89": GPUTarget("cuda", 89, 32), "sm_90": GPUTarget("cuda", 90, 32)}
_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
                  torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


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
        """The compiled kernel (its `.asm` holds the PTX and cubin) for `target`; raises on any compile error."""
        fn = self.kernel
        if not isinstance(fn, JITFunction):
            raise RuntimeError("triton's interpreter is on (TRITON_INTERPRET=1): compile in a process without it")
        runtime_names = [name for name in fn.arg_names if name not in self.constexprs]
        signature = dict(zip(runtime_names, map(_type_of, self.args)))
        signature.update({name: "constexpr" for name in self.constexprs})
        return triton.compile(ASTSource(fn, signature, self.constexprs), target=target, options=self.options or None)


def _type_of(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return _POINTER_TYPES[arg.dtype]
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, int):
        return "i32" if -(2**31) <= arg < 2**31 else "i64"
    return "fp32"
