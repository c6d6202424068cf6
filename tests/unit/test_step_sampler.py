"""StepSampler: each logits row gets its own sequence's inputs (drafts add rows; bans hold until min_tokens)."""
import torch

from engine.model_runner import StepLogits
from engine.request_progress import RequestProgress
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_sampler import StepSampler
from engine.thinking_budget import ThinkingBudget, ThinkingCountdown

EOS, STOP, VOCAB = 7, 5, 16


def sequence(request_id: str, params: SamplingParams, outputs: list[int] = ()) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], params)
    seq.token_ids += outputs
    allowed = None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids)
    thinking = ThinkingCountdown(params.thinking_budget, seq.token_ids) if params.thinking_budget else None
    seq.runtime = RequestProgress(None, params.max_tokens, allowed_token_ids=allowed, thinking=thinking)  # greedy
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


def test_a_bad_words_last_token_is_banned_only_where_the_output_ends_with_its_other_tokens():
    words = ((EOS,), (9, 10, 3), (4,))
    params = SamplingParams(temperature=0.0, max_tokens=8, bad_words=["x"], bad_words_token_ids=words)
    prefers = [3, EOS, 4, 6]
    middle, elsewhere, short = (sequence(name, params, outputs=out)
                                for name, out in (("middle", [1, 9, 10]), ("elsewhere", [9, 11]), ("short", [])))
    step = StepLogits([middle, elsewhere, short], logits_preferring(prefers, prefers, prefers), [1, 1, 1], [])
    tokens, _ = StepSampler({0})(step, {})
    assert tokens == [6, 3, 3]  # 9 10 then 3 is the word; one-token words are banned everywhere


def test_allowed_token_ids_limit_a_row_and_not_its_batch_mates():
    only = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[6, 4])
    free = SamplingParams(temperature=0.0, max_tokens=8)
    step = StepLogits([sequence("only", only), sequence("free", free)],
                      logits_preferring([3, 4, 6], [3, 4, 6]), [1, 1], [])
    tokens, _ = StepSampler({EOS})(step, {})
    assert tokens == [4, 3]


def test_a_spent_thinking_budget_forces_its_end_marker_in_its_own_row_only():
    """The prompt [1, 2, 3] opened a section at 2 (marker (2,)) holding one token: a budget of 1 is spent, so the
    end marker's first token (11) is the only one allowed, whatever the logits prefer; a row without one keeps its
    argmax, and so does one whose allowed_token_ids the budget does not touch yet."""
    spent = SamplingParams(temperature=0.0, max_tokens=8, thinking_budget=ThinkingBudget(1, (2,), (11, 12)))
    room = SamplingParams(temperature=0.0, max_tokens=8, thinking_budget=ThinkingBudget(5, (2,), (11, 12)),
                          allowed_token_ids=[3, 4])
    seqs = [sequence("spent", spent), sequence("free", SamplingParams(temperature=0.0, max_tokens=8)),
            sequence("room", room)]
    step = StepLogits(seqs, logits_preferring([9, 11], [9, 11], [9, 4, 3]), [1, 1, 1], [])
    tokens, _ = StepSampler({EOS})(step, {})
    assert tokens == [11, 9, 4]
