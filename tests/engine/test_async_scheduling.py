"""Async scheduling (`engine/async_scheduling.py`): with it on, every request gets exactly the tokens it gets with it
off (fp32, greedy and seeded sampling), whatever ends it and whenever it ends; steps really are launched ahead;
requests that arrive, are aborted or do not fly (logprobs, penalties) meanwhile are served as before; and no KV block
is left held. On CPU the steps are synchronous underneath, so this checks the bookkeeping; the GPU check measures the
overlap. The same cases run on CUDA where there is one (marker `gpu`), with the decode steps in CUDA graphs, where a
step launched ahead must not wait for the device once."""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.fixtures.tiny_models import tiny_checkpoint
from tests.fixtures.triton_interpreter import cpu_triton_marks

pytestmark = pytest.mark.slow
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("async"), "qwen2-hd128")


def prompts(count: int) -> list[list[int]]:
    return [[5 + i, 17, 300 + 7 * i, 42, 9 + 2 * i] * (1 + i % 3) for i in range(count)]


def engine(checkpoint, device, backend="torch", **args) -> LLM:
    return LLM(**{**dict(model=checkpoint, dtype="float32", device=device, attention_backend=backend, num_kv_blocks=96,
                         max_num_seqs=8), **args})


def run(llm: LLM, on: bool, work: list[tuple[list[int], SamplingParams]], during=None) -> dict[str, list[int]]:
    """Each request's token ids (and its finish reason) by id; `during(llm, step_index)` runs between steps."""
    llm.engine.async_scheduling = on
    for i, (prompt, params) in enumerate(work):
        llm.add_request(f"r{i}", prompt, params)
    finals, step = {}, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = (out.token_ids, out.finish_reason)
        if during is not None:
            during(llm, step)
        step += 1
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks left held"
    assert llm.engine.in_flight is None
    return finals


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


@pytest.mark.parametrize("device", DEVICES)
def test_the_same_tokens_as_synchronous_steps_whatever_ends_each_request(checkpoint, device):
    llm = engine(checkpoint, device)
    lengths = [3, 17, 9, 30, 1, 24]
    work = [(p, greedy(n)) for p, n in zip(prompts(len(lengths)), lengths)]
    reference = run(llm, False, work)
    ahead = llm.engine.counters["num_steps_ahead"]
    assert run(llm, True, work) == reference
    assert llm.engine.counters["num_steps_ahead"] - ahead >= 20, "no step was launched ahead"
    # a stop id that the greedy text reaches mid-way, and a length limit of the context, end requests too
    stop_at = reference["r3"][0][11]
    stopping = [(p, greedy(40, stop_token_ids=[stop_at])) for p, _ in work]
    assert run(llm, True, stopping) == run(llm, False, stopping)
    assert any(reason == "stop" for _, reason in run(llm, True, stopping).values())


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_draws_the_same_tokens_ahead(checkpoint, device):
    """Temperature, top-k, top-p and min-p rows draw on the device from their own generators, one draw a step, as
    before."""
    llm = engine(checkpoint, device)
    kinds = [dict(temperature=0.8), dict(temperature=1.3, top_k=20), dict(temperature=0.7, min_p=0.05),
             dict(temperature=0.0), dict(temperature=1.1, top_p=0.8), dict(temperature=0.9, top_k=40, top_p=0.95)]
    work = [(p, SamplingParams(max_tokens=18 + 3 * i, seed=11 + i, ignore_eos=True, **kinds[i % len(kinds)]))
            for i, p in enumerate(prompts(len(kinds)))]
    reference = run(llm, False, work)
    ahead = llm.engine.counters["num_steps_ahead"]
    assert run(llm, True, work) == reference
    assert llm.engine.counters["num_steps_ahead"] - ahead >= 15
    assert len({tuple(tokens) for tokens, _ in reference.values()}) == len(work)


@pytest.mark.parametrize("device", DEVICES)
def test_arrivals_aborts_and_requests_that_do_not_fly_are_served_as_before(checkpoint, device):
    llm = engine(checkpoint, device)
    work = [(p, greedy(20 + 3 * i)) for i, p in enumerate(prompts(5))]
    work.append((prompts(6)[5], SamplingParams(max_tokens=12, temperature=0.8, presence_penalty=0.5, seed=7)))  # never flies
    work.append((prompts(7)[6], greedy(15, logprobs=2)))  # nor this one

    def arrive_and_abort(llm, step):
        if step == 6:
            llm.add_request("late", prompts(9)[8], greedy(10))
        if step == 9:
            llm.abort("r2")

    reference = run(llm, False, work[:5], arrive_and_abort)
    ahead = llm.engine.counters["num_steps_ahead"]
    result = run(llm, True, work[:5], arrive_and_abort)
    # the aborted request's count of tokens depends on when the abort landed: one step later, with steps ahead
    assert result.pop("r2")[1] == reference.pop("r2")[1] == "abort"
    assert result == reference and "late" in result
    assert llm.engine.counters["num_steps_ahead"] > ahead
    runner, launched = llm.engine.runner, set()
    execute_ahead = runner.execute_ahead
    runner.execute_ahead = lambda seqs, *args: launched.update(s.request_id for s in seqs) or execute_ahead(seqs, *args)
    assert run(llm, True, work) == run(llm, False, work)
    assert "r0" in launched and not launched & {"r5", "r6"}, f"a request that cannot fly flew: {launched}"


def test_a_full_batch_keeps_flying_while_requests_queue_and_admits_them_as_seats_free(checkpoint):
    """Saturated: max_num_seqs run and more wait. No one waiting can be admitted, so steps keep launching ahead; a
    finished request's seat goes to the next in line, in order."""
    llm = engine(checkpoint, "cpu", max_num_seqs=3)
    work = [(p, greedy(6 + 5 * (i % 3))) for i, p in enumerate(prompts(9))]
    reference = run(llm, False, work)
    ahead = llm.engine.counters["num_steps_ahead"]
    assert run(llm, True, work) == reference
    assert llm.engine.counters["num_steps_ahead"] - ahead >= 25  # 30 of 41 steps; 15 where any queue landed every step


def test_a_pool_too_small_to_grow_ahead_lands_the_step_and_preempts_as_before(checkpoint):
    llm = engine(checkpoint, "cpu", num_kv_blocks=12)
    work = [(p, greedy(40)) for p in prompts(6)]
    reference = run(llm, False, work)
    preemptions = llm.engine.scheduler.num_preemptions
    assert preemptions > 0
    assert run(llm, True, work) == reference


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=cpu_triton_marks()), DEVICES[1]])
def test_decode_steps_from_cuda_graph_buffers_fly_too(checkpoint, device):
    """The Triton path, with decode steps through the graphs' buffers (captured on CUDA, run eagerly on CPU). A step
    ahead over the same sequences as the step before advances the buffers on the device: after every step ahead
    they hold what the host would have built, new blocks included, and padding rows stay padding."""
    llm = engine(checkpoint, device, backend="triton")
    runner = llm.engine.runner
    graphs = runner.graphs if device == "cuda" else runner.capture_graphs(8, llm.engine.max_model_len, capture=False)
    replays, replay = [], graphs.replay
    graphs.replay = lambda n: replays.append(n) or replay(n)
    launches, wrong, execute_ahead = [], [], runner.execute_ahead

    def checked(seqs, input_ids, *args):
        advanced = graphs.num_advanced
        step = execute_ahead(seqs, input_ids, *args)
        launches.append((graphs.num_advanced > advanced, bool(args[1])))
        try:
            _assert_buffers_hold(graphs, seqs, input_ids, llm.engine.block_manager.block_size)
        except AssertionError as exc:  # raised here, the engine would land the step synchronously instead
            wrong.append(exc)
        return step

    runner.execute_ahead = checked
    work = [(p, greedy(n)) for p, n in zip(prompts(4), [6, 30, 2, 9])]  # r1 takes a block while it runs alone
    reference = run(llm, False, work)
    graphs.block_tables[:, 1:].fill_(-7)  # no entry left by the run before may pass for one the step ahead needs
    assert run(llm, True, work) == reference
    assert not wrong, wrong[0]
    assert len(replays) > 20
    assert (True, True) in launches and (True, False) in launches and (False, False) in launches, launches


def _assert_buffers_hold(graphs, seqs, input_ids, block_size: int) -> None:
    """The graphs' buffers hold the step ahead of `seqs` as the host computes it."""
    n, bucket = len(seqs), graphs.bucket(len(seqs))
    positions = [len(seq) for seq in seqs]
    assert graphs.input_ids[:n].tolist() == input_ids.tolist()
    assert graphs.positions[:n].tolist() == positions
    assert graphs.context_lens[:bucket].tolist() == [p + 1 for p in positions] + [1] * (bucket - n)
    slots = [seq.block_table[p // block_size] * block_size + p % block_size for seq, p in zip(seqs, positions)]
    assert graphs.slot_mapping[:bucket].tolist() == slots + [-1] * (bucket - n)
    for row, seq in enumerate(seqs):
        assert graphs.block_tables[row, : len(seq.block_table)].tolist() == list(seq.block_table)


@pytest.mark.gpu
def test_a_step_launched_ahead_never_waits_for_the_device(checkpoint):
    """On CUDA, the launch of a step ahead (its inputs, the graph's replay, the draw of greedy, temperature, top-k,
    top-p and min-p rows) under torch's sync debug mode set to raise: a sync there would fail the launch, and the
    step would land synchronously instead, which the count of steps ahead shows."""
    llm = engine(checkpoint, "cuda", backend="triton")
    runner, sampler = llm.engine.runner, llm.engine.sampler
    for owner, name in ((runner, "execute_ahead"), (sampler, "on_device")):
        setattr(owner, name, _never_syncing(getattr(owner, name)))
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=1.1, top_p=0.8),
             dict(temperature=0.7, min_p=0.05)]
    work = [(p, SamplingParams(max_tokens=24, seed=3 + i, ignore_eos=True, **kinds[i % 4])) for i, p in enumerate(prompts(8))]
    run(llm, True, work)
    assert llm.engine.counters["num_steps_ahead"] >= 20


def _never_syncing(call):
    def wrapped(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return call(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return wrapped


def test_the_core_in_its_own_process_serves_the_same_with_it_on(checkpoint):
    """As served: the config's flag reaches the core process, whose loop sends a message every step (empty on a step
    that only launched)."""
    work = [(p, greedy(n)) for p, n in zip(prompts(5), [4, 19, 11, 27, 8])]
    reference = run(engine(checkpoint, "cpu"), False, work)
    llm = engine(checkpoint, "cpu", engine_process=True, async_scheduling=True)
    try:
        assert llm.core.settings["async_scheduling"] is True
        outputs = llm.generate([p for p, _ in work], [params for _, params in work], use_tqdm=False)
    finally:
        llm.shutdown()
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [reference[f"r{i}"] for i in range(len(work))]


def test_non_finite_logits_ahead_fail_only_their_request(checkpoint, monkeypatch):
    """A row without a valid distribution in a step launched ahead: its request fails when that step lands (its id
    on the device is a placeholder for the step after), the others get their synchronous tokens."""
    llm = engine(checkpoint, "cpu")
    work = [(p, greedy(14)) for p in prompts(4)]
    reference = run(llm, False, work)
    runner, forward = llm.engine.runner, llm.engine.runner._forward

    def nan_for_one(*args):
        step = forward(*args)
        for row, seq in enumerate(step.seqs):
            if seq.request_id == "r1" and seq.num_output_tokens >= 5:
                step.logits[row] = float("nan")
        return step

    monkeypatch.setattr(runner, "_forward", nan_for_one)
    ahead = llm.engine.counters["num_steps_ahead"]
    llm.engine.async_scheduling = True
    for i, (prompt, params) in enumerate(work):
        llm.add_request(f"r{i}", prompt, params)
    finals = {}
    while llm.has_unfinished_requests():
        finals.update({out.request_id: out for out in llm.step() if out.finished})
    assert llm.engine.counters["num_steps_ahead"] > ahead
    failed = finals["r1"].token_ids  # 5 or 6 tokens: a step launched ahead sees its sequence one token short
    assert "NaN" in finals["r1"].error and 5 <= len(failed) <= 6 and failed == reference["r1"][0][: len(failed)]
    assert {i: (o.token_ids, o.finish_reason) for i, o in finals.items() if i != "r1"} == \
        {i: v for i, v in reference.items() if i != "r1"}
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
