"""The one prepared check for a GPU machine (`make gpu-check`): in one process tree and a few minutes, with no network
and nothing but a copy of the tree, it proves the CUDA path and measures it.

1. The environment: GPU, driver, torch, triton and transformers versions.
2. A random Qwen2.5-1.5B-shaped bf16 model built on the device (no download), measured in one run: decode tok/s and
   step time by batch, eager, in CUDA graphs, and in graphs with async scheduling (the largest batch also with the
   core in a process of its own, as the served app runs it); prefill of a 4k-token prompt; the
   same workload through HF `generate` with static batches (the engine's with and without async scheduling); where
   the largest batch's step goes, with and without async scheduling (`gpu_step_profile.py`, torch's profiler);
   kernels launched per decode step; the KV blocks chosen against free memory; the attention, greedy and top-p
   kernels alone against the GPU's peak (`benchmarks/triton_attention.py`).
3. `pytest -m gpu`, in the time left: the engine's parity cases on CUDA (fp32 against transformers, every
   scheduling mode, Triton and torch attention), speculative decoding, structured output, async scheduling against
   synchronous steps, the Triton attention kernels, fused ops and sampler kernels against the torch path. Each
   failure's traceback goes to failures.log as it happens (`benchmarks/failure_log.py`).
4. The attention kernels' tilings, swept where time is left (data for their defaults, not a check).

The measurements come first because they are what the GPU time is for: a failure part way (a CUDA error) keeps what
was measured and the tests still run, in their own process.

Writes `gpu_check.json` and `gpu_check.log` under --out; exits non-zero on any failed check (a goal missed is
reported, not failed). `--device cpu` runs the same code at toy sizes, with the Triton kernels under triton's
interpreter: `make test` runs it, so what reaches a GPU has already run end to end.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu-check
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

cli = typer.Typer(add_completion=False)
# The whole check must end inside one device call (600 s at most; `make gpu-check` is run under `timeout 560`): the
# measurements, what GPU time is for, run first; the tests get what is left of the budget, the tiling sweep the rest.
BUDGET_S = 520
TESTS_TIMEOUT_S = 360  # the first H100 run's tests took 222 s serially
SWEEP_RESERVE_S = 60  # the tiling sweep: 16 tilings compiled and timed (an estimate; it has not yet run on a GPU)
WARM_STEPS = 2  # untimed decode steps first: a cold triton cache compiles the step's kernels in the first


@dataclass
class Sizes:
    """What is measured on each device: the GPU's shapes, or toys that finish in seconds on a CPU."""

    model: dict
    vocab_size: int
    batches: list[int]
    decode_steps: int
    prompt_len: int
    new_tokens: int
    prefill_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int | None  # None: sized by profiling the device's free memory
    tests: list[str] = field(default_factory=list)


# Qwen2.5-1.5B-Instruct's config (as benchmarks/roofline.py): 28 layers, hidden 1536, MLP 8960, 12/2 heads of 128
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                 initializer_range=0.02)
SIZES = {
    # every case marked gpu, and the kernel tests (which run on CUDA where there is one); none needs the embedded model
    "cuda": Sizes(QWEN_1_5B, 151936, [1, 32, 128, 256], 32, 128, 64, 4096, 256, 4096, None,
                  ["tests/engine/kernels/test_triton_attention.py", "tests/engine/kernels/test_triton_fused_ops.py",
                   "tests/engine/kernels/test_triton_greedy.py", "tests/engine/kernels/test_triton_nucleus.py",
                   "tests/engine/kernels/test_triton_matmul.py", "tests/engine/test_gemm_plan.py",
                   "tests/engine/test_split_plan.py",
                   "tests/engine/test_synthetic_models.py", "tests/engine/test_async_scheduling.py",
                   "tests/engine/test_mixed_workloads.py",
                   "tests/engine/test_cuda_graphs.py", "tests/engine/test_lora.py", "tests/engine/test_embeddings.py",
                   "tests/engine/test_score_shapes.py", "tests/engine/test_kv_budget.py",
                   "-m", "gpu or not slow", "-p", "no:cacheprovider"]),
    "cpu": Sizes(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1000000.0,
                      tie_word_embeddings=True, initializer_range=0.02), 4096, [1, 4], 4, 32, 8, 256, 16, 256, 256,
                 ["tests/engine/kernels/test_triton_attention.py", "-k", "mixed_step", "-p", "no:cacheprovider"]),
}


class Log:
    """Each line to the terminal and to gpu_check.log, as it happens."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def environment(device: str) -> dict:
    import torch
    import transformers
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "device": device, "date": time.strftime("%Y-%m-%d")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm=f"{props.major}{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda, driver=_driver())
    else:
        info.update(cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    return info


def _driver() -> str | None:
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return run.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_tests(args: list[str], log: Log, out: Path, timeout_s: float, workers: int = 8) -> dict:
    """pytest in a child process; its output goes to pytest.log under --out. Spread over worker processes where
    pytest-xdist is installed (the GPU image has it): a cold triton cache compiles each kernel variant the tests
    launch, which is CPU work, and the GPU holds several tests' tensors at once (every engine test sizes its KV pool
    by blocks, none by the card's free memory). Each worker runs on its own share of the cores
    (`benchmarks/xdist_cores.py`): unpinned, 8 workers of one thread per core each, 8x oversubscribed on their CPU
    cases, are the first suspect for the H200 run's stage running out of its time."""
    import importlib.util

    workers = min(workers, (os.cpu_count() or 1) // 2)
    spread = ["-n", str(workers), "-p", "benchmarks.xdist_cores"] if importlib.util.find_spec("xdist") and workers > 1 \
        else []
    started = time.perf_counter()
    failures = out / "failures.log"
    failures.unlink(missing_ok=True)
    with (out / "pytest.log").open("w") as sink:
        # -v: each outcome is logged as it comes, so a run cut off by the budget still names what failed, and
        # benchmarks/failure_log.py writes each failure's traceback as it comes (a cut-off run loses the summary
        # first). Its own session, so that a timeout kills xdist's workers too, not pytest's main process alone:
        # they would hold the GPU through the stages after
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-rfE", "--durations=15", *spread,
                                  "-p", "benchmarks.failure_log", f"--failure-log={failures}", *args],
                                 cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = tests.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(tests.pid, signal.SIGKILL)
            tests.wait()
            code = f"timeout after {timeout_s:.0f} s"
    tail = (out / "pytest.log").read_text().strip().splitlines()[-1:] or [""]
    failed = re.findall(r"^=== (\S+)", failures.read_text(), re.M) if failures.exists() else []
    log(f"pytest {' '.join(spread + args)}: exit {code}, {tail[0]}" + (f"; failed: {failed}" if failed else ""))
    return {"args": spread + args, "exit": code, "summary": tail[0], "failed": failed,
            "seconds": round(time.perf_counter() - started, 1)}


def build_model(device: str, sizes: Sizes, dtype, out: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.fixtures.tiny_models import random_checkpoint

    return random_checkpoint(out / "model", Qwen2ForCausalLM, Qwen2Config, sizes.model, sizes.vocab_size, device, dtype)


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (count, length), generator=generator).tolist()


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# a chat client's usual request: what async scheduling must cover beside greedy (top-p drawn on the device)
SAMPLED = dict(temperature=0.8, top_p=0.95)


def decode_rate(llm, device: str, batch: int, sizes: Sizes, sampling: dict | None = None) -> dict:
    """Step time and tok/s of decode steps with `batch` sequences running, prefill excluded; greedy unless
    `sampling` says otherwise."""
    from engine import SamplingParams
    from engine.step_stats import GcPauses, heap_frozen_during

    params = SamplingParams(max_tokens=sizes.decode_steps + 64, ignore_eos=True,  # none ends early
                            **(sampling or dict(temperature=0.0)))
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    _start(llm, ids, prompts(batch, sizes.prompt_len, sizes.vocab_size, batch), params)
    with heap_frozen_during():  # as generate() steps: a full collection of the old heap is not the engine's step
        for _ in range(WARM_STEPS):
            llm.step()
        counters, graphs = llm.engine.counters, llm.engine.runner.graphs
        before, ahead, front_end = counters["generation_tokens"], counters["num_steps_ahead"], llm.front_end_seconds
        advanced = graphs.num_advanced if graphs is not None else 0
        sync(device)
        pauses, started = GcPauses(), time.perf_counter()
        for _ in range(sizes.decode_steps):
            llm.step()
        sync(device)
        seconds = time.perf_counter() - started
    tokens = counters["generation_tokens"] - before
    _finish(llm, ids)
    return {"batch": batch, "step_ms": round(1e3 * seconds / sizes.decode_steps, 3), "tok_s": round(tokens / seconds, 1),
            "tokens": tokens, "steps_ahead": counters["num_steps_ahead"] - ahead,
            # steps ahead whose inputs the graphs' buffers advanced on the device (cuda_graphs.DecodeGraphs.advance)
            "steps_advanced": (graphs.num_advanced if graphs is not None else 0) - advanced,
            "gc_ms": round(1e3 * sum(pauses.seconds.values()), 3),  # the collector's pauses inside the window
            # the front end's host time a step (detokenizing), between the inline core's steps
            "front_end_ms": round(1e3 * (llm.front_end_seconds - front_end) / sizes.decode_steps, 3)}


def decode_rate_in_process(llm, batch: int, sizes: Sizes) -> dict:
    """decode_rate's figures for an engine whose core runs in a process of its own, as the served app runs it
    (`engine_process`, on in serve_app's defaults) and vLLM's LLM by default: the front end's detokenizing runs beside
    the core's steps, where inline it runs between them (1.5-1.9 ms a batch-256 step on a Zen 3 core). The core steps
    on its own; its step and token counts come with each step's outputs."""
    from engine import SamplingParams
    from engine.step_stats import heap_frozen_during

    params = SamplingParams(max_tokens=2 * sizes.decode_steps + 64, temperature=0.0, ignore_eos=True)
    ids = [f"decode-process-{batch}-{i}" for i in range(batch)]
    _start(llm, ids, prompts(batch, sizes.prompt_len, sizes.vocab_size, batch), params)
    stats = llm.core.stats
    with heap_frozen_during():
        warm = stats().num_steps + WARM_STEPS
        while stats().num_steps < warm:
            llm.step()
        before, started = stats(), time.perf_counter()
        while stats().num_steps < before.num_steps + sizes.decode_steps:
            llm.step()
        after, seconds = stats(), time.perf_counter() - started
    _finish(llm, ids)
    steps, tokens = after.num_steps - before.num_steps, after.generation_tokens - before.generation_tokens
    # the core's phases a step (the forward's by CUDA events, on the device): the step less the forward is the host's
    # own time, which async scheduling hides only while it is shorter than the GPU's
    phases = {k: round(1e3 * (v - before.step_seconds.get(k, 0.0)) / steps, 3) for k, v in after.step_seconds.items()}
    return {"batch": batch, "step_ms": round(1e3 * seconds / steps, 3), "tok_s": round(tokens / seconds, 1),
            "tokens": tokens, "steps": steps, "steps_ahead": after.num_steps_ahead - before.num_steps_ahead,
            "phases_ms": phases}


@contextlib.contextmanager
def async_scheduling(llm, on: bool):
    """The engine's async scheduling (each decode step launched before the one before it is read) on or off for
    what runs inside; as it was after."""
    engine = llm.engine
    before, engine.async_scheduling = engine.async_scheduling, on
    try:
        yield
    finally:
        engine.async_scheduling = before


def _start(llm, ids: list[str], work: list[list[int]], params) -> None:
    """Add the requests and step until every one has its first token (the engine's counters run on across calls).
    Outputs come once, at the end, as `generate` has them: no reader pays for a RequestOutput each step. The core's
    stats, so that a core in its own process is waited for alike."""
    stats = llm.core.stats
    first_tokens = stats().generation_tokens + len(ids)
    for request_id, prompt in zip(ids, work):
        llm.add_request(request_id, prompt, params, final_only=True)
    while stats().generation_tokens < first_tokens or stats().num_waiting:
        llm.step()


def _finish(llm, ids: list[str]) -> None:
    for request_id in ids:
        llm.abort(request_id)
    while llm.has_unfinished_requests():
        llm.step()


def kernels_per_decode_step(llm, device: str, batch: int, sizes: Sizes) -> int | None:
    """Kernels the GPU ran in one decode step at `batch`, counted by torch's profiler."""
    if device != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    ids = [f"profile-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    _start(llm, ids, prompts(batch, sizes.prompt_len, sizes.vocab_size, 7), params)
    llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    _finish(llm, ids)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def prefill_time(llm, device: str, sizes: Sizes) -> dict:
    """Time to the first token of one prompt of `prefill_tokens`, chunked at max_num_batched_tokens, after one
    untimed prompt as long (another, so no prefix is cached) has compiled the prefill's kernels."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for seed in (12, 11):
        llm.add_request(f"prefill-{seed}", prompts(1, sizes.prefill_tokens, sizes.vocab_size, seed)[0], params)
        sync(device)
        started = time.perf_counter()
        while llm.has_unfinished_requests():
            llm.step()
        seconds = time.perf_counter() - started
    return {"tokens": sizes.prefill_tokens, "seconds": round(seconds, 4), "tok_s": round(sizes.prefill_tokens / seconds, 1)}


def engine_generate(llm, device: str, batch: int, sizes: Sizes) -> dict:
    """The static workload end to end through the engine: `batch` prompts, `new_tokens` each."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=sizes.new_tokens, temperature=0.0, ignore_eos=True)
    work = prompts(batch, sizes.prompt_len, sizes.vocab_size, 3)
    engine = llm.engine
    sync(device)
    phases, counters = dict(engine.phases.seconds), dict(engine.counters)
    started = time.perf_counter()
    outputs = llm.generate(work, params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    # where a missed goal's time went: the steps (those launched ahead) and each phase's seconds (the forward's by
    # CUDA events, on the device); the rest of the wall time is the front end's and the loop's
    steps = {k: engine.counters[k] - counters[k] for k in ("num_steps", "num_steps_ahead")}
    return {"batch": batch, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1), "tokens": tokens,
            **steps, "phases_s": {k: round(v - phases[k], 4) for k, v in engine.phases.seconds.items()}}


def hf_static(path: str, device: str, dtype, batch: int, sizes: Sizes) -> dict:
    """The same workload through transformers' `generate`, one static batch."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts(batch, sizes.prompt_len, sizes.vocab_size, 3), device=device)
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)  # first-call costs
        sync(device)
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sizes.new_tokens,
                             min_new_tokens=sizes.new_tokens, do_sample=False, pad_token_id=0)
        sync(device)
    seconds = time.perf_counter() - started
    tokens = (out.shape[1] - ids.shape[1]) * batch
    del model
    return {"batch": batch, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1), "tokens": tokens}


def roofline_tok_s(info: dict, batch: int, sizes: Sizes) -> float | None:
    """benchmarks/roofline.py's decode estimate for the GPU found, where it is one that table knows."""
    from benchmarks.roofline import estimate, gpu_spec

    spec = gpu_spec(info.get("gpu") or "")
    if spec is None:
        return None
    return estimate(*spec, batch, sizes.prompt_len, sizes.decode_steps * 2)["tok_s"]


def measure(device: str, sizes: Sizes, info: dict, log: Log, out: Path, results: dict) -> list[str]:
    """The measurements, into `results` as they come (a failure part way keeps what was measured); the failed
    checks."""
    import torch

    from engine import LLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started = time.perf_counter()
    path = build_model(device, sizes, dtype, out)
    log(f"random {sizes.model['num_hidden_layers']}-layer model written in {time.perf_counter() - started:.0f} s")
    results.update(decode={}, goals={})
    failures = []
    for mode, eager in (("eager", True), ("graphs", False)):
        llm = LLM(**engine_args(path, device, dtype, sizes), enforce_eager=eager) if eager else \
            graphs_engine(path, device, dtype, sizes, log, failures)
        engine = llm.engine
        if device == "cpu" and not eager:  # no graphs to capture: run their buffers eagerly, so the path is exercised
            engine.runner.capture_graphs(sizes.max_num_seqs, engine.max_model_len, capture=False)
        settings = engine.settings()
        results.setdefault("settings", settings)
        if settings["attention_backend"] != "triton":
            failures.append(f"attention_backend is {settings['attention_backend']}, not triton")
        for rows, ahead in ((mode, False), (f"{mode}_async", True)) if not eager else ((mode, False),):
            with async_scheduling(llm, ahead):
                results["decode"][rows] = [decode_rate(llm, device, batch, sizes) for batch in sizes.batches]
            for row in results["decode"][rows]:
                log(f"decode {rows} batch {row['batch']}: {row['step_ms']} ms a step, {row['tok_s']} tok/s, "
                    f"{row['front_end_ms']} ms of it the front end's; {row['steps_ahead']} steps ahead, "
                    f"{row['steps_advanced']} of them advanced on the device")
                # after the warm steps, with async scheduling one step is in flight when the clock starts and one
                # when it stops: as many land as are timed
                if row["tokens"] != row["batch"] * sizes.decode_steps:
                    failures.append(f"decode {rows} batch {row['batch']}: {row['tokens']} tokens")
                if rows == "graphs_async" and row["steps_advanced"] < row["steps_ahead"] - 1:
                    failures.append(f"decode {rows} batch {row['batch']}: {row['steps_advanced']} of "
                                    f"{row['steps_ahead']} steps ahead advanced the graphs' buffers")
        if not eager:  # the largest batch sampled as chat clients ask, async scheduling off and on
            for rows, ahead in (("graphs_sampled", False), ("graphs_sampled_async", True)):
                with async_scheduling(llm, ahead):
                    results["decode"][rows] = [decode_rate(llm, device, sizes.batches[-1], sizes, SAMPLED)]
                log(f"decode {rows} {SAMPLED}: {results['decode'][rows]}")
        if eager:
            results["kernels_per_step"] = {b: kernels_per_decode_step(llm, device, b, sizes) for b in (1, sizes.batches[-1])}
            results["prefill"] = prefill_time(llm, device, sizes)
            log(f"kernels per decode step: {results['kernels_per_step']}; prefill {results['prefill']}")
        else:
            results["engine_static"] = engine_generate(llm, device, sizes.batches[-1], sizes)
            with async_scheduling(llm, True):
                results["engine_static_async"] = engine_generate(llm, device, sizes.batches[-1], sizes)
            from gpu_step_profile import profile_steps  # the sibling script (it imports this one)

            # greedy without and with async scheduling, then sampled as chat clients ask (its step was 3x greedy's)
            results["step_profile"] = [profile_steps(llm, device, sizes.batches[-1], 8 if device == "cuda" else 2, out,
                                                     ahead, sampling) for ahead, sampling in
                                       ((False, None), (True, None), (True, SAMPLED))]
            for row in results["step_profile"]:
                log(f"profiled step: {row}")
            results["kv"] = {"blocks": engine.runner.num_blocks, "block_size": engine.config.block_size,
                             **_memory(device)}
            graphs = engine.runner.graphs
            plan = graphs.gemm_plan if graphs is not None else None
            results["graphs"] = {"buckets": settings.get("cuda_graphs"),
                                 "memory_mib": round(graphs.memory_bytes / 2**20, 1) if graphs is not None else None,
                                 # per decoder linear shape and bucket: cuBLAS's us a call against the best tiling's
                                 "gemm_plan": plan.timings if plan is not None else None,
                                 # per bucket: the decode attention's us a call by "splits x context", the count taken
                                 "split_plan": splits.timings if (splits := engine.runner.split_plan) else None}
            if plan is not None:
                log(f"linear kernels: {plan.summary()}")
            if splits is not None:
                log(f"decode attention splits: {splits.summary()}")
        del llm, engine
        gc.collect()  # the engine's cycles hold its KV pool: the next engine profiles free memory without it
        if device == "cuda":
            torch.cuda.empty_cache()
    results["decode"]["graphs_async_process"] = [decode_in_process(path, device, dtype, sizes, log)]
    results["hf_static"] = hf_static(path, device, dtype, sizes.batches[-1], sizes)
    from benchmarks.triton_attention import default_repeats, measure_kernels

    _, results["attention_kernels"] = measure_kernels(device, default_repeats(device))
    for row in results["attention_kernels"]:
        log(f"attention kernel: {row}")
    log(f"static batch {sizes.batches[-1]}: engine {results['engine_static']['tok_s']} tok/s "
        f"({results['engine_static_async']['tok_s']} with async scheduling), "
        f"HF generate {results['hf_static']['tok_s']} tok/s; KV {results['kv']}")
    results["goals"] = goals(results, info, sizes)
    return failures


def graphs_engine(path: str, device: str, dtype, sizes: Sizes, log: Log, failures: list[str]):
    """The engine with CUDA graphs, the linears' plan and the attention's split counts timed (engine/gemm_plan.py,
    engine/split_plan.py; neither yet run on a GPU); if that engine fails to start, the failure is a check's, and the
    rest is measured on cuBLAS and the split rule rather than lost."""
    import torch

    from engine import LLM

    try:
        return LLM(**engine_args(path, device, dtype, sizes), enforce_eager=False)
    except Exception as error:
        import traceback

        log(f"the graphs engine with gemm_tuning and split_tuning failed; again without:\n{traceback.format_exc()}")
        failures.append(f"graphs engine with gemm_tuning and split_tuning: {type(error).__name__}: {error}")
    # out of the except block, whose traceback holds the failed engine's frames: its memory is free for the next,
    # whose share of the device (gpu_memory_utilization) must be free when it starts
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return LLM(**engine_args(path, device, dtype, sizes), enforce_eager=False, gemm_tuning=False, split_tuning=False)


def engine_args(path: str, device: str, dtype, sizes: Sizes) -> dict:
    """The engine every measurement runs, whatever it runs it in: the same model, pool and batch limits."""
    return dict(model=path, device=device, dtype=str(dtype).removeprefix("torch."), max_num_seqs=sizes.max_num_seqs,
                max_num_batched_tokens=sizes.max_num_batched_tokens, num_kv_blocks=sizes.num_kv_blocks,
                attention_backend="triton")


def decode_in_process(path: str, device: str, dtype, sizes: Sizes, log: Log) -> dict:
    """The largest batch's decode with graphs and async scheduling, the core in its own process (the served app's
    way, see decode_rate_in_process)."""
    import torch

    from engine import LLM

    llm = LLM(**engine_args(path, device, dtype, sizes), async_scheduling=True, engine_process=True)
    try:
        row = decode_rate_in_process(llm, sizes.batches[-1], sizes)
    finally:
        llm.shutdown()  # its process's GPU memory is free for HF's model after it
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"decode graphs_async_process batch {row['batch']}: {row['step_ms']} ms a step, {row['tok_s']} tok/s "
        f"(the core in its own process; its phases, ms a step: {row['phases_ms']})")
    return row


def _memory(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"free_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2)}


def goals(results: dict, info: dict, sizes: Sizes) -> dict:
    """Issue 40's goals, each with the figures it was judged on (reported, not failed)."""
    eager, graphs = results["decode"]["eager"], results["decode"]["graphs"]
    biggest = sizes.batches[-1]
    roof = roofline_tok_s(info, biggest, sizes)
    static = max(results["engine_static"]["tok_s"], results["engine_static_async"]["tok_s"])
    engine_vs_hf = static / results["hf_static"]["tok_s"]
    graphs_vs_eager = graphs[0]["tok_s"] / eager[0]["tok_s"]
    decode = max(graphs[-1]["tok_s"], results["decode"]["graphs_async"][-1]["tok_s"])
    served = results["decode"].get("graphs_async_process", [{}])[-1].get("tok_s")
    return {  # the engine's best, with async scheduling or without; both are in the results. The in-process figure
        # (the core in its own process, as served) is reported beside it, judged apart
        "engine_10x_hf_static": {"ratio": round(engine_vs_hf, 2), "met": engine_vs_hf >= 10},
        "decode_50pct_roofline": {"tok_s": decode, "roofline_tok_s": roof and round(roof),
                                  "met": None if roof is None else decode >= 0.5 * roof,
                                  "core_process_tok_s": served,
                                  "core_process_met": None if roof is None or served is None else served >= 0.5 * roof},
        "graphs_1_5x_eager_batch_1": {"ratio": round(graphs_vs_eager, 2), "met": graphs_vs_eager >= 1.5},
    }


@cli.command()
def main(device: str = typer.Option("cuda", help="cuda, or cpu for toy sizes under triton's interpreter"),
         out: Path = typer.Option(ROOT / "benchmarks" / "results" / "gpu-check", help="where the JSON and logs go"),
         tests: bool = typer.Option(True, help="run the pytest step"),
         test_workers: int = typer.Option(8, help="pytest-xdist workers for the pytest step (each on its share of the "
                                                  "cores), where xdist is installed"),
         budget_s: float = typer.Option(BUDGET_S, help="seconds the whole check may take")):
    deadline = time.monotonic() + budget_s
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines a kernel: the CUDA path's kernels, on numpy
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out.mkdir(parents=True, exist_ok=True)
    log, sizes = Log(out / "gpu_check.log"), SIZES[device]
    info = environment(device)
    log(f"environment: {info}")
    report = {"environment": info, "failures": []}
    report["failures"] += _stage(log, "measurements", lambda: measure(device, sizes, info, log, out, report))
    _write(report, out)
    log(f"goals: {json.dumps(report.get('goals'))}")
    if tests:  # in a child process: a CUDA error that ended the measurements leaves it a fresh context
        timeout_s = max(60.0, min(TESTS_TIMEOUT_S, _left(deadline) - SWEEP_RESERVE_S))
        report["tests"] = run_tests(sizes.tests, log, out, timeout_s, test_workers)
        if report["tests"]["exit"] != 0:
            report["failures"].append(f"pytest exit {report['tests']['exit']}: {report['tests']['summary']}")
        _write(report, out)
    if device == "cuda" and _left(deadline) > SWEEP_RESERVE_S:  # the data for the kernels' defaults, not a check
        _stage(log, "tiling sweep", lambda: _sweep(report, log))
        _write(report, out)
    log(f"{'FAILED: ' + '; '.join(report['failures']) if report['failures'] else 'all checks passed'}; "
        f"{out / 'gpu_check.json'}")
    raise typer.Exit(1 if report["failures"] else 0)


def _stage(log: Log, name: str, run) -> list[str]:
    """`run()`'s failed checks, or the exception that ended it as one (its traceback in the log)."""
    import traceback

    try:
        return run() or []
    except Exception as error:  # reported, and the stages after it still run
        log(f"{name} failed:\n{traceback.format_exc()}")
        return [f"{name}: {type(error).__name__}: {error}"]


def _sweep(report: dict, log: Log) -> None:
    from benchmarks.triton_attention import default_repeats, tiling_cases

    report["kernel_tilings"] = tiling_cases("cuda", default_repeats("cuda"))
    for row in report["kernel_tilings"]:
        log(f"kernel tiling: {row}")


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _write(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    cli()
