"""StepSampler: each logits row gets its own sequence's inputs (drafts add rows; bans hold until min_tokens)."""
from types import SimpleNamespace

import torch

from engine.model_runner import StepLogits
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_sampler import StepSampler

EOS, STOP, VOCAB = 7, 5, 16


def sequence(request_id: str, params: SamplingParams, outputs: list[int] = ()) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], params)
    seq.token_ids += outputs
    seq.runtime = SimpleNamespace(generator=None, grammar=None)  # greedy rows draw nothing; no grammar
    return seq


def logits_preferring(*orders: list[int]) -> torch.Tensor:
    """One row per order: the first token scores highest, then the next, and so on."""
    logits = torch.zeros(len(orders), VOCAB)
    for row, order in enumerate(orders):
        for rank, token in enumerate(order):
            logits[row, token] = 10.0 - rank
    return logits


def test_eos_and_stop_ids_are_banned_until_min_tokens():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[STOP], max_tokens=8)
    early, late = sequence("early", params, outputs=[9]), sequence("late", params, outputs=[9, 9])
    step = StepLogits([early, late], logits_preferring([EOS, STOP, 3], [EOS, STOP, 3]), [1, 1], [])
    tokens, _ = StepSampler({EOS})(step, {})
    assert tokens == [3, EOS]


def test_ignore_eos_still_bans_stop_ids_before_min_tokens():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[STOP], ignore_eos=True, max_tokens=8)
    step = StepLogits([sequence("a", params)], logits_preferring([STOP, EOS, 3]), [1], [])
    assert StepSampler({EOS})(step, {})[0] == [EOS]


def test_a_sequence_with_drafts_gets_one_row_per_draft_and_a_bonus_row():
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    drafting, plain = sequence("drafting", greedy), sequence("plain", greedy)
    logits = logits_preferring([11], [12], [13], [14])
    step = StepLogits([drafting, plain], logits, [3, 1], [])
    tokens, logprobs = StepSampler({EOS})(step, {"drafting": [11, 4]})
    assert tokens == [11, 12, 13, 14]  # greedy rows keep their argmax, draft or not
    assert logprobs == [None] * 4
