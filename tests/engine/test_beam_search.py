"""Beam search (LLM.beam_search) against transformers' own beam search, fp32, on the embedded model: the same beams,
token for token, in the same order."""
import pytest
import torch
from transformers import GenerationConfig

from engine import BeamSearchParams, EngineInputError
from engine.config import DEFAULT_MODEL
from tests.engine.helpers import load_hf_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a dragon"]


@pytest.fixture(scope="module")
def hf_model():
    return load_hf_model(DEFAULT_MODEL)


@pytest.mark.parametrize("width", [1, 3])
def test_beams_are_transformers_beams_token_for_token(llm32, tokenizer, hf_model, width):
    """With no EOS (ours: ignore_eos; HF's: no eos_token_id) every beam runs to max_tokens, so both rank by
    cumulative logprob alone."""
    found = llm32.beam_search(PROMPTS, BeamSearchParams(width, max_tokens=10, ignore_eos=True), use_tqdm=False)
    hf = GenerationConfig(num_beams=width, num_return_sequences=width, max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0, early_stopping=False)
    for prompt, output in zip(PROMPTS, found):
        ids = tokenizer(prompt).input_ids
        with torch.inference_mode():
            reference = hf_model.generate(torch.tensor([ids]), generation_config=hf)
        assert [b.output_token_ids(len(ids)) for b in output.sequences] == [s[len(ids):].tolist() for s in reference]
        assert output.prompt_token_ids == ids and [b.finish_reason for b in output.sequences] == ["length"] * width
        assert [b.text for b in output.sequences] == tokenizer.batch_decode(reference[:, len(ids):],
                                                                            skip_special_tokens=True)
        scores = [b.cum_logprob for b in output.sequences]
        assert scores == sorted(scores, reverse=True) and all(s < 0 for s in scores)
    stats = llm32.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_a_beam_search_of_width_one_is_greedy_decoding(llm32):
    from engine import SamplingParams

    greedy = llm32.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0]
    beam = llm32.beam_search(PROMPTS[0], BeamSearchParams(1, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert beam.sequences[0].output_token_ids(len(beam.prompt_token_ids)) == greedy.token_ids


def test_beams_that_end_at_eos_complete_with_stop(llm32):
    chat = [{"role": "user", "content": "Say yes."}]
    output = llm32.beam_search([chat], BeamSearchParams(2, max_tokens=24, length_penalty=0.0), use_tqdm=False)[0]
    eos = set(llm32.core.limits.eos_token_ids)
    ended = [b for b in output.sequences if b.finish_reason == "stop"]
    assert ended, [b.text for b in output.sequences]  # a short answer ends at EOS well within 24 tokens
    for beam in ended:  # the EOS is not among the tokens (include_stop_str_in_output is off) nor in the text
        assert not eos & set(beam.output_token_ids(len(output.prompt_token_ids))) and "<|im_end|>" not in beam.text


def test_a_prompt_that_leaves_no_room_is_refused_before_any_step(llm32):
    with pytest.raises(EngineInputError) as refused:
        llm32.beam_search(["hi"], BeamSearchParams(2, max_tokens=10**6), use_tqdm=False)
    assert refused.value.param == "max_tokens"
    assert llm32.engine.stats().num_waiting == 0


def test_a_step_the_queue_refuses_leaves_no_beam_running():
    from engine import LLM, EngineOverloadedError

    llm = LLM(dtype="float32", num_kv_blocks=64, max_waiting=3)
    with pytest.raises(EngineOverloadedError):  # 2 prompts x 2 beams: the fourth request of the second step is refused
        llm.beam_search(PROMPTS[:2], BeamSearchParams(2, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.step() == []  # the beams added before the refusal were aborted, not run and reported
    assert not llm.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
