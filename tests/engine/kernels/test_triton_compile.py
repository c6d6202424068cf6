"""Every Triton kernel, as the engine launches it, compiles to a cubin for sm_80 (A100), sm_89 (L4, L40S) and sm_90
(H100, H200) on any machine, GPU or not: a kernel that would fail to build on a GPU fails here first. The compiler
runs in a child process without TRITON_INTERPRET, which the test session sets on machines without a GPU."""
import json
import os
import subprocess
import sys

import torch

from engine.kernels.triton.launch import GPU_TARGETS

# (dtype, head_dim, query heads per KV head): every dtype, a padded head size, GQA groups of 1, 3 and 7
CASES = [("bfloat16", 128, 7), ("float16", 64, 1), ("float32", 80, 3)]


def launches(dtype: torch.dtype, head_dim: int, group: int) -> dict:
    """The engine's launches on tensors of the right dtypes and shapes (tiny, never run)."""
    from engine.kernels.triton.decode import decode_launches
    from engine.kernels.triton.fused_ops import add_rms_norm_launch, rotary_launch, silu_and_mul_launch
    from engine.kernels.triton.greedy import greedy_launches
    from engine.kernels.triton.nucleus import nucleus_threshold_launch
    from engine.kernels.triton.kv_write import write_kv_launch
    from engine.kernels.triton.prefill import prefill_launch

    kv_heads, batch = 2, 3
    cache = torch.zeros(kv_heads, 4, 16, head_dim, dtype=dtype)
    query = torch.zeros(batch, kv_heads * group, head_dim, dtype=dtype)
    tables, lens = torch.zeros(batch, 2, dtype=torch.long), torch.ones(batch, dtype=torch.long)
    split = decode_launches(query, cache, cache, tables, lens, 0.1, 4, query)
    hidden = torch.zeros(batch, 12 * head_dim, dtype=dtype)  # a hidden size off powers of two
    qkv = torch.zeros(batch, (group + 2) * kv_heads * head_dim, dtype=dtype)
    table = torch.zeros(64, head_dim // 2)
    return {
        "kv_write": write_kv_launch(cache, cache, query[:, :kv_heads], query[:, :kv_heads], lens),
        "decode": decode_launches(query, cache, cache, tables, lens, 0.1, 1, query)[0],
        "decode_split": split[0],
        "decode_merge": split[1],
        "prefill": prefill_launch(query, cache, cache, tables, torch.arange(batch + 1), lens, 1, 0.1, query),
        "add_rms_norm": add_rms_norm_launch(hidden, hidden, hidden[0], hidden, hidden, 1e-6),
        "rms_norm": add_rms_norm_launch(hidden, None, hidden[0], hidden, hidden, 1e-6),
        "rotary": rotary_launch(qkv, lens, table, table, (group + 1) * kv_heads, head_dim),
        "silu_and_mul": silu_and_mul_launch(hidden, hidden[:, : hidden.shape[1] // 2]),
        "greedy_parts": greedy_launches(hidden, lens, -1)[0],
        "greedy_merge": greedy_launches(hidden, lens, -1)[1],
        "nucleus": nucleus_threshold_launch(hidden.float(), hidden[:, 0].float(), hidden[:, 0].float()),
    }


def compile_all(target_name: str) -> dict:
    """case/target/kernel -> cubin bytes, or the compiler's error."""
    results, target = {}, GPU_TARGETS[target_name]
    for dtype, head_dim, group in CASES:
        for name, launch in launches(getattr(torch, dtype), head_dim, group).items():
            key = f"{dtype}/hd{head_dim}/g{group}/{target_name}/{name}"
            try:
                compiled = launch.compile_for(target)
                assert f".target {target_name}" in compiled.asm["ptx"], "PTX for another target"
                results[key] = len(compiled.asm["cubin"])
            except Exception as error:  # reported whole, by the test below
                results[key] = f"{type(error).__name__}: {error}"
    return results


def test_every_kernel_compiles_for_the_gpu_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compilers = [subprocess.Popen([sys.executable, __file__, target], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for target in GPU_TARGETS]  # one a target, at once
    results = {}
    for compiler in compilers:
        stdout, stderr = compiler.communicate(timeout=300)
        assert compiler.returncode == 0, stderr[-3000:]
        results.update(json.loads(stdout.splitlines()[-1]))
    assert len(results) == len(CASES) * 12 * len(GPU_TARGETS)
    failed = {key: value for key, value in results.items() if not isinstance(value, int) or value < 1000}
    assert not failed, failed


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    print(json.dumps(compile_all(sys.argv[1])))
