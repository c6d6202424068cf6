"""`make gpu-check` runs end to end on CPU at toy sizes (the Triton kernels under triton's interpreter), so what
reaches a GPU machine has run; and what travels there (the tree plus `make gpu-wheels`) fits its 64 MiB copy."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_wheels import WHEEL_RECORD

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DEVICE_COPY_LIMIT = 64 << 20


def test_the_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failures"] == [] and report["tests"]["exit"] == 0, report
    assert "2 passed" in report["tests"]["summary"]
    assert report["settings"]["attention_backend"] == "triton"
    for mode in ("eager", "graphs", "graphs_async", "graphs_sampled", "graphs_sampled_async"):
        assert [row["batch"] for row in report["decode"][mode]] == ([4] if "sampled" in mode else [1, 4])
        # async: after the warm steps, one step is in flight when the clock starts and one when it stops
        assert all(row["tokens"] == row["batch"] * 4 and row["tok_s"] > 0 for row in report["decode"][mode])
        assert all(row["steps_ahead"] == (4 if mode.endswith("async") else 0) for row in report["decode"][mode]), \
            "every timed step flies with async scheduling, top-p sampled ones too"
    assert report["engine_static"]["tokens"] == report["engine_static_async"]["tokens"] == report["hf_static"]["tokens"] == 4 * 8
    static, static_async = report["engine_static"], report["engine_static_async"]
    assert static["num_steps"] >= 8 and static["num_steps_ahead"] == 0 < static_async["num_steps_ahead"]
    assert static["phases_s"]["forward"] > 0 and static_async["phases_s"]["forward"] > 0
    assert report["prefill"]["tokens"] == 256 and report["kv"]["blocks"] == 256
    assert len(report["attention_kernels"]) == 13
    profiles = report["step_profile"]
    assert [(p["batch"], p["async_scheduling"]) for p in profiles] == [(4, False), (4, True)]
    assert all(p["step_ms"] > 0 and p["phases_ms"]["forward"] > 0 for p in profiles)
    assert (tmp_path / "profile-4-async.txt").read_text().startswith("batch 4, graphs + async scheduling:")
    assert set(report["goals"]) == {"engine_10x_hf_static", "decode_50pct_roofline", "graphs_1_5x_eager_batch_1"}
    assert "all checks passed" in (tmp_path / "gpu_check.log").read_text()


def test_the_step_profile_runs_on_cpu(tmp_path):
    """benchmarks/gpu_step_profile.py, which a GPU session runs after the check, with async scheduling on."""
    run = subprocess.run([sys.executable, "gpu_step_profile.py", "--device", "cpu", "--batch", "4", "--steps", "2",
                          "--async-scheduling", "--out", str(tmp_path)], cwd=ROOT / "benchmarks", capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = (tmp_path / "profile-4-async.txt").read_text()
    assert report.startswith("batch 4, graphs + async scheduling:") and "top by host time" in report


def test_the_tree_and_its_gpu_wheels_fit_the_device_copy():
    """What `make gpu-wheels` downloads, plus every file git would send (tracked and untracked, not ignored)."""
    make = subprocess.run(["make", "-s", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, make.stderr[-2000:]
    wheels = ROOT / ".whl"
    names = {p.name.split("-")[0].lower() for p in wheels.glob("*.whl")}
    assert {"pydantic", "pydantic_core", "msgspec", "pyzmq", "llguidance", "bitsandbytes", "ray", "fastapi", "uvicorn",
            "opencensus"} <= names, names
    for name, kept, dropped in (("ray", "ray/_raylet.so", "ray/jars/"), ("bitsandbytes", "cuda130.so", "cuda128.so")):
        with zipfile.ZipFile(next(wheels.glob(f"{name}-*.whl"))) as wheel:
            members = set(wheel.namelist())
            record = next(m for m in members if WHEEL_RECORD.match(m))
            listed = {line.split(",")[0] for line in wheel.read(record).decode().splitlines() if line}
        assert any(m.endswith(kept) for m in members) and not any(dropped in m for m in members), name
        assert listed == members, f"{name}: RECORD lists {sorted(listed ^ members)[:5]}, the wheel holds otherwise"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    tree = sum((ROOT / f).stat().st_size for f in files if (ROOT / f).is_file())
    shipped = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    assert tree + shipped < DEVICE_COPY_LIMIT, f"tree {tree >> 20} MiB + wheels {shipped >> 20} MiB"


def test_the_attention_kernel_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "kernels.json"
    run = subprocess.run([sys.executable, "benchmarks/triton_attention.py", "--device", "cpu", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["decode"] * 4 + ["prefill"] + ["greedy (triton)", "greedy (torch)"] * 2 + [
        "top-p (triton)", "top-p (candidates)"] * 2
    assert all(r["us"] > 0 for r in rows)
    assert {r["splits"] for r in rows} == {1, 2}, "the split-K path ran"
    tilings = json.loads(out.read_text())["tilings"]
    assert [(r["kind"], r["tiling"]) for r in tilings] == [
        ("prefill tiling", "default"), ("prefill tiling", "rows=128 tile=128 warps=8 stages=2"),
        ("decode tiling", "default"), ("decode tiling", "tile=32"), ("decode tiling", "tile=128")]
    assert all(r["us"] > 0 and r["matches_default"] for r in tilings), tilings


def test_a_failed_stage_is_reported_and_the_check_goes_on(tmp_path):
    """A stage that raises (a CUDA error part way through the measurements) becomes one failure, its traceback in the
    log; the stages after it still run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    log = gpu_check.Log(tmp_path / "gpu_check.log")

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert gpu_check._stage(log, "measurements", broken) == [
        "measurements: RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert gpu_check._stage(log, "tests", lambda: ["one check failed"]) == ["one check failed"]
    assert gpu_check._stage(log, "sweep", lambda: None) == []
    assert "measurements failed:\nTraceback" in (tmp_path / "gpu_check.log").read_text()
