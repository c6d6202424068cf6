"""Sampler on synthetic logits: each knob restricts the support as specified; seeds are per request."""
import torch

from engine.sampler import Sampler, inverse_cdf, make_generator
from engine.sampling_params import SamplingParams

VOCAB = 8
LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])


def draws(params: SamplingParams, n=300, logits=LOGITS, history=()):
    sampler, g = Sampler(), make_generator(params, torch.device("cpu"))
    return [sampler(logits, [params], [g], [list(history)])[0][0] for _ in range(n)]


def test_greedy_takes_the_argmax_without_a_generator():
    assert make_generator(SamplingParams(temperature=0.0), torch.device("cpu")) is None
    assert set(draws(SamplingParams(temperature=0.0), n=5)) == {0}


def test_top_k_top_p_and_min_p_restrict_the_support():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=1))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=1))) == {0}  # p(0) = 0.64 already reaches 0.5
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3, seed=1))) == {0, 1}  # p(1)/p(0) = e^-1 >= 0.3 > e^-2


def test_temperature_spreads_the_distribution():
    hot = draws(SamplingParams(temperature=5.0, seed=3), n=500)
    assert len(set(hot)) >= 6
    assert hot.count(0) > hot.count(7)


def test_a_seed_fixes_the_draws_whatever_the_batch_around_it():
    params = SamplingParams(temperature=1.0, seed=42)
    alone = draws(params, n=20)
    sampler = Sampler()
    mine, other = make_generator(params, torch.device("cpu")), make_generator(SamplingParams(temperature=1.0), torch.device("cpu"))
    batch = torch.cat([torch.randn(1, VOCAB), LOGITS])
    in_batch = [sampler(batch, [SamplingParams(temperature=1.0), params], [other, mine], [[], []])[0][1] for _ in range(20)]
    assert alone == in_batch


def test_penalties_push_repeated_tokens_down():
    history = [0, 0, 0, 1]
    assert set(draws(SamplingParams(temperature=0.0, frequency_penalty=1.0), n=3, history=history)) == {1}  # 4-3 < 3-1
    assert set(draws(SamplingParams(temperature=0.0, presence_penalty=1.5), n=3, history=[0])) == {1}  # 4-1.5 < 3


def test_logprobs_are_returned_for_the_chosen_and_top_tokens():
    sampler = Sampler()
    _, logprobs = sampler(LOGITS, [SamplingParams(temperature=0.0, logprobs=2)], [None], [[]])
    entry = logprobs[0]
    assert set(entry) == {0, 1}
    assert abs(sum(torch.tensor(list(entry.values())).exp().tolist()) - 0.9) < 0.05


def test_draws_follow_the_softmax_and_mixed_batches_keep_each_rows_knobs():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=7), n=4000)), minlength=VOCAB)
    expected = torch.softmax(LOGITS[0], -1)
    assert torch.allclose(counts / 4000, expected, atol=0.03), (counts / 4000, expected)
    sampler = Sampler()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2), SamplingParams(temperature=1.0, seed=3)]
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    rows = [sampler(LOGITS.repeat(4, 1), params, gens, [[]] * 4)[0] for _ in range(300)]
    assert {r[0] for r in rows} == {0} and {r[1] for r in rows} == {0, 1} and {r[2] for r in rows} == {0}
    assert len({r[3] for r in rows}) >= 4  # the unrestricted row is not clipped by its neighbours' masks


def test_the_two_level_inverse_cdf_lands_on_the_token_whose_mass_holds_the_draw():
    weights = torch.tensor([[0.0, 1, 0, 0, 0, 0, 2, 0, 0, 1]])  # blocks of 4, then a tail of 2; total 4
    picks = [inverse_cdf(weights, torch.tensor([[u]]), block=4)[0] for u in (1e-6, 0.25, 0.26, 0.75, 0.76, 1.0)]
    assert picks == [1, 1, 6, 6, 9, 9]
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(64, 1000, generator=gen, dtype=torch.float64) * (torch.rand(64, 1000, generator=gen) > 0.7)
    draws = 1.0 - torch.rand(64, 1, generator=gen, dtype=torch.float64)
    reference = torch.searchsorted(weights.cumsum(-1), draws * weights.sum(-1, keepdim=True)).squeeze(1).tolist()
    assert inverse_cdf(weights, draws, block=64) == reference
    assert all(weights[row, token] > 0 for row, token in enumerate(reference))
