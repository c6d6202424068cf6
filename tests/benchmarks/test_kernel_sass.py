"""`benchmarks/kernel_sass.py` at a toy size: the attention kernels and top-p compiled for sm_90 as triton's JIT
specializes them, read back from their machine code. What it pins is how they are built, which no CPU test can time:
no spills, K/V gathered in 16-byte asynchronous copies, the prefill's causal mask paid only on the tiles that need it
(a shorter loop for the tiles every row sees whole, with the same tensor-core work), and top-p's passes free of
per-load reductions."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_attention_kernels_compile_to_vectorised_unspilled_loops(tmp_path):
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "benchmarks/kernel_sass.py", "--prompt", "256", "--batch", "4", "--out", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    kernels = json.loads(out.read_text())["kernels"]
    for profile in kernels.values():
        assert profile["spill_instructions"] == 0 and profile["registers"] <= 255
    for attention in ("prefill", "decode"):
        profile = kernels[attention]
        assert profile["global_loads"].get("LDGSTS.E.BYPASS.128", 0) > 0  # 16-byte cp.async
        assert not any(".U16" in op for op in profile["global_loads"])  # no 2-byte element loaded alone
    # top-p's passes over the row sum each probe's mass across the lanes once a pass, not once per load
    # (the innermost loop that selects each probe's values, FSEL; the max pass before it selects nothing)
    mass_loop = min((loop for loop in kernels["nucleus"]["loops"] if loop["top"].get("FSEL")),
                    key=lambda loop: loop["instructions"])
    assert mass_loop["shuffles"] == 0 and mass_loop["instructions"] < 300, mass_loop
    whole, masked = kernels["prefill"]["loops"]
    assert whole["tensor_ops"] == masked["tensor_ops"] > 0
    assert whole["instructions"] < 0.8 * masked["instructions"]
    assert kernels["prefill"]["tiling"]["BLOCK_Q"] == 10  # Qwen's group of 6, packed into 64 rows
