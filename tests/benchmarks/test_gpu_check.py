"""`make gpu-check` runs end to end on CPU at toy sizes (the Triton kernels under triton's interpreter), so what
reaches a GPU machine has run; and the tree leaves `make gpu-wheels` room in the 64 MiB copy it travels in."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_wheels import DEVICE_COPY_LIMIT, WHEEL_RECORD, WHEELS_BUDGET, misfit, tree_bytes
from benchmarks.gpu_wheels import main as gpu_wheels
from benchmarks.xdist_cores import share
from tests.processes import alive

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failures"] == [] and report["tests"]["exit"] == 0, report
    assert "4 passed" in report["tests"]["summary"]  # the mixed step: fp32, bf16 and two fp8 pools
    assert report["settings"]["attention_backend"] == "triton"
    for mode in ("eager", "graphs", "graphs_async", "graphs_sampled", "graphs_sampled_async"):
        assert [row["batch"] for row in report["decode"][mode]] == ([4] if "sampled" in mode else [1, 4])
        # async: after the warm steps, one step is in flight when the clock starts and one when it stops
        assert all(row["tokens"] == row["batch"] * 4 and row["tok_s"] > 0 for row in report["decode"][mode])
        assert all(row["steps_ahead"] == (4 if mode.endswith("async") else 0) for row in report["decode"][mode]), \
            "every timed step flies with async scheduling, top-p sampled ones too"
        # each step ahead over the same rows advances the graphs' buffers on the device (sampled rows too)
        assert all(row["steps_advanced"] == (4 if mode.startswith("graphs") and mode.endswith("async") else 0)
                   for row in report["decode"][mode]), report["decode"][mode]
        assert all(0 <= row["gc_ms"] < 1e3 * row["tokens"] / row["tok_s"] for row in report["decode"][mode])  # in the window
        assert all(0 < row["front_end_ms"] < row["step_ms"] for row in report["decode"][mode])
    served = report["decode"]["graphs_async_process"]  # the core in its own process, stepping on its own
    assert [row["batch"] for row in served] == [4] and served[0]["steps"] >= 4 and served[0]["tok_s"] > 0, served
    assert served[0]["tokens"] == 4 * served[0]["steps"] and served[0]["steps_ahead"] > 0, served
    # the phases come with the core's step counts, the step time from the front end's clock between two snapshots: the
    # windows differ by a snapshot's delivery, so on a CPU, where the forward is nearly the whole step, the forward a
    # step may read a few hundredths of a ms over the step (231.776 against 231.716 in one CI run)
    assert 0 < served[0]["phases_ms"]["forward"] < 1.05 * served[0]["step_ms"], served
    assert report["goals"]["decode_50pct_roofline"]["core_process_tok_s"] == served[0]["tok_s"]
    assert report["engine_static"]["tokens"] == report["engine_static_async"]["tokens"] == report["hf_static"]["tokens"] == 4 * 8
    static, static_async = report["engine_static"], report["engine_static_async"]
    assert static["num_steps"] >= 8 and static["num_steps_ahead"] == 0 < static_async["num_steps_ahead"]
    assert static["phases_s"]["forward"] > 0 and static_async["phases_s"]["forward"] > 0
    assert report["prefill"]["tokens"] == 256 and report["kv"]["blocks"] == 256
    assert report["graphs"]["gemm_plan"] is None is report["graphs"]["split_plan"]  # timed only on CUDA
    assert len(report["attention_kernels"]) == 13
    profiles = report["step_profile"]
    assert [(p["batch"], p["async_scheduling"], p["sampled"]) for p in profiles] == \
        [(4, False, False), (4, True, False), (4, True, True)]
    assert all(p["step_ms"] > 0 and p["phases_ms"]["forward"] > 0 for p in profiles)
    assert (tmp_path / "profile-4-async.txt").read_text().startswith("batch 4, graphs + async scheduling, greedy:")
    assert (tmp_path / "profile-4-sampled-async.txt").read_text().startswith(
        "batch 4, graphs + async scheduling, sampled {'temperature': 0.8, 'top_p': 0.95}:")
    assert set(report["goals"]) == {"engine_10x_hf_static", "decode_50pct_roofline", "graphs_1_5x_eager_batch_1"}
    assert "all checks passed" in (tmp_path / "gpu_check.log").read_text()


def test_the_step_profile_runs_on_cpu(tmp_path):
    """benchmarks/gpu_step_profile.py, which a GPU session runs after the check, with async scheduling on, sampled."""
    run = subprocess.run([sys.executable, "gpu_step_profile.py", "--device", "cpu", "--batch", "4", "--steps", "2",
                          "--async-scheduling", "--sampled", "--out", str(tmp_path)], cwd=ROOT / "benchmarks",
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = (tmp_path / "profile-4-sampled-async.txt").read_text()
    assert report.startswith("batch 4, graphs + async scheduling, sampled") and "top by host time" in report


def test_the_tree_leaves_the_gpu_wheels_their_budget():
    """The tree's side of the fit, without the download; `make gpu-wheels` fails where the wheels outgrow their
    budget or the two together reach the copy's limit."""
    tree = tree_bytes()
    assert misfit(WHEELS_BUDGET, tree) is None, f"tree {tree / 2**20:.1f} MiB: the wheels no longer fit beside it"
    assert misfit(WHEELS_BUDGET + 1, 0) and misfit(WHEELS_BUDGET, DEVICE_COPY_LIMIT - WHEELS_BUDGET)


def fake_wheel(folder: Path, name: str, members: list[str]) -> Path:
    """A wheel of empty members whose RECORD lists them all, as pip writes it."""
    path, record = folder / f"{name}-1.0-py3-none-any.whl", f"{name}-1.0.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as wheel:
        for member in members:
            wheel.writestr(member, b"x" * 100)
        wheel.writestr(record, "".join(f"{m},sha256=x,100\n" for m in members) + f"{record},,\n")
    return path


def test_slimmed_wheels_keep_what_the_gpu_loads_and_a_record_of_exactly_their_members(tmp_path):
    ray = fake_wheel(tmp_path, "ray", ["ray/_raylet.so", "ray/jars/ray_dist.jar", "ray/serve/api.py", "ray/rllib/a.py",
                                       "ray/dashboard/client/build/index.js", "ray/dashboard/agent.py", "ray/x.js.map",
                                       "ray/data/a.py", "ray/tune/a.py", "ray/train/a.py", "ray/air/a.py", "ray/llm/a.py"])
    bnb = fake_wheel(tmp_path, "bitsandbytes", [f"bitsandbytes/libbitsandbytes_{v}.so" for v in
                                                ("cuda130", "cpu", "cuda128", "cuda118", "rocm63")])
    other = fake_wheel(tmp_path, "msgspec", ["msgspec/jars/kept.py"])
    gpu_wheels(str(tmp_path))
    kept = {}
    for wheel in (ray, bnb, other):
        with zipfile.ZipFile(wheel) as archive:
            members = set(archive.namelist())
            record = next(m for m in members if WHEEL_RECORD.match(m))
            listed = {line.split(",")[0] for line in archive.read(record).decode().splitlines() if line}
        assert listed == members, f"{wheel.name}: RECORD lists {sorted(listed ^ members)}"
        kept[wheel.name.split("-")[0]] = sorted(members - {record})
    assert kept == {"ray": ["ray/_raylet.so", "ray/dashboard/agent.py", "ray/serve/api.py"],
                    "bitsandbytes": ["bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"],
                    "msgspec": ["msgspec/jars/kept.py"]}, kept


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
        ("prefill tiling", "default"), ("prefill tiling", "rows=128 tile=32 warps=8 stages=3"),
        ("decode tiling", "default"), ("decode tiling", "tile=32"), ("decode tiling", "tile=128"),
        ("decode tiling", "splits=4 tile=32")]  # a forced split count, merged: the same output
    assert all(r["us"] > 0 and r["matches_default"] for r in tilings), tilings


def gpu_check_module():
    """benchmarks/gpu_check.py, a script, imported as a module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    return gpu_check


def test_a_failed_stage_is_reported_and_the_check_goes_on(tmp_path):
    """A stage that raises (a CUDA error part way through the measurements) becomes one failure, its traceback in the
    log; the stages after it still run."""
    gpu_check = gpu_check_module()
    log = gpu_check.Log(tmp_path / "gpu_check.log")

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert gpu_check._stage(log, "measurements", broken) == [
        "measurements: RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert gpu_check._stage(log, "tests", lambda: ["one check failed"]) == ["one check failed"]
    assert gpu_check._stage(log, "sweep", lambda: None) == []
    assert "measurements failed:\nTraceback" in (tmp_path / "gpu_check.log").read_text()


def test_tests_cut_off_by_the_budget_take_their_child_processes_with_them(tmp_path):
    """A timeout kills pytest's whole process tree (xdist's workers on a GPU); the log names each outcome so far, and
    failures.log holds each failure's traceback."""
    gpu_check = gpu_check_module()
    child_pid = tmp_path / "child.pid"
    (tmp_path / "test_stuck.py").write_text(
        "import subprocess, time\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert 1 == 2, 'the cause'\n"
        "def test_stuck():\n"
        f"    child = subprocess.Popen(['sleep', '300'])\n    open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(300)\n")
    # --rootdir: node ids are relative to it, and pytest otherwise infers it from where the clone and the temporary
    # folder lie (a clone under /tmp got ids named from /tmp)
    result = gpu_check.run_tests([str(tmp_path / "test_stuck.py"), "-p", "no:cacheprovider", f"--rootdir={tmp_path}"],
                                 gpu_check.Log(tmp_path / "gpu_check.log"), tmp_path, timeout_s=8)
    assert result["exit"] == "timeout after 8 s", result
    assert "test_passes PASSED" in (tmp_path / "pytest.log").read_text()
    assert result["failed"] == ["test_stuck.py::test_fails"], result  # its traceback kept, though no summary came
    assert "AssertionError: the cause" in (tmp_path / "failures.log").read_text()
    assert not alive(int(child_pid.read_text())), "the test's child outlived the timeout"


def test_xdist_workers_split_the_cores_between_them():
    """Each worker of the GPU check's pytest its own contiguous share, none shared; a worker started in place of a
    lost one takes a share, and more workers than cores still get a core each."""
    shares = [share(list(range(16)), index, 8) for index in range(8)]
    assert sorted(core for cores in shares for core in cores) == list(range(16)) and all(len(c) == 2 for c in shares)
    assert share(list(range(16)), 9, 8) == shares[1]
    assert share([4, 5], 2, 3) == [4] and share([4, 5], 1, 3) == [5]
