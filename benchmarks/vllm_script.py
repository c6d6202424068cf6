"""A peer script run in vLLM's CPU virtualenv as a subprocess: its inputs go to it as a JSON file, its answer comes
back as the JSON of its last `RESULT ` line. Used by bench.py and long_prefill.py."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path


def run_vllm_script(python: Path, script: str, model_dir: str, inputs, extra_args: list[str], threads: int):
    """`python benchmarks/<script> MODEL_DIR INPUTS_JSON *extra_args` on `threads` cores; raises if it fails."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    path = Path(__file__).with_name(script)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(inputs, f)
        f.flush()
        proc = subprocess.run([str(python), str(path), model_dir, f.name, *extra_args], env=env, stdout=subprocess.PIPE,
                              text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM peer failed (exit {proc.returncode}); run it by hand: {python} {path}")
    return json.loads(lines[-1][len("RESULT "):])
