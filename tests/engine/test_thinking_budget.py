"""vLLM's thinking_token_budget in the engine: the countdown against a from-scratch definition, and on the embedded
model (fp32) a section's end marker forced once the section holds the budget, whether the prompt or the output
opened it, with speculation and async scheduling too."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams, ThinkingBudget
from engine.config import SpeculativeConfig
from engine.errors import EngineInputError
from engine.thinking_budget import ThinkingCountdown

START, END = (7, 8), (9, 10, 11)


def forced_by_definition(budget: int, prompt: list[int], output: list[int]) -> list[int | None]:
    """Before each output token, the token forced there, where the model picks `output`: a section is open from the
    end of a start marker to the end of an end marker; with `budget` tokens in it and no end yet, the end marker's
    tokens follow one by one."""
    forced, tokens, thought, thinking, at = [], list(prompt), 0, False, -1
    # the prompt's state: its last start marker after its last end marker
    for i in range(len(prompt)):
        if tuple(prompt[max(0, i - 1):i + 1]) == START:
            thinking, thought = True, 0
        elif thinking and tuple(prompt[max(0, i - 2):i + 1]) == END:
            thinking = False
        elif thinking:
            thought += 1
    if thinking and thought >= budget:
        at = 0
    for token in output:  # the model's picks: a forced token takes a pick's place
        forced.append(END[at] if at >= 0 else None)
        tokens.append(forced[-1] if at >= 0 else token)
        if at >= 0:
            at += 1
            if at == len(END):
                thinking, at = False, -1
        elif thinking:
            if tuple(tokens[-3:]) == END:
                thinking = False
            else:
                thought += 1
                if thought >= budget:
                    at = 0
        elif tuple(tokens[-2:]) == START:
            thinking, thought = True, 0
            if budget == 0:
                at = 0
    return forced


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 5), prompt=st.lists(st.sampled_from([1, 7, 8, 9, 10, 11]), max_size=12),
       output=st.lists(st.sampled_from([1, 7, 8, 9, 10, 11]), max_size=40))
def test_the_countdown_forces_what_the_definition_forces(budget, prompt, output):
    countdown = ThinkingCountdown(ThinkingBudget(budget, START, END), prompt)
    want = forced_by_definition(budget, prompt, output)
    tokens = list(prompt)
    for position, token in enumerate(output):
        forced = countdown.forced()
        assert forced == want[position], (position, forced, want)
        free = countdown.free_tokens()  # async scheduling's and drafts' promise: these are the model's
        assert set(want[position:position + free]) <= {None}, (position, free, want)
        token = forced if forced is not None else token  # the sampler allows nothing else
        tokens.append(token)
        countdown.append(tokens)


@pytest.mark.parametrize("fields", [dict(tokens=-1), dict(tokens=True), dict(start=()), dict(end=(1, -2)),
                                    dict(end=tuple(range(65)))])
def test_a_budget_that_cannot_be_is_refused_by_name(fields):
    with pytest.raises(EngineInputError) as refused:
        ThinkingBudget(**{"tokens": 3, "start": START, "end": END, **fields})
    assert refused.value.param == "thinking_token_budget"


@pytest.fixture(scope="module")
def markers(tokenizer):
    return tuple(tokenizer.encode("<think>", add_special_tokens=False)), \
        tuple(tokenizer.encode("</think>", add_special_tokens=False))


def think_prompt(tokenizer, opened: bool) -> list[int]:
    text = "<|im_start|>user\nWhat is 17 times 3? Think first.<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text + ("<think>\n" if opened else ""), add_special_tokens=False)


@pytest.mark.parametrize("budget", [0, 1, 2, 7])
def test_a_section_the_prompt_opens_ends_after_the_budget_then_the_model_answers(llm32, tokenizer, markers, budget):
    start, end = markers
    prompt = think_prompt(tokenizer, opened=True)
    free = llm32.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            thinking_budget=ThinkingBudget(budget, start, end))
    out = llm32.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert prompt[-len(start) - 1:-1] == list(start)  # the section holds the prompt's last token already: "\n"
    left = max(0, budget - 1)
    assert out[:left] == free[:left] and tuple(out[left:left + len(end)]) == end, (out, free)
    continued = llm32.generate([prompt + out[:left + len(end)]], SamplingParams(
        max_tokens=20 - left - len(end), temperature=0.0, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert out[left + len(end):] == continued  # after the end marker the model answers freely


def test_a_section_the_output_opens_is_counted_from_its_start_marker(llm32, tokenizer, markers):
    """The model is made to open a section (its first tokens are forced to the start marker by allowed ids, then
    the prompt is given it whole): the budget counts from the marker's end."""
    start, end = markers
    prompt = think_prompt(tokenizer, opened=False) + list(start)[:-1]
    budget = ThinkingBudget(3, start, end)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, thinking_budget=budget,
                            logit_bias={start[-1]: 100.0})
    out = llm32.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert out[0] == start[-1] and tuple(out[4:4 + len(end)]) == end, out


@pytest.mark.parametrize("options", [dict(speculative=SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=16,
                                                                      weigh_cost=False)),
                                     dict(async_scheduling=True)], ids=["speculative", "async"])
def test_budgets_hold_beside_other_requests_with_speculation_and_async_scheduling(tokenizer, markers, options):
    start, end = markers
    llm = LLM(dtype="float32", num_kv_blocks=256, **options)
    rng = random.Random(3)
    prompts = [think_prompt(tokenizer, opened=rng.random() < 0.7) for _ in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True,
                             thinking_budget=ThinkingBudget(rng.randint(0, 8), start, end) if i % 2 == 0 else None)
              for i in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        if p.thinking_budget is None:
            continue
        countdown = ThinkingCountdown(p.thinking_budget, prompt)
        tokens = list(prompt)
        for token in out.token_ids:
            assert countdown.forced() in (None, token), (out.token_ids, token)
            tokens.append(token)
            countdown.append(tokens)
    blocks = llm.engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_budgets_rows_fly_under_async_scheduling_until_its_forced_token_nears(tokenizer, markers):
    """Under async scheduling a step is launched before the last one's tokens are read; a row with a budget flies
    while neither of its next two tokens can be forced, and lands steps as its end marker nears: the tokens are
    the synchronous steps' (greedy and seeded), and its rows really were launched ahead."""
    start, end = markers
    llm = LLM(dtype="float32", num_kv_blocks=256, async_scheduling=True)
    prompts = [think_prompt(tokenizer, opened=i % 2 == 0) for i in range(4)]
    params = [SamplingParams(max_tokens=28, temperature=0.0 if i < 2 else 0.8, seed=i, ignore_eos=True,
                             thinking_budget=ThinkingBudget(tokens, start, end))
              for i, tokens in enumerate([6, 11, 9, 14])]
    runner, launched = llm.engine.runner, []
    execute_ahead = runner.execute_ahead
    runner.execute_ahead = lambda seqs, *args: launched.append(len(seqs)) or execute_ahead(seqs, *args)
    ahead = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.async_scheduling = False
    assert ahead == [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert launched.count(4) >= 5, launched  # steps of all four rows flew: before their sections' ends neared
    for prompt, p, out in zip(prompts[::2], params[::2], ahead[::2]):  # the prompt opened these sections
        assert tuple(out[p.thinking_budget.tokens - 1:][:len(end)]) == end, out
    blocks = llm.engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_drafts_are_verified_inside_a_section_short_of_its_forced_token(llm32, tokenizer, markers):
    """Speculation inside an open section: a step verifies drafts while none of its tokens could be forced (the
    section's budget left, less one), so the forced end marker lands where it would without drafts."""
    start, end = markers
    llm = LLM(dtype="float32", num_kv_blocks=256, speculative=SpeculativeConfig(
        num_speculative_tokens=4, disable_by_batch_size=16, weigh_cost=False))
    prompt = think_prompt(tokenizer, opened=True)
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                             thinking_budget=ThinkingBudget(tokens, start, end)) for tokens in (3, 12, 20)]
    engine, rooms = llm.engine, []
    draft_room, propose = engine._draft_room, engine.speculator.propose
    engine._draft_room = lambda seq: rooms.append((seq.runtime.thinking.active, draft_room(seq))) or rooms[-1][1]

    def proposing(running, room):  # the step after this verifies each row's drafts and one token more: none forced
        propose(running, room)
        for seq in running:
            assert not seq.draft_token_ids or len(seq.draft_token_ids) < seq.runtime.thinking.free_tokens()

    engine.speculator.propose = proposing
    drafted = [out.token_ids for out in llm.generate([prompt] * 3, params, use_tqdm=False)]
    assert drafted == [out.token_ids for out in llm32.generate([prompt] * 3, params, use_tqdm=False)]
    assert any(active and room > 0 for active, room in rooms), rooms
    assert engine.speculator.counters["spec_draft_tokens"] > 0
    blocks = engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
