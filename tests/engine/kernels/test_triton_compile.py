"""Every Triton kernel, as the engine launches it, compiles to a cubin for sm_80 (A100), sm_89 (L4, L40S) and sm_90
(H100, H200) on any machine, GPU or not: a kernel that would fail to build on a GPU fails here first. The compiler
runs in a child process without TRITON_INTERPRET, which the test session sets on machines without a GPU. Each is
compiled as triton's JIT would specialize it on those arguments (the GEMM in the 16-bit dtypes only: fp32 weights
keep cuBLAS, `engine/gemm_plan.py`), and the attention kernels must gather K/V from the
pool in 16-byte asynchronous copies, as they do once the JIT knows the pool's strides divide by 16."""
import json
import os
import re
import subprocess
import sys

import torch

from engine.gemm_plan import PLANNED_DTYPES
from engine.kernels.triton.launch import GPU_TARGETS

# (dtype, head_dim, query heads per KV head): every dtype, a padded head size, GQA groups of 1, 3 and 7. The padded
# size is 48 (D_PAD 64), not 80 (D_PAD 128): fp32's IEEE dots unroll into FMAs, and at D_PAD 128 its prefill kernels
# took 34 of a target's 54 s to build, against 11 s at 64
CASES = [("bfloat16", 128, 7), ("float16", 64, 1), ("float32", 48, 3)]
# kv_cache_dtype fp8: (cache dtype, query dtype, targets). triton compiles e4m3 for sm_89 on (the engine refuses it
# before that, tests/engine/test_attention_backend.py), e5m2 everywhere
FP8_CASES = [("float8_e4m3fn", "bfloat16", ("sm_89", "sm_90")), ("float8_e5m2", "float16", tuple(GPU_TARGETS))]
FP8_KERNELS = ("kv_write", "rotary_write_kv", "decode", "decode_split", "prefill")
GATHERS = ("decode", "decode_split", "prefill", "decode_shaped", "prefill_shaped")  # read K/V through block tables


def launches(dtype: torch.dtype, head_dim: int, group: int, cache_dtype: torch.dtype | None = None) -> dict:
    """The engine's launches on tensors of the right dtypes and shapes (tiny, never run); `cache_dtype`: the KV
    pool's, where it is not `dtype`."""
    from engine.kernels.triton.decode import decode_launches
    from engine.kernels.triton.fused_ops import add_rms_norm_launch, rotary_launch, silu_and_mul_launch
    from engine.kernels.triton.greedy import greedy_launches
    from engine.kernels.triton.nucleus import nucleus_threshold_launch
    from engine.kernels.triton.kv_write import write_kv_launch
    from engine.kernels.triton.matmul import Tiling, matmul_launches
    from engine.kernels.triton.prefill import prefill_launch
    from engine.layers.attention import ScoreShape

    kv_heads, batch = 2, 3
    cache = torch.zeros(kv_heads, 4, 16, head_dim, dtype=cache_dtype or dtype)
    query = torch.zeros(batch, kv_heads * group, head_dim, dtype=dtype)
    tables, lens = torch.zeros(batch, 2, dtype=torch.long), torch.ones(batch, dtype=torch.long)
    split = decode_launches(query, cache, cache, tables, lens, 0.1, 4, query)
    hidden = torch.zeros(batch, 12 * head_dim, dtype=dtype)  # a hidden size off powers of two
    qkv = torch.zeros(batch, (group + 2) * kv_heads * head_dim, dtype=dtype)
    table = torch.zeros(64, head_dim // 2)
    # a linear of the plan's tilings on 8 warps, split along K (`engine/gemm_plan.py` times them against cuBLAS)
    weight, projected = torch.zeros(head_dim, hidden.shape[1], dtype=dtype), torch.zeros(batch, head_dim, dtype=dtype)
    split_matmul = matmul_launches(hidden, weight, None, projected, Tiling(128, 128, 64, 2, 8, 3))
    return {
        "kv_write": write_kv_launch(cache, cache, query[:, :kv_heads], query[:, :kv_heads], lens),
        "decode": decode_launches(query, cache, cache, tables, lens, 0.1, 1, query)[0],
        "decode_split": split[0],
        "decode_merge": split[1],
        "prefill": prefill_launch(query, cache, cache, tables, torch.arange(batch + 1), lens, 1, 0.1, query),
        # the transformers fallback's Gemma 2/3 and Mistral layers: a sliding window, soft-capping
        "decode_shaped": decode_launches(query, cache, cache, tables, lens, 0.1, 1, query, shape=ScoreShape(16, 50.0))[0],
        "prefill_shaped": prefill_launch(query, cache, cache, tables, torch.arange(batch + 1), lens, 1, 0.1, query,
                                         shape=ScoreShape(16, 50.0)),
        "add_rms_norm": add_rms_norm_launch(hidden, hidden, hidden[0], hidden, hidden, 1e-6),
        "rms_norm": add_rms_norm_launch(hidden, None, hidden[0], hidden, hidden, 1e-6),
        "rotary": rotary_launch(qkv, lens, table, table, 0, (group + 1) * kv_heads, head_dim),
        "rotary_head_norms": rotary_launch(qkv, lens, table, table, group * kv_heads, kv_heads, head_dim,
                                           (qkv[0, :head_dim], qkv[0, :head_dim], 1e-6)),
        # the Triton ops' rotary that also writes K and V into the pool (Llama's layers on the Triton backend)
        "rotary_write_kv": rotary_launch(qkv, lens, table, table, group * kv_heads, kv_heads, head_dim,
                                         kv=(cache, cache, lens)),
        "matmul": matmul_launches(hidden, weight, weight[:, 0], projected, Tiling(64, 64, 128, 1))[0],
        "matmul_split": split_matmul[0],
        "matmul_sum": split_matmul[1],
        # the merged gate/up projection that writes SiLU(gate) * up, with the bias its halves may have
        "matmul_gated": matmul_launches(hidden, torch.cat([weight, weight]), weight[:, 0].repeat(2), projected,
                                        Tiling(64, 64, 128, 1, gated=True))[0],
        "silu_and_mul": silu_and_mul_launch(hidden, hidden[:, : hidden.shape[1] // 2]),
        "greedy_parts": greedy_launches(hidden, lens, -1)[0],
        "greedy_merge": greedy_launches(hidden, lens, -1)[1],
        "nucleus": nucleus_threshold_launch(hidden.float(), hidden[:, 0].float(), hidden[:, 0].float()),
    }


def compile_all(target_name: str) -> dict:
    """case/target/kernel -> cubin bytes, or the compiler's error."""
    results = {}
    for dtype, head_dim, group in CASES:
        for name, launch in launches(getattr(torch, dtype), head_dim, group).items():
            if name.startswith("matmul") and getattr(torch, dtype) not in PLANNED_DTYPES:
                continue  # never launched: fp32's matmuls were a fifth of the test's time
            # 16-bit K/V rows of a power-of-two head size: whole 16-byte pieces, so copied as such
            vectorised = name in GATHERS and dtype != "float32" and head_dim & (head_dim - 1) == 0
            results[f"{dtype}/hd{head_dim}/g{group}/{target_name}/{name}"] = _compile(launch, target_name, vectorised)
    for cache_dtype, dtype, targets in FP8_CASES:
        if target_name in targets:
            kernels = launches(getattr(torch, dtype), 128, 7, getattr(torch, cache_dtype))
            for name in FP8_KERNELS:
                results[f"{cache_dtype}/{dtype}/{target_name}/{name}"] = _compile(kernels[name], target_name)
    return results


def _compile(launch, target_name: str, vectorised: bool = False) -> int | str:
    """The cubin's size, or the compiler's error. `vectorised`: the PTX must copy global memory to shared in 16-byte
    asynchronous copies (cp.async, pipelined) and load no 2-byte element on its own."""
    try:
        compiled = launch.compile_for(GPU_TARGETS[target_name])
        ptx = compiled.asm["ptx"]
        assert f".target {target_name}" in ptx, "PTX for another target"
        if vectorised:
            assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx), "no 16-byte cp.async"
            assert not re.search(r"ld\.global\.\S*b16", ptx), "2-byte global loads"
        return len(compiled.asm["cubin"])
    except Exception as error:  # reported whole, by the test below
        return f"{type(error).__name__}: {error}"


def test_every_kernel_compiles_for_the_gpu_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compilers = [subprocess.Popen([sys.executable, __file__, target], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for target in GPU_TARGETS]  # one a target, at once
    results = {}
    for compiler in compilers:
        stdout, stderr = compiler.communicate(timeout=300)
        assert compiler.returncode == 0, stderr[-3000:]
        results.update(json.loads(stdout.splitlines()[-1]))
    fp8 = sum(len(targets) for _, _, targets in FP8_CASES) * len(FP8_KERNELS)
    gemms = sum(getattr(torch, dtype) in PLANNED_DTYPES for dtype, _, _ in CASES) * 4
    assert len(results) == (len(CASES) * 16 + gemms) * len(GPU_TARGETS) + fp8
    failed = {key: value for key, value in results.items() if not isinstance(value, int) or value < 1000}
    assert not failed, failed


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    print(json.dumps(compile_all(sys.argv[1])))
