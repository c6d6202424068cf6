"""Stops, lengths, seeds and text of the offline API on the embedded model (fp32)."""
import pytest

from engine import SamplingParams
from engine.errors import EngineInputError

CHAT = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


def test_max_tokens_gives_length_and_exact_count(llm32):
    out = llm32.chat([CHAT], SamplingParams(max_tokens=7, temperature=0.0), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7 and out.text


def test_eos_stops_with_stop_and_the_eos_is_counted_but_not_shown(llm32):
    out = llm32.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                     SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm32.engine.eos_token_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_ignore_eos_runs_to_max_tokens(llm32):
    out = llm32.chat([[{"role": "user", "content": "Say hi."}]],
                     SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40


def test_stop_string_truncates_the_text(llm32):
    free = llm32.chat([CHAT], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)[0]
    word = free.text.split()[3]
    out = llm32.chat([CHAT], SamplingParams(max_tokens=40, temperature=0.0, stop=[word]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(word)]


def test_stop_token_ids_stop_on_that_token(llm32):
    free = llm32.chat([CHAT], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]
    target = free.token_ids[5]
    out = llm32.chat([CHAT], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[target]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    assert out.stop_reason == target and free.stop_reason is None


def test_the_core_names_the_stop_token_that_ended_an_output_and_never_an_eos_it_honours(llm32):
    """vLLM's stop_reason comes from the core's own stop check: an EOS listed in stop_token_ids is still an EOS
    (checked first, no reason) unless ignore_eos."""
    question = [[{"role": "user", "content": "What is the capital of France?"}]]
    eos = llm32.chat(question, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0].token_ids[-1]
    listed = SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=[eos])
    ignored = SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=[eos], ignore_eos=True)
    honoured, by_id = llm32.chat(question * 2, [listed, ignored], use_tqdm=False)
    assert (honoured.finish_reason, honoured.stop_reason) == ("stop", None)
    assert (by_id.finish_reason, by_id.stop_reason, by_id.token_ids[-1]) == ("stop", eos, eos)


def test_same_seed_same_text_and_other_seed_other_text(llm32):
    def sample(seed):
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=seed)
        return llm32.chat([CHAT], params, use_tqdm=False)[0].text

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_seeded_output_does_not_depend_on_the_batch_around_it(llm32):
    seeded = SamplingParams(max_tokens=30, temperature=0.8, seed=7)
    alone = llm32.chat([CHAT], seeded, use_tqdm=False)[0].token_ids
    others = [[{"role": "user", "content": f"Tell me about number {i}."}] for i in range(5)]
    params = [SamplingParams(max_tokens=30, temperature=1.0)] * 5 + [seeded]
    batched = llm32.chat(others + [CHAT], params, use_tqdm=False)[-1].token_ids
    assert alone == batched


def test_prompts_as_token_ids_and_text_agree(llm32, tokenizer):
    text = "The quick brown fox"
    params = SamplingParams(max_tokens=8, temperature=0.0)
    by_text, by_ids = llm32.generate([text, tokenizer.encode(text)], params, use_tqdm=False)
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_token_ids == by_ids.prompt_token_ids


def test_text_equals_the_decoded_tokens(llm32, tokenizer):
    out = llm32.chat([CHAT], SamplingParams(max_tokens=50, temperature=0.0), use_tqdm=False)[0]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_logprobs_come_back_per_token(llm32):
    out = llm32.chat([CHAT], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3 and max(entry.values()) == entry[token]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_engine_sets_torch_threads_from_its_config(num_threads):
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    LLMEngine(EngineConfig(num_threads=num_threads, num_kv_blocks=16))
    assert torch.get_num_threads() == num_threads


def test_default_thread_count_is_every_usable_core():
    from engine.config import EngineConfig
    from tests.conftest import nproc

    assert EngineConfig().resolved_num_threads() == nproc()


def test_the_choices_of_one_request_copy_the_prompts_partial_block_and_answer_as_one_would(llm32):
    """n > 1: the siblings find the leader's full prompt blocks in the prefix cache and copy its last, partial one,
    so each computes one prompt token, not the up to 15 of that block; greedy, each answers as the request alone."""
    prompt = llm32.inputs.tokenize(CHAT * 3)
    assert len(prompt) % 16 > 1, len(prompt)  # a partial block with something to copy
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm32.generate([prompt], params, use_tqdm=False)[0].token_ids
    engine = llm32.engine
    computed_before = engine.stats().prompt_tokens
    llm32.add_request("lead", prompt, params)
    for i in range(3):
        llm32.add_request(f"sibling{i}", prompt, params, prompt_leader="lead")
    finals = {}
    while llm32.has_unfinished_requests():
        finals.update((o.request_id, o.token_ids) for o in llm32.step() if o.finished)
    assert all(ids == alone for ids in finals.values()) and len(finals) == 4
    # the leader found its own earlier blocks but the last; each sibling computed only the prompt's last token
    assert engine.stats().prompt_tokens - computed_before == len(prompt) % 16 + 3


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm32):
    ids = llm32.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    (cut,) = llm32.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=5), use_tqdm=False)
    (tail,) = llm32.generate([ids[-5:]], params, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-5:] and cut.token_ids == tail.token_ids
    context = llm32.inputs.limits.max_model_len  # -1: as many as fit beside max_tokens, without running them
    request = llm32.inputs.process("fit", list(range(100, 100 + context + 50)),
                                   SamplingParams(max_tokens=7, truncate_prompt_tokens=-1))
    assert len(request.prompt_token_ids) == context - 7 and request.prompt_token_ids[-1] == 100 + context + 49


def test_truncation_side_right_keeps_the_prompts_first_tokens_instead(llm32):
    ids = llm32.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    (cut,) = llm32.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=5,
                                                  truncation_side="right"), use_tqdm=False)
    (head,) = llm32.generate([ids[:5]], params, use_tqdm=False)
    assert cut.prompt_token_ids == ids[:5] and cut.token_ids == head.token_ids
    with pytest.raises(EngineInputError) as refused:
        SamplingParams(truncate_prompt_tokens=5, truncation_side="middle")
    assert refused.value.param == "truncation_side"


def test_the_priority_policy_serves_lower_values_first_and_fcfs_refuses_any_but_0(llm32):
    from engine import LLM

    llm = LLM(dtype="float32", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outputs = llm.generate(["one", "two", "three", "four"], params, use_tqdm=False, priority=[2, 0, 1, 0])
    order = sorted(range(4), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]
    assert outputs[2].token_ids == llm32.generate(["three"], params, use_tqdm=False)[0].token_ids
    with pytest.raises(EngineInputError) as refused:
        llm32.generate(["one"], params, use_tqdm=False, priority=[1])
    assert refused.value.param == "priority"


def test_a_batch_with_one_refused_prompt_runs_none_of_it(llm32):
    with pytest.raises(EngineInputError):
        llm32.generate(["first", [10 ** 9]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    tokens_before = llm32.engine.stats().generation_tokens
    (after,) = llm32.generate(["third"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert after.num_tokens == 3 and not llm32.has_unfinished_requests()
    assert llm32.engine.stats().generation_tokens - tokens_before == 3  # the first prompt's 50 never ran
