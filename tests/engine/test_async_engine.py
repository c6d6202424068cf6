"""AsyncLLMEngine: streams of deltas, abort by close or cancel, bad input that never stops the loop. Every test runs
against both places the core can run: a thread of this process, and a child process of its own."""
import asyncio

import pytest

from engine import AsyncLLMEngine, EngineInputError, SamplingParams

CHAT = [{"role": "user", "content": "Write a long story about a dragon."}]
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", params=[False, True], ids=["core-thread", "core-process"])
def engine(request):
    eng = AsyncLLMEngine(dtype="float32", num_kv_blocks=256, max_num_seqs=16, engine_process=request.param)
    yield eng
    eng.shutdown()


def runner_of(engine):
    """The model runner, to inject failures: only reachable while the core runs in this process."""
    if engine.config.engine_process:
        pytest.skip("failures are injected into the in-process core; the core process runs the same LLMEngine code")
    return engine.core.engine.runner


async def wait_idle(engine, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.has_unfinished_requests():
        assert asyncio.get_running_loop().time() < deadline, engine.stats()
        await asyncio.sleep(0.01)
    return engine.stats()


async def test_stream_deltas_add_up_to_the_offline_result(engine):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = [o async for o in engine.generate(CHAT, params, "stream-1")]
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert sum((o.delta_token_ids for o in outs), []) == outs[-1].token_ids
    assert outs[-1].num_prompt_tokens == len(outs[-1].prompt_token_ids)


async def test_a_reader_that_holds_its_stream_is_woken_less_often_and_a_whole_answer_once(engine):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    every_step = [o async for o in engine.generate(CHAT, params, "unheld")]
    held = []
    async for output in (stream := engine.add_request("held", CHAT, params)):
        held.append(output)
        stream.hold(len(output.token_ids) + 6)  # as a replica's reader does for chunks of 6 tokens
    whole = [o async for o in engine.add_request("whole", CHAT, params, final_only=True)]
    assert len(every_step) == 24 and len(whole) == 1
    assert len(held) <= 24 // 2  # 1 + 23 / 6 chunks, and a few early outputs where a hold came after the next step
    for outputs in (held, whole):
        assert outputs[-1].token_ids == every_step[-1].token_ids and outputs[-1].text == every_step[-1].text
        assert "".join(o.delta_text for o in outputs) == outputs[-1].text


async def test_concurrent_requests_each_get_their_own_answer(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [[{"role": "user", "content": f"Count to {n}."}] for n in range(6)]

    async def run(i):
        return [o async for o in engine.generate(prompts[i], params, f"conc-{i}")][-1]

    together = await asyncio.gather(*(run(i) for i in range(6)))
    alone = [await run(i) for i in range(6)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


async def test_closing_the_stream_aborts_and_frees_blocks(engine):
    stream = engine.add_request("close-me", CHAT, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    await anext(stream)
    await anext(stream)
    await stream.aclose()
    stats = await wait_idle(engine)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0


async def test_cancelling_the_consumer_aborts_the_request(engine):
    async def consume():
        async for _ in engine.generate(CHAT, SamplingParams(max_tokens=500, ignore_eos=True), "cancel-me"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_idle(engine)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_abort_by_id_ends_the_stream_with_abort(engine):
    stream = engine.add_request("abort-me", CHAT, SamplingParams(max_tokens=500, ignore_eos=True))
    await anext(stream)
    await engine.abort("abort-me")
    last = [o async for o in stream][-1]
    assert last.finish_reason == "abort"


BAD = [
    ("", {}, "empty"),
    ([], {}, "empty"),
    ({"text": "hi"}, {}, "prompt must be"),
    ([{"role": "wizard", "content": "hi"}], {}, "role"),
    ([{"role": "user", "content": 3}], {}, "content"),
    ([10**9], {}, "outside the vocabulary"),
    ("x " * 9000, {}, "context"),
    ("hello", {"max_tokens": 0}, "max_tokens"),
    ("hello", {"max_tokens": 10**9}, "exceed"),
    ("hello", {"temperature": -1.0}, "temperature"),
    ("hello", {"top_p": 0.0}, "top_p"),
    ("hello", {"top_p": 1.5}, "top_p"),
    ("hello", {"stop": [""]}, "stop"),
]


@pytest.mark.parametrize("prompt,params,message", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
async def test_bad_input_raises_a_clear_error_and_the_loop_keeps_serving(engine, prompt, params, message):
    with pytest.raises(EngineInputError, match=message):
        engine.add_request("bad", prompt, SamplingParams(**params) if params else SamplingParams())
    outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0))]
    assert outs[-1].finish_reason == "length"


async def test_a_duplicate_request_id_is_refused(engine):
    stream = engine.add_request("dup", CHAT, SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(EngineInputError, match="already in flight"):
        engine.add_request("dup", CHAT, SamplingParams(max_tokens=5))
    await stream.aclose()
    await wait_idle(engine)


async def test_a_transient_step_failure_is_retried_and_a_persistent_one_fails_only_its_request(engine, monkeypatch):
    runner = runner_of(engine)
    original = runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected once")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)
    outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0), "retried")]
    assert outs[-1].finish_reason == "length" and outs[-1].error is None and len(outs[-1].token_ids) == 5

    def broken(*args, **kwargs):
        raise RuntimeError("injected always")

    monkeypatch.setattr(runner, "execute", broken)
    outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0), "victim")]
    assert outs[-1].finish_reason == "abort" and "engine step failed" in outs[-1].error
    monkeypatch.setattr(runner, "execute", original)
    after = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0), "survivor")]
    assert after[-1].finish_reason == "length" and engine.is_running and engine.health_problem() is None


async def test_the_step_loop_thread_uses_the_configured_threads(engine, monkeypatch):
    """OpenMP thread counts are per OS thread and Ray sets OMP_NUM_THREADS=1: the loop thread must claim its own."""
    from tests.conftest import nproc

    outs = [o async for o in engine.generate(CHAT, SamplingParams(max_tokens=2), "threads-1")]
    assert outs[-1].finished
    assert engine.stats().loop_threads == nproc()


async def test_a_stop_string_split_across_tokens_never_leaks_into_a_delta(engine):
    free = [o async for o in engine.generate(CHAT, SamplingParams(max_tokens=40, temperature=0.0), "free-run")]
    tokenizer, ids = engine.inputs.tokenizer, free[-1].token_ids
    # a boundary deep in the text where both neighbouring tokens carry at least three characters
    boundary = next(k for k in range(len(ids) - 2, 4, -1)
                    if len(tokenizer.decode(ids[k - 1:k]).strip()) >= 3 and len(tokenizer.decode(ids[k:k + 1]).strip()) >= 3)
    head = tokenizer.decode(ids[:boundary], skip_special_tokens=True)
    stop = head[-3:] + tokenizer.decode(ids[:boundary + 1], skip_special_tokens=True)[len(head):][:3]
    expected = free[-1].text[: free[-1].text.index(stop)]
    outs = [o async for o in engine.generate(CHAT, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]), "stopped")]
    sent = ""
    for out in outs:
        sent += out.delta_text
        assert expected.startswith(sent), f"a delta showed text past the stop string {stop!r}: {sent!r}"
    assert sent == outs[-1].text == expected and outs[-1].finish_reason == "stop"
    assert len(outs) > 3, "the stream must have delivered several deltas before the stop"


async def test_a_beam_search_gives_the_offline_beams_and_a_cancelled_one_frees_its_blocks(engine, llm32):
    from engine import BeamSearchParams

    params = BeamSearchParams(3, max_tokens=6, ignore_eos=True)
    prompt = engine.inputs.tokenize(CHAT)
    found = await engine.beam_search("beams-1", prompt, params, engine.inputs.tokenizer.decode)
    offline = llm32.beam_search([prompt], params, use_tqdm=False)[0]
    assert [(b.tokens, b.text) for b in found.sequences] == [(b.tokens, b.text) for b in offline.sequences]
    task = asyncio.create_task(engine.beam_search("beams-2", prompt, BeamSearchParams(3, max_tokens=200),
                                                  engine.inputs.tokenizer.decode))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_idle(engine)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
