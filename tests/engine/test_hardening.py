"""The engine defends itself: bad parameters are refused, a failing request fails alone, and a broken or hung
engine says so through health_problem() (the replica's check_health), so Serve can replace it."""
import threading
import time

import pytest

from engine import AsyncLLMEngine, SamplingParams
from engine.errors import EngineInputError

pytestmark = pytest.mark.slow
ORDINARY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_a_tiny_temperature_is_greedy_and_fails_nobody_beside_it(llm32):
    poisoned = SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True)
    outs = llm32.generate(["Hello there"] * 6, [poisoned] + [ORDINARY] * 5, use_tqdm=False)
    assert all(o.error is None and o.finish_reason == "length" and len(o.token_ids) == 8 for o in outs), outs
    assert outs[0].token_ids == outs[1].token_ids  # below the epsilon is greedy, as in vLLM


def test_a_request_whose_forward_fails_fails_alone(llm32, monkeypatch):
    engine = llm32.engine
    execute = engine.runner.execute
    poison = 31999

    def failing_for_one(batch):
        if any(poison in s.token_ids[: s.num_prompt_tokens] for s in batch.seqs):
            raise RuntimeError("this request breaks the forward")
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", failing_for_one)
    failed_before = engine.stats().num_failed_steps
    outs = llm32.generate([[1, 2, poison, 3], "Hello there", "How are you?", [5, 6, 7]], ORDINARY, use_tqdm=False)
    assert outs[0].error and outs[0].finish_reason == "abort"
    assert [o.error for o in outs[1:]] == [None] * 3 and all(len(o.token_ids) == 8 for o in outs[1:])
    assert engine.stats().num_failed_steps == failed_before + 1
    assert engine.consecutive_failed_steps == 0, "the rest of the step ran: the engine is fine"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_restrictions_that_leave_no_token_fail_their_request_by_field_and_no_other(llm32, tokenizer, temperature):
    """Each is valid alone; together, nothing may come next: the client's fault, named (a 400), not the model's (a
    500), and the batch-mates run on."""
    from engine.sampling_params import StructuredOutput

    eos = sorted(llm32.engine.eos_token_ids)
    x = tokenizer.encode("x", add_special_tokens=False)[0]  # no JSON value begins with it
    knobs = dict(max_tokens=8, temperature=temperature, seed=1)
    contradictions = [(SamplingParams(**knobs, allowed_token_ids=eos, min_tokens=2), "allowed_token_ids"),
                      (SamplingParams(**knobs, allowed_token_ids=[x], structured_output=StructuredOutput(
                          json_object=True)), "allowed_token_ids"),
                      (SamplingParams(**knobs, allowed_token_ids=[x], bad_words=["x"]), "allowed_token_ids")]
    params = [p for p, _ in contradictions] + [ORDINARY]
    outs = llm32.generate(["Hello there"] * len(params), params, use_tqdm=False)
    for out, (_, field) in zip(outs, contradictions):
        assert out.finish_reason == "abort" and out.error_param == field and "leave no token" in out.error, out
        assert "NaN" not in out.error
    assert outs[-1].error is None and len(outs[-1].token_ids) == 8


def test_non_finite_logits_fail_only_their_request_and_never_leave_the_vocabulary(llm32, monkeypatch):
    engine = llm32.engine
    execute = engine.runner.execute

    def nan_for_one(batch):
        step = execute(batch)
        step.logits = step.logits.clone()
        for row, seq in enumerate(step.seqs):
            if seq.token_ids[0] == 7:
                step.logits[row] = float("nan")
        return step

    monkeypatch.setattr(engine.runner, "execute", nan_for_one)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    outs = llm32.generate([[7, 8, 9], [7, 8, 9], "Hello there", "Hello there"], [ORDINARY, sampled, ORDINARY, sampled],
                          use_tqdm=False)
    assert outs[0].error and outs[1].error and "NaN" in outs[0].error
    assert outs[2].error is None and outs[3].error is None
    assert all(0 <= t < engine.vocab_size for o in outs for t in o.token_ids)


@pytest.mark.parametrize("changes, param", [
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("inf")), "top_p"), (dict(stop=["x" * 257]), "stop"), (dict(max_tokens=True), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature="hot"), "temperature"),
])
def test_absurd_sampling_parameters_are_refused_naming_the_field(changes, param):
    with pytest.raises(EngineInputError) as info:
        SamplingParams(**changes)
    assert info.value.param == param and param in str(info.value)


def test_text_that_cannot_fit_or_is_not_unicode_is_refused_before_tokenizing(llm32):
    with pytest.raises(EngineInputError, match="characters") as info:
        llm32.add_request("long", "a" * (llm32.inputs.max_prompt_chars + 1), ORDINARY)
    assert info.value.param == "prompt"
    with pytest.raises(EngineInputError, match="surrogate") as info:
        llm32.add_request("surrogate", [{"role": "user", "content": "hi \ud800"}], ORDINARY)
    assert info.value.param == "messages[0].content"
    with pytest.raises(EngineInputError, match="cache_salt"):
        llm32.add_request("salt", "hi", ORDINARY, cache_salt="")


def test_max_tokens_limit_caps_the_default_and_refuses_more(llm32, monkeypatch):
    monkeypatch.setattr(llm32.inputs, "config", llm32.engine.config.model_copy(update={"max_tokens_limit": 5}))
    with pytest.raises(EngineInputError, match="at most 5") as info:
        llm32.add_request("over", "hi", SamplingParams(max_tokens=6))
    assert info.value.param == "max_tokens"
    (out,) = llm32.generate(["hi"], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_a_broken_decode_path_counts_against_the_engine_under_steady_traffic(llm32, monkeypatch):
    """Issue 41 item 8: each step, the decoding requests failed while a newcomer's prefill passed alone, and that
    success reset the count, so a replica failing every request stayed healthy."""
    engine = llm32.engine
    execute = engine.runner.execute

    def decode_broken(batch):
        if any(seq.num_output_tokens for seq in batch.seqs):
            raise RuntimeError("the decode path is broken")
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", decode_broken)
    failed = []
    for i in range(4):  # a new request arrives before every step
        llm32.add_request(f"steady-{i}", f"request number {i}", ORDINARY)
        failed += [out.request_id for out in llm32.step() if out.error]
    assert failed == ["steady-0", "steady-1", "steady-2"]
    assert engine.consecutive_failed_steps == 3
    monkeypatch.setattr(engine.runner, "execute", execute)
    while llm32.has_unfinished_requests():
        llm32.step()
    assert engine.consecutive_failed_steps == 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


async def test_repeated_failed_steps_and_a_hung_step_make_the_engine_unhealthy():
    engine = AsyncLLMEngine(dtype="float32", num_kv_blocks=64, max_consecutive_failed_steps=2, step_timeout_s=0.5)
    try:
        assert engine.health_problem() is not None  # not started: no loop
        engine.start()
        assert engine.health_problem() is None
        release = threading.Event()
        real = engine.core.engine.runner.execute

        def broken(batch):
            raise RuntimeError("device lost")

        engine.core.engine.runner.execute = broken
        for i in range(2):  # nothing in these steps could run: they count against the engine
            outs = [o async for o in engine.generate(f"request {i} and more", ORDINARY)]
            assert outs[-1].error
        assert "2 engine steps in a row failed" in engine.health_problem()

        def hung(batch):
            release.wait(30)
            return real(batch)

        engine.core.engine.runner.execute = hung
        stream = engine.add_request("hung", "Hello", ORDINARY)
        deadline = time.monotonic() + 10
        while "has run for" not in (engine.health_problem() or "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "has run for" in engine.health_problem()
        release.set()
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "length"
        assert engine.health_problem() is None  # a clean step clears both
    finally:
        release.set()
        engine.shutdown()
