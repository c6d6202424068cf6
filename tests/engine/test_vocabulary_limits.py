"""allowed_token_ids and bad_words on the embedded model in fp32: each greedy token is HF's argmax among the tokens
the rule leaves (teacher-forced), and the rule visibly changed the output."""
import functools

import pytest
import torch

from engine import SamplingParams
from engine.errors import EngineInputError

from tests.engine.helpers import NEAR_TIE, load_hf_model, teacher_forced_logprobs

PROMPT = "The capital of France is Paris. The capital of Italy is"


@functools.cache
def hf_model():
    return load_hf_model("SmolLM2-135M-Instruct")


def assert_best_among(prompt_ids: list[int], output_ids: list[int], allowed_at) -> None:
    """Each output token is HF's argmax (or within NEAR_TIE of it) over the tokens `allowed_at(position)` leaves."""
    reference = teacher_forced_logprobs(hf_model(), prompt_ids, output_ids)
    for position, token in enumerate(output_ids):
        mask = allowed_at(position)
        best = reference[position].masked_fill(~mask, float("-inf")).max()
        assert mask[token] and best - reference[position, token] < NEAR_TIE, (position, token)


def test_allowed_token_ids_give_hfs_best_allowed_token_at_every_step(llm32, tokenizer):
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (unlimited,) = llm32.generate([PROMPT], free, use_tqdm=False)
    allowed = sorted({*tokenizer.encode(" Rome Milan Naples Venice. The capital of", add_special_tokens=False)})
    (limited,) = llm32.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         allowed_token_ids=allowed), use_tqdm=False)
    assert set(limited.token_ids) <= set(allowed) and not set(unlimited.token_ids) <= set(allowed)
    mask = torch.zeros(hf_model().config.vocab_size, dtype=torch.bool)
    mask[allowed] = True
    assert_best_among(limited.prompt_token_ids, limited.token_ids, lambda position: mask)


def test_a_bad_word_never_appears_and_the_output_takes_hfs_next_best_there(llm32, tokenizer):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (unlimited,) = llm32.generate([PROMPT], free, use_tqdm=False)
    word = tokenizer.decode(unlimited.token_ids[:1]).strip()  # the first word the model says
    banned = {tokenizer.encode(" " + word, add_special_tokens=False)[-1], tokenizer.encode(word, add_special_tokens=False)[-1]}
    assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
    (limited,) = llm32.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         bad_words=[word]), use_tqdm=False)
    assert not banned & set(limited.token_ids) and limited.token_ids != unlimited.token_ids
    mask = torch.ones(hf_model().config.vocab_size, dtype=torch.bool)
    mask[sorted(banned)] = False
    assert_best_among(limited.prompt_token_ids, limited.token_ids, lambda position: mask)


def test_a_multi_token_bad_word_bans_only_its_last_token_after_its_first(llm32, tokenizer):
    (unlimited,) = llm32.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                  use_tqdm=False)
    first, second = unlimited.token_ids[:2]
    phrase = tokenizer.decode([first, second])  # the model's first two tokens, as one bad "word"
    (limited,) = llm32.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         bad_words=[phrase]), use_tqdm=False)
    assert limited.token_ids[0] == first and limited.token_ids[1] != second
    vocab = hf_model().config.vocab_size

    def allowed_at(position: int) -> torch.Tensor:
        mask = torch.ones(vocab, dtype=torch.bool)
        if position > 0 and limited.token_ids[position - 1] == first:
            mask[second] = False
        return mask

    assert_best_among(limited.prompt_token_ids, limited.token_ids, allowed_at)


@pytest.mark.parametrize("params,field", [
    (dict(allowed_token_ids=[10 ** 7]), "allowed_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1] * 10 ** 6), "allowed_token_ids"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=["x"] * 129), "bad_words"),
])
def test_limits_that_cannot_be_are_refused_naming_their_field(llm32, params, field):
    with pytest.raises(EngineInputError) as refused:
        llm32.inputs.process("r", PROMPT, SamplingParams(**params))
    assert refused.value.param == field


def test_bad_words_beyond_the_token_budget_are_refused_as_a_list(llm32):
    from engine.sampling_params import MAX_BAD_WORD_TOKENS

    words = ["antidisestablishmentarianism " * 8] * 100  # 256-character words, each many tokens
    with pytest.raises(EngineInputError, match=f"at most {MAX_BAD_WORD_TOKENS} tokens") as refused:
        llm32.inputs.process("r", PROMPT, SamplingParams(bad_words=[w[:256] for w in words]))
    assert refused.value.param == "bad_words"
