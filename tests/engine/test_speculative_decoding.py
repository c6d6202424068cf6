"""N-gram speculative decoding on the embedded model in fp32: output equal to decoding without it, token for token,
in plain, preemption, prefix-hit and chunked-prefill configurations, with drafts really accepted in each."""
import pytest

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig

TEXT = ("The committee met on Tuesday in Lisbon. Maria Santos presented the budget, which rose by twelve percent, "
        "and Tom Becker asked for a delay of the harbour project until the spring of next year.")
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
CHATS = [
    [{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}"}],
    [{"role": "user", "content": f"List every person named in this text, with what they did:\n{TEXT}"}],
    [{"role": "user", "content": f"Add type hints to this function and return the whole function:\n{CODE}"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Summarise this in one sentence:\n" + " ".join([TEXT] * 4)}],  # long: chunked
]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)
SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=16, weigh_cost=False)  # drafts, timing aside


@pytest.fixture(scope="module")
def reference(llm32):
    return llm32.chat(CHATS, GREEDY, use_tqdm=False)


def assert_same(outs, reference):
    for out, ref in zip(outs, reference):
        assert out.error is None
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_speculation_changes_no_token_and_copies_are_accepted(reference):
    llm = LLM(dtype="float32", num_kv_blocks=512, speculative=SPEC)
    outs = llm.chat(CHATS, GREEDY, use_tqdm=False)
    assert_same(outs, reference)
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens >= 20, stats
    assert stats.num_steps < 48, "accepted drafts take steps away"
    again = llm.chat(CHATS, GREEDY, use_tqdm=False)  # now every prompt's blocks are cached
    assert_same(again, reference)
    assert llm.engine.stats().prefix_cache_hits > stats.prefix_cache_hits


def test_speculation_under_preemption_and_chunked_prefill_changes_no_token(reference):
    llm = LLM(dtype="float32", num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, speculative=SPEC)
    outs = llm.chat(CHATS, GREEDY, use_tqdm=False)
    assert_same(outs, reference)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0, stats
    assert max(len(o.prompt_token_ids) for o in outs) > 64, "a prompt was prefilled in chunks"


def test_logprobs_stops_and_lengths_hold_under_speculation(llm32):
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, stop=["Becker"])
    ref = llm32.chat(CHATS[:1], params, use_tqdm=False)[0]
    llm = LLM(dtype="float32", num_kv_blocks=128, speculative=SPEC)
    out = llm.chat(CHATS[:1], params, use_tqdm=False)[0]
    assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    assert ref.finish_reason == "stop", "the stop string fell inside the copied text"
    for mine, theirs in zip(out.logprobs, ref.logprobs):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    assert llm.engine.stats().spec_accepted_tokens > 0
    sampled = llm.chat(CHATS[:2], SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
                       use_tqdm=False)
    assert all(o.error is None and len(o.token_ids) == 24 for o in sampled)


def test_by_default_drafts_are_weighed_against_measured_step_costs(reference):
    llm = LLM(dtype="float32", num_kv_blocks=128, speculative=SpeculativeConfig())
    assert_same(llm.chat(CHATS[:1], GREEDY, use_tqdm=False), reference[:1])
    timed = llm.engine.speculator.costs.seconds
    assert 1 in timed, "the plain decode step is timed before any draft"
    assert len(timed) > 1, "a row count not timed yet is tried once"
