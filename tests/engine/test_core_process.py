"""The engine core in a child process: the same outputs as in-process, its metrics reach the parent's sink, its
death fails only the requests in flight and shows in health, it dies with its parent, and starting and stopping
it leaves nothing behind."""
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import AsyncLLMEngine, EngineDeadError, SamplingParams
from engine.core_process import SHARE_WITH_OTHERS_MAX_TOKENS, CoreLoop
from engine.host_memory import HEAP_ON_HUGE_PAGES
from engine.metrics import PrometheusSink, StepMetrics
from tests.engine.test_cpu_contention import busy_processes
from tests.processes import alive

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the async tests share the module's engine and loop
CONFIG = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=8, engine_process=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colours:"]


def core_socket_dirs() -> set[Path]:
    """The core processes' socket directories (ProcessCore's mkdtemp) now present."""
    return set(Path(tempfile.gettempdir()).glob("engine-core-*"))


def children_of(pid: int) -> set[int]:
    tasks = Path(f"/proc/{pid}/task")
    return {int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()}


@pytest.fixture(scope="module")
def core():
    engine = AsyncLLMEngine(**CONFIG)
    yield engine
    engine.shutdown()


@in_module_loop
async def test_a_core_process_gives_the_in_process_engines_outputs(core, llm32):
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, prompt_logprobs=1, stop=["\n\n"]),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[13])]
    expected = llm32.generate(PROMPTS, params, use_tqdm=False)

    async def run(i):
        return [o async for o in core.generate(PROMPTS[i], params[i], f"same-{i}")]

    streams = await asyncio.gather(*(run(i) for i in range(len(PROMPTS))))
    for outs, want in zip(streams, expected):
        got = outs[-1]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert got.prompt_token_ids == want.prompt_token_ids
        assert "".join(o.delta_text for o in outs) == got.text
        assert sum((o.delta_token_ids for o in outs), []) == got.token_ids
    first, want = streams[0][-1], expected[0]
    assert [sorted(e) for e in first.logprobs] == [sorted(e) for e in want.logprobs]
    assert [e[t] for e, t in zip(first.logprobs, first.token_ids)] == pytest.approx(
        [e[t] for e, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(want.prompt_logprobs)
    assert [sorted(e) for e in first.prompt_logprobs[1:]] == [sorted(e) for e in want.prompt_logprobs[1:]]


def test_the_offline_llm_over_a_core_process_gives_the_inline_cores_outputs(llm32):
    """LLM holds an EngineCore like AsyncLLMEngine: with engine_process it waits for the core's steps instead of
    stepping an inline core, and a stop string ended in its front end still frees the request in the core."""
    from engine import LLM

    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3),
              SamplingParams(max_tokens=20, temperature=0.0, stop=[" the"], logprobs=1)]
    expected = llm32.generate(PROMPTS[:3], params, use_tqdm=False)
    assert expected[2].finish_reason == "stop"
    llm = LLM(**CONFIG)
    try:
        got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
            [(o.token_ids, o.text, o.finish_reason) for o in expected]
        assert not llm.has_unfinished_requests() and llm.core.stats().idle, llm.core.stats()
    finally:
        llm.shutdown()


@in_module_loop
async def test_the_cores_step_metrics_reach_the_parents_sink(core):
    sink = PrometheusSink()
    core.attach_metrics(StepMetrics(sink, "core-test"))
    outs = [o async for o in core.generate("Hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    assert len(outs[-1].token_ids) == 6
    sample = {"model_name": "core-test"}
    assert sink.registry.get_sample_value("engine_generation_tokens_total", sample) == 6
    assert sink.registry.get_sample_value("engine_request_success_total", {**sample, "finish_reason": "length"}) == 1
    assert sink.registry.get_sample_value("engine_time_to_first_token_seconds_count", sample) == 1
    assert sink.registry.get_sample_value("engine_step_phase_seconds_total", {**sample, "phase": "forward"}) > 0
    # a stop string is found by the front end, which ends the request and has the core stop it: counted as "stop"
    free = outs[-1].text
    stop = free[len(free) // 2:][:2]
    stopped = [o async for o in core.generate("Hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                      stop=[stop]))]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].text == free[:free.index(stop)]
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        await asyncio.sleep(0.05)
    assert sink.registry.get_sample_value("engine_request_success_total", {**sample, "finish_reason": "stop"}) == 1
    assert sink.registry.get_sample_value("engine_request_success_total", {**sample, "finish_reason": "abort"}) is None
    assert core.stats().kv_blocks_free == core.stats().kv_blocks_total


@in_module_loop
async def test_a_killed_core_fails_the_requests_in_flight_and_says_so_in_health():
    engine = AsyncLLMEngine(**CONFIG)
    try:
        stream = engine.add_request("victim", "Tell me a story", SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        pid = engine.stats().core_pid
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in stream:
                pass
        assert time.monotonic() - killed_at < 3
        assert "exited with code -9" in engine.health_problem()
        with pytest.raises(EngineDeadError):
            engine.add_request("after", "Hello", SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()


def test_the_core_dies_with_its_parent(tmp_path):
    """However the parent goes (here SIGKILL, which runs no clean-up), the core does not outlive it."""
    script = textwrap.dedent(f"""
        import time
        from engine import AsyncLLMEngine
        engine = AsyncLLMEngine(**{CONFIG!r})
        print(engine.stats().core_pid, flush=True)
        time.sleep(600)
    """)
    before_dirs = core_socket_dirs()
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        assert alive(core_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(core_pid), "the core outlived its parent"
        assert core_socket_dirs() == before_dirs, "the killed parent's socket directory was left behind"
    finally:
        parent.kill()


def test_a_replica_imports_no_torch_and_spawns_its_core_before_its_front_end_halves_load():
    """A Serve replica's module and the front end's import neither, and AsyncLLMEngine spawns the core process
    before its own input and output halves load: the front end's imports (about 3 s: torch and transformers, on the
    tokenizers' thread) then run beside the core's start instead of before it."""
    script = textwrap.dedent("""
        import subprocess, sys
        import serve_app.replica
        from engine import AsyncLLMEngine
        loaded = lambda *names: sorted(m for m in names if m in sys.modules)
        print("imported:", loaded("torch", "transformers"), flush=True)

        def spawn(*args, **kwargs):
            print("at the spawn:", loaded("engine.input_processor", "engine.output_processor"), flush=True)
            raise RuntimeError("stop here")

        subprocess.Popen = spawn
        try:
            AsyncLLMEngine(engine_process=True)
        except RuntimeError as exc:
            assert str(exc) == "stop here", exc
    """)
    before_dirs = core_socket_dirs()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["imported: []", "at the spawn: []"]
    assert core_socket_dirs() == before_dirs, "a core that failed to spawn left its sockets' directory behind"


@in_module_loop
async def test_repeated_starts_and_stops_leave_no_process_socket_or_block_behind():
    before_children, before_fds, before_dirs = children_of(os.getpid()), len(os.listdir("/proc/self/fd")), core_socket_dirs()
    for i in range(3):  # one descriptor leaked a start is 3, over the slack of 2 below (ten starts took 66 s)
        engine = AsyncLLMEngine(**CONFIG)
        core_pid = engine.stats().core_pid
        outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))]
        assert len(outs[-1].token_ids) == 3
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0, stats
        engine.shutdown()
        assert not alive(core_pid), f"start {i}: the core process is still there after shutdown"
    assert children_of(os.getpid()) == before_children
    assert len(os.listdir("/proc/self/fd")) <= before_fds + 2  # pytest's own files may come and go
    assert core_socket_dirs() == before_dirs, "a socket directory was left behind"


@in_module_loop
async def test_the_core_process_starts_with_its_heap_on_huge_pages(core):
    environ = Path(f"/proc/{core.stats().core_pid}/environ").read_bytes().split(b"\0")
    tunables = next(v for v in environ if v.startswith(b"GLIBC_TUNABLES=")).split(b"=", 1)[1].decode()
    assert HEAP_ON_HUGE_PAGES in tunables.split(":")


@in_module_loop
async def test_a_message_the_core_cannot_decode_is_dropped_and_the_core_serves_on(core):
    """The core used to die on a CoreInputs it could not decode, failing every request in flight."""
    core.core._to_core.send(b"\xc1 not msgpack")
    core.core._to_core.send(b"\x93\x01\x02")  # msgpack, but not a CoreInputs
    outs = [o async for o in core.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]
    assert len(outs[-1].token_ids) == 4 and core.health_problem() is None


def test_warm_up_readies_the_front_ends_own_grammar_checker_too(core):
    """With the core in its own process the front end checks schemas with a checker of its own (to refuse a bad one
    before admitting it); left cold, the first schema built llguidance's tokenizer on the serving replica, holding
    the interpreter lock about a second: a 1.25-1.54 s gap in another client's stream (tests/serve/test_hostile_input)."""
    assert core.inputs.grammars is not None and not core.inputs.grammars.warm
    core.warm_up()
    assert core.inputs.grammars.warm


def test_steps_leave_a_core_to_a_grammar_compile_while_one_runs(llm32):
    """While the core's compile thread works, steps run on one core fewer, so the compile has a core of its own and
    no OpenMP barrier waits on a thread sharing one with it; with no compile left, steps take every core again.
    (Sharing, one decode beside 24 new schemas: steps of 150-290 ms at p90/max where they take 28 ms alone.)
    Nothing else is runnable here, by stand-in: the machine's count is the next test's."""
    threads = torch.get_num_threads()
    loop = CoreLoop(llm32.engine, inputs=None, outputs=None, loop_threads=2, runnable_elsewhere=lambda: 0)
    compile_done = threading.Event()
    try:
        loop.compiling.append((None, loop.compiler.submit(compile_done.wait)))
        loop._share_cores()
        assert torch.get_num_threads() == 1
        compile_done.set()
        loop.compiling.clear()
        loop._share_cores()
        assert torch.get_num_threads() == 2
    finally:
        compile_done.set()
        loop.compiler.shutdown()
        torch.set_num_threads(threads)


def requests_left(*tokens: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(num_uncomputed_tokens=n) for n in tokens]


@pytest.mark.parametrize("running,waiting,threads_left", [
    ([1] * SHARE_WITH_OTHERS_MAX_TOKENS, [], 1),  # decoding streams, one token each
    ([1] * (SHARE_WITH_OTHERS_MAX_TOKENS + 1), [], 2),
    ([1], [SHARE_WITH_OTHERS_MAX_TOKENS - 1], 1),  # a short prompt waiting beside one stream
    ([1], [SHARE_WITH_OTHERS_MAX_TOKENS], 2),
    ([SHARE_WITH_OTHERS_MAX_TOKENS + 1], [], 2),  # a prompt being computed in chunks
])
def test_a_step_with_many_tokens_to_compute_keeps_every_core_beside_other_processes(running, waiting, threads_left):
    """Past SHARE_WITH_OTHERS_MAX_TOKENS a step's ops are long between barriers and two threads sharing a core beat
    one (64 served streams: one thread cost 7-19%; scored long prompts: 45% a step), so others being runnable no
    longer takes a core; a compile still does. The engine is a stand-in: this is the rule alone."""
    threads = torch.get_num_threads()
    scheduler = SimpleNamespace(running=requests_left(*running), waiting=requests_left(*waiting))
    engine = SimpleNamespace(device=torch.device("cpu"), scheduler=scheduler)
    loop = CoreLoop(engine, inputs=None, outputs=None, loop_threads=2, runnable_elsewhere=lambda: 1)
    try:
        loop._share_cores()
        assert torch.get_num_threads() == threads_left
        loop.compiling.append((None, None))
        loop._share_cores()
        assert torch.get_num_threads() == 1
    finally:
        loop.compiler.shutdown()
        torch.set_num_threads(threads)


def test_steps_leave_a_core_to_another_process_that_wants_one(llm32):
    """A process spinning beside the core (as the replica does while it checks new schemas): the next step runs on
    one core fewer, where its two threads had waited for each other at every barrier (a 40 ms step took 0.72 s)."""
    threads = torch.get_num_threads()
    loop = CoreLoop(llm32.engine, inputs=None, outputs=None, loop_threads=2)
    with busy_processes(1):
        try:
            torch.set_num_threads(2)
            loop._share_cores()
            assert torch.get_num_threads() == 1
        finally:
            loop.compiler.shutdown()
            torch.set_num_threads(threads)
