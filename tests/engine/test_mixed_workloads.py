"""Random mixes of the per-request features, served together under pressure (a KV pool small enough to preempt,
prefill in chunks of 32 tokens, prompts sharing prefixes, siblings of n > 1, tenants' cache salts, embedding requests,
aborts mid-flight, async scheduling off and on; on CUDA, decode in graphs), give each request what it gets served
alone (fp32: its tokens, finish reason, text, logprobs and embedding) and leave every KV block free: no request's
features, and no other request's, change what it gets."""
import asyncio
import math
import random
import time

import pytest

from engine import LLM, AsyncLLMEngine, BeamSearchParams, PoolingParams, SamplingParams
from engine.config import LoRAModule, SpeculativeConfig
from engine.repetition import RepetitionDetection
from engine.sampling_params import StructuredOutput
from tests.fixtures.lora_adapters import make_adapter
from tests.fixtures.tiny_models import tiny_checkpoint

pytestmark = pytest.mark.slow
VOCAB, FIRST_PLAIN_ID = 4096, 100  # the synthetic tokenizer's; ids below 100 hold its special and byte tokens
HOT = list(range(FIRST_PLAIN_ID, FIRST_PLAIN_ID + 4))  # ids that biases make likely and stop ids and bans name, so
                                                     # that a ban or stop given to the wrong row changes an output
# fixed mixes: every greedy choice in them wins by at least 8e-4 in the processed logits, where fp32's rounding
# across batch shapes moves them ~1e-5, so no machine's rounding flips one (a random mix can hold a closer tie: one
# of 150 tried did; and unnormalized embeddings of values ~3 move by up to ~3e-5)
REQUESTS, WORKLOADS = 24, (11, 23, 37, 41, 59, 73)
# a pool of 12 blocks of 16 (a mix preempts), 8 rows, prefill in chunks of 32 tokens
PRESSED = dict(dtype="float32", num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=32)
DRAFTED_WORKLOADS = (11, 23, 59, 73)  # those where n-gram drafts confirm some tokens (none do in 37 and 41)
STOPS = ["e", "in", "or", "s "]
REGEXES = [r"[a-z ]{1,30}", r"(yes|no)( [0-9]{1,3}){0,6}"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("mixed"), "llama-hd64")


@pytest.fixture(scope="module")
def alone():
    """By checkpoint, device, workload and adapters, each request served one at a time, in a pool that never
    preempts and without speculation: what it gets alone. Filled as the cases ask."""
    found, engines = {}, {}

    def served_alone(checkpoint: str, device: str, seed: int, adapters: tuple = ()) -> dict[str, tuple]:
        if (checkpoint, device, seed, adapters) not in found:
            if (checkpoint, device, adapters) not in engines:
                engines[checkpoint, device, adapters] = LLM(model=checkpoint, dtype="float32", device=device,
                                                            num_kv_blocks=256, max_num_seqs=1, lora_modules=adapters)
            llm = engines[checkpoint, device, adapters]
            found[checkpoint, device, seed, adapters] = {
                request[0]: serve(llm, [alone_request(*request)], {})[request[0]]
                for request in workload(seed, adapters)}
        return found[checkpoint, device, seed, adapters]
    return served_alone


def workload(seed: int, adapters: tuple = ()) -> list[tuple[str, list[int], SamplingParams | None, dict]]:
    """(request id, prompt, params, add_request's other arguments): generations with random features, some of them
    the siblings an n > 1 request's choices are (the prompt of the request before, which they name as leader), some
    under a tenant's cache salt, and embedding requests among them; with `adapters`, each generation names one of
    them or none (a sibling its leader's), and some generations a repetition rule or logprob_token_ids, each drawn
    apart so the rest of the mix is the same."""
    rng, pick_adapter, rules = random.Random(seed), random.Random(-seed).choice, random.Random(seed + 11)
    labels = random.Random(seed + 13)
    prefixes = [[rng.randrange(FIRST_PLAIN_ID, VOCAB) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    requests = []
    for i in range(REQUESTS):
        shared = rng.choice(prefixes)[: rng.randint(0, 60)] if rng.random() < 0.6 else []
        prompt = shared + [rng.randrange(FIRST_PLAIN_ID, VOCAB) for _ in range(rng.randint(1, 20))]
        extra = {"cache_salt": rng.choice([None, None, "tenant-a", "tenant-b"])}
        kind = rng.random()
        if kind < 0.15:
            requests.append((f"r{i}", prompt, None, {**extra, "pooling": PoolingParams(normalize=rng.random() < 0.5)}))
            continue
        if kind < 0.35 and requests and requests[-1][2] is not None:
            leader, prompt, _, extra = requests[-1]
            extra = {**extra, "prompt_leader": leader}
        elif adapters:
            extra["lora_name"] = pick_adapter([None, *(adapter.name for adapter in adapters)])
        rule = RepetitionDetection(rules.randint(1, 4), 1, rules.randint(2, 3)) if rules.random() < 0.35 else None
        listed = labels.sample(range(VOCAB), labels.randint(1, 5)) if labels.random() < 0.15 else None
        requests.append((f"r{i}", prompt, random_params(rng, rule, listed), extra))
    return requests


def random_params(rng: random.Random, repetition: RepetitionDetection | None,
                  logprob_token_ids: list[int] | None = None) -> SamplingParams:
    chance = rng.random
    max_tokens = rng.randint(1, 40)
    extra = {}
    if chance() < 0.4:  # sampled, seeded (reproducible alone and in any batch); else greedy
        extra.update(temperature=rng.uniform(0.5, 1.3), seed=rng.randrange(2**31), top_p=rng.choice([1.0, 0.9, 0.6]),
                     top_k=rng.choice([-1, 5, 40]), min_p=rng.choice([0.0, 0.05]))
    else:
        extra["temperature"] = 0.0
    if chance() < 0.3:
        extra["logprobs"] = rng.randint(0, 4)
    if chance() < 0.2:
        extra["prompt_logprobs"] = rng.randint(0, 2)
    if chance() < 0.3:
        extra.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1))
    if chance() < 0.3:
        extra["repetition_penalty"] = rng.uniform(0.8, 1.3)
    hot = rng.sample(HOT, 2)
    if chance() < 0.4:
        extra["logit_bias"] = {**{rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(2)},
                               **{token: rng.uniform(10, 30) for token in hot}}
    if chance() < 0.4:
        extra["min_tokens"] = rng.randint(0, min(8, max_tokens))
    if chance() < 0.3:
        extra["stop"] = [rng.choice(STOPS)]
    if chance() < 0.4:
        extra["stop_token_ids"] = [hot[0]]
    if chance() < 0.15:
        extra["bad_words"] = rng.sample(["the", " and", "ing", " of"], 2)
    kind = chance()
    if kind < 0.15:
        extra["structured_output"] = StructuredOutput(regex=rng.choice(REGEXES), param="structured_outputs")
    elif kind < 0.25:
        extra["allowed_token_ids"] = rng.sample(range(FIRST_PLAIN_ID, VOCAB), 20)
    if logprob_token_ids is not None:
        extra.update(logprobs=None, logprob_token_ids=logprob_token_ids)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=chance() < 0.5, repetition_detection=repetition, **extra)


def alone_request(request_id: str, prompt: list[int], params: SamplingParams | None, extra: dict) -> tuple:
    """The request without its leader, which is not there when it runs alone."""
    return request_id, prompt, params, {name: value for name, value in extra.items() if name != "prompt_leader"}


def final_tuple(out) -> tuple:
    """A finished output as the tests compare it."""
    return (out.live_token_ids[: out.num_tokens], out.finish_reason, out.text, out.logprobs, out.prompt_logprobs,
            out.num_cached_tokens, out.embedding)


def serve(llm: LLM, requests: list, aborts: dict[int, str]) -> dict[str, tuple]:
    """Each request's (token ids, finish reason, text, logprobs, prompt logprobs, cached prompt tokens, embedding);
    `aborts`: step -> request id."""
    for request_id, prompt, params, extra in requests:
        llm.add_request(request_id, prompt, params, **extra)
    finals, step = {}, 0
    while llm.has_unfinished_requests():
        if step in aborts:
            llm.abort(aborts[step])
        for out in llm.step():
            if out.finish_reason is not None:
                assert out.error is None, (out.request_id, out.error)
                finals[out.request_id] = final_tuple(out)
        step += 1
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "KV blocks left held"
    return finals


def assert_close(got: list | None, want: list | None, label: str) -> None:
    assert (got is None) == (want is None), label
    for position, (g, w) in enumerate(zip(got or (), want or ())):
        assert (g is None) == (w is None) and set(g or ()) == set(w or ()), (label, position)
        assert all(math.isclose(g[t], w[t], rel_tol=1e-4, abs_tol=1e-4) for t in g or ()), (label, position, g, w)
    assert len(got or ()) == len(want or ()), label


def assert_served_as_alone(served: dict[str, tuple], want_all: dict[str, tuple], aborted: set[str]) -> None:
    assert set(served) == set(want_all)  # every request ended, aborted ones included
    for request_id, (tokens, reason, text, logprobs, prompt_logprobs, _, embedding) in served.items():
        want = want_all[request_id]
        if reason == "abort":
            assert request_id in aborted and tokens == want[0][: len(tokens)], request_id
            continue
        assert (tokens, reason, text) == want[:3], request_id
        assert (embedding is None) == (want[6] is None), request_id
        if embedding is not None:
            assert all(math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-4) for g, w in zip(embedding, want[6])), request_id
        assert_close(logprobs, want[3], f"{request_id} logprobs")
        assert_close(prompt_logprobs, want[4], f"{request_id} prompt logprobs")


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", WORKLOADS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_request_gets_what_it_gets_alone_whatever_runs_beside_it(checkpoint, alone, device, seed,
                                                                      async_scheduling):
    want_all = alone(checkpoint, device, seed)
    llm = LLM(model=checkpoint, device=device, **PRESSED)
    llm.engine.async_scheduling = async_scheduling
    rng = random.Random(seed)
    aborted = {rng.randint(2, 30): f"r{i}" for i in rng.sample(range(REQUESTS), 2)}
    served = serve(llm, workload(seed), aborted)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool never ran short: nothing was preempted"
    assert any(cached for *_, cached in served.values()), "no prompt found another's blocks"
    assert any(reason == "repetition" for _, reason, *_ in served.values()), "no output ended in a repeated pattern"
    assert_served_as_alone(served, want_all, set(aborted.values()))


@pytest.mark.parametrize("seed", DRAFTED_WORKLOADS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_speculation_beside_every_feature_leaves_greedy_output_as_it_is_alone(checkpoint, alone, device, seed):
    """N-gram drafts for the rows that may take them, in the same mixes: a greedy request's tokens are its own
    without speculation (a sampled one's are drawn by the rule that keeps its distribution, not its draws). On this
    model most drafts are wrong and some right: a wrong one taken for right changes a greedy output."""
    want_all = alone(checkpoint, device, seed)
    speculative = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=8,
                                    weigh_cost=False)  # drafts wherever a match exists, timing aside
    llm = LLM(model=checkpoint, device=device, speculative=speculative, **PRESSED)
    requests = workload(seed)
    served = serve(llm, requests, {})
    assert llm.engine.stats().spec_accepted_tokens > 0, "no draft was accepted"
    params = {request[0]: request[2] for request in requests}
    for request_id, (tokens, reason, text, logprobs, *_) in served.items():
        if params[request_id] is not None and params[request_id].temperature == 0.0:
            assert (tokens, reason, text) == want_all[request_id][:3], request_id
            assert_close(logprobs, want_all[request_id][3], f"{request_id} logprobs")


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> tuple[LoRAModule, ...]:
    """Two PEFT adapters of the checkpoint: every projection at rank 8, and q and v at rank 4 with rsLoRA's scale."""
    pytest.importorskip("peft", reason="peft is not installed (a GPU machine has it where make gpu-wheels shipped it)")
    root = tmp_path_factory.mktemp("mixed-lora")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return (LoRAModule(name="every", path=make_adapter(checkpoint, root / "every", 0, r=8, lora_alpha=16,
                                                       target_modules=every)),
            LoRAModule(name="qv", path=make_adapter(checkpoint, root / "qv", 1, r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "v_proj"], use_rslora=True)))


@pytest.mark.parametrize("seed", WORKLOADS[:3])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_adapters_in_the_same_mixes_change_only_the_requests_that_name_them(checkpoint, adapters, alone, device,
                                                                            seed):
    """Each generation runs on the adapter it names or on none, in batches that hold all three, and its prompt's
    blocks serve its own adapter only: each gets what it gets alone."""
    want_all = alone(checkpoint, device, seed, adapters)
    llm = LLM(model=checkpoint, device=device, lora_modules=adapters, **PRESSED)
    served = serve(llm, workload(seed, adapters), {})
    assert llm.engine.scheduler.num_preemptions > 0, "the pool never ran short: nothing was preempted"
    assert_served_as_alone(served, want_all, set())


async def serve_concurrently(engine: AsyncLLMEngine, requests: list, aborted: set[str]) -> dict[str, tuple]:
    """Every request as its own stream, as served clients send them; those in `aborted` are aborted after their
    first output. Each request's last output, as `serve` gives it."""
    async def one(request_id: str, prompt: list[int], params: SamplingParams | None, extra: dict):
        last = None
        async for out in engine.add_request(request_id, prompt, params, **extra):
            assert out.error is None, (request_id, out.error)
            if last is None and request_id in aborted:
                await engine.abort(request_id)
            last = out
        return request_id, final_tuple(last)

    return dict(await asyncio.gather(*(one(*request) for request in requests)))


def test_through_a_core_process_each_request_gets_what_it_gets_alone(checkpoint, alone):
    """A mix as concurrent streams into an engine core in its own process (how a Serve replica runs it), two beam
    searches among them: every field crosses the process boundary intact, the two longest generations are aborted
    after their first output, each beam search finds the beams it finds alone, and every block is free afterwards."""
    seed = WORKLOADS[0]
    want_all, requests = alone(checkpoint, "cpu", seed), workload(seed)
    longest = sorted((request for request in requests if request[2] is not None), key=lambda r: -r[2].max_tokens)
    aborted = {request[0] for request in longest[:2]}
    beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    beam_prompts = [requests[0][1], requests[1][1]]
    want_beams = LLM(model=checkpoint, dtype="float32", num_kv_blocks=256).beam_search(beam_prompts, beams,
                                                                                       use_tqdm=False)

    async def run() -> tuple[dict[str, tuple], list, object]:
        engine = AsyncLLMEngine(model=checkpoint, engine_process=True, **PRESSED)
        try:
            searches = [engine.beam_search(f"beam-{i}", prompt, beams, lambda tokens: "")
                        for i, prompt in enumerate(beam_prompts)]
            served, *found = await asyncio.gather(serve_concurrently(engine, requests, aborted), *searches)
            deadline = time.monotonic() + 30
            while (stats := engine.stats()).kv_blocks_free < stats.kv_blocks_total:  # aborts free on the next step
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
            return served, found, stats
        finally:
            engine.shutdown()

    served, found, stats = asyncio.run(run())
    assert stats.num_preemptions > 0, "the pool never ran short: nothing was preempted"
    assert {served[request_id][1] for request_id in aborted} == {"abort"}
    assert_served_as_alone(served, want_all, aborted)
    for got, want in zip(found, want_beams):
        assert [beam.tokens for beam in got.sequences] == [beam.tokens for beam in want.sequences]
        assert all(math.isclose(g.cum_logprob, w.cum_logprob, rel_tol=1e-4, abs_tol=1e-4)
                   for g, w in zip(got.sequences, want.sequences))


def random_configuration(rng: random.Random, checkpoint: str) -> dict:
    """An engine configuration the mixes fit: any block size, pool, batch, budget, cache, policy, backend, dtype."""
    block = rng.choice([8, 16, 32])
    return dict(model=checkpoint, dtype=rng.choice(["float32", "float32", "bfloat16"]), block_size=block,
                num_kv_blocks=rng.choice([150, 200, 300]) // block, max_num_seqs=rng.choice([1, 2, 8]),
                max_num_batched_tokens=max(block, rng.choice([8, 16, 64])), enable_prefix_caching=rng.random() < 0.7,
                scheduling_policy=rng.choice(["fcfs", "priority"]),
                attention_backend=rng.choice(["torch", "cpp", "auto"]))


@pytest.mark.long
@pytest.mark.parametrize("seed", range(1000, 1100))
def test_random_configurations_serve_random_mixes(checkpoint, alone, seed):
    """A hundred random configurations, each under its own random mix with random priorities and three aborts: no
    request errs, every request ends and every block frees; in fp32, each request gets what it gets alone. (The
    configurations' rounding differs from the alone engine's: a mix can meet a near-tie; none of these do.)"""
    rng = random.Random(seed * 31)
    config = random_configuration(rng, checkpoint)
    llm = LLM(**config)
    llm.engine.async_scheduling = rng.random() < 0.5
    requests = workload(seed)
    if config["scheduling_policy"] == "priority":
        requests = [(*request[:3], {**request[3], "priority": rng.randint(-3, 3)}) for request in requests]
    aborted = {rng.randint(1, 40): f"r{i}" for i in rng.sample(range(REQUESTS), 3)}
    served = serve(llm, requests, aborted)
    assert set(served) == {request[0] for request in requests}
    if config["dtype"] == "float32":
        assert_served_as_alone(served, alone(checkpoint, "cpu", seed), set(aborted.values()))
