"""Sampler on synthetic logits: each knob restricts the support as specified; seeds are per request."""
import pytest
import torch

from engine.errors import EngineInputError
from engine.sampler import (DRAWS_AHEAD, INVALID_TOKEN, NO_ALLOWED_TOKEN, NUCLEUS_CANDIDATES, GrammarMask, Sampler,
                            inverse_cdf, make_generator, nucleus_threshold_by_candidates)
from engine.sampling_params import SamplingParams

VOCAB = 8
LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])


def draws(params: SamplingParams, n=300, logits=LOGITS, history=()):
    sampler, g = Sampler(), make_generator(params)
    return [sampler(logits, [params], [g], [list(history)])[0][0] for _ in range(n)]


def test_greedy_takes_the_argmax_without_a_generator():
    assert make_generator(SamplingParams(temperature=0.0)) is None
    assert set(draws(SamplingParams(temperature=0.0), n=5)) == {0}


def test_top_k_top_p_and_min_p_restrict_the_support():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=1))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=1))) == {0}  # p(0) = 0.64 already reaches 0.5
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3, seed=1))) == {0, 1}  # p(1)/p(0) = e^-1 >= 0.3 > e^-2


def kept_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus by its definition: a token stays when the mass of the tokens above it is at most top_p."""
    values, order = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, values.cumsum(-1) - values <= top_p)


def test_the_cpu_nucleus_keeps_what_the_sort_keeps_whichever_tier_covers_a_row():
    """Rows the top 64 cover, rows that need the top 1,024 or 4,096, and rows only the sort covers, in one batch
    (distinct values, so the definition names one set)."""
    generator = torch.Generator().manual_seed(5)
    scales = torch.tensor([12.0, 4.0, 2.5, 1.0, 0.2, 12.0, 0.2])[:, None]  # peaked to flat
    probs = (torch.randn(7, 5000, generator=generator, dtype=torch.float64) * scales).softmax(-1).float()
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.9, 0.2, 0.5])[:, None]
    expected = kept_by_sort(probs, top_p)
    tiers = torch.bucketize(expected.sum(-1), torch.tensor(NUCLEUS_CANDIDATES), right=False)
    assert set(tiers.tolist()) == set(range(len(NUCLEUS_CANDIDATES) + 1)), "rows for each tier and for the sort"
    assert torch.equal(probs >= nucleus_threshold_by_candidates(probs, top_p), expected)


def test_candidates_whose_mass_is_exactly_top_p_do_not_cover_the_row():
    """The next token has exactly top_p above it, so it stays: the top 64 alone would drop it."""
    head = torch.full((64,), 1 / 128)
    tail = torch.linspace(2, 1, 100) / torch.linspace(2, 1, 100).sum() * 0.5
    probs = torch.cat([head, tail])[None, :]
    top_p = probs.topk(64).values.sum(-1, keepdim=True)  # the candidates' mass, as the sampler sums it
    kept = probs >= nucleus_threshold_by_candidates(probs, top_p)
    assert int(kept.sum()) == 65 and bool(kept[0, 64])


def test_ties_at_the_nucleus_boundary_are_all_kept():
    """bf16 logits tie often: the rule keeps every token tied with the last one it needs (the CUDA kernel's rule),
    where a sort would keep those before the cut in its own order."""
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    assert bool((probs >= nucleus_threshold_by_candidates(probs, torch.tensor([[0.5]]))).all())
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=4), logits=probs.log())) == {0, 1, 2, 3}


def test_temperature_spreads_the_distribution():
    hot = draws(SamplingParams(temperature=5.0, seed=3), n=500)
    assert len(set(hot)) >= 6
    assert hot.count(0) > hot.count(7)


def test_a_requests_stream_gives_the_draws_one_generator_call_a_token_gives():
    """Drawn DRAWS_AHEAD at a time, the values are those of one torch.rand(1) a token, across chunk boundaries."""
    stream, generator = make_generator(SamplingParams(temperature=1.0, seed=7)), torch.Generator().manual_seed(7)
    count = 3 * DRAWS_AHEAD + 5
    assert [stream.next() for _ in range(count)] == [float(torch.rand(1, generator=generator)) for _ in range(count)]
    assert make_generator(SamplingParams(temperature=1.0)) is None  # unseeded: the sampler's stream, seeded by the OS

    def unseeded_draws(sampler: Sampler) -> list[int]:
        return [sampler(LOGITS, [SamplingParams(temperature=1.0)], [None], [[]])[0][0] for _ in range(30)]

    assert unseeded_draws(Sampler()) != unseeded_draws(Sampler())


def test_a_seed_fixes_the_draws_whatever_the_batch_around_it():
    params = SamplingParams(temperature=1.0, seed=42)
    alone = draws(params, n=20)
    sampler = Sampler()
    mine, other = make_generator(params), make_generator(SamplingParams(temperature=1.0))
    batch = torch.cat([torch.randn(1, VOCAB), LOGITS])
    in_batch = [sampler(batch, [SamplingParams(temperature=1.0), params], [other, mine], [[], []])[0][1] for _ in range(20)]
    assert alone == in_batch


def test_penalties_push_repeated_tokens_down():
    history = [0, 0, 0, 1]
    assert set(draws(SamplingParams(temperature=0.0, frequency_penalty=1.0), n=3, history=history)) == {1}  # 4-3 < 3-1
    assert set(draws(SamplingParams(temperature=0.0, presence_penalty=1.5), n=3, history=[0])) == {1}  # 4-1.5 < 3


def test_logit_bias_moves_tokens_and_bans_and_masks_exclude_them():
    sampler = Sampler()
    greedy = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    assert sampler(LOGITS, [greedy], [None], [[]])[0] == [7]
    assert sampler(LOGITS, [SamplingParams(temperature=0.0, logit_bias={0: -100.0})], [None], [[]])[0] == [1]
    assert sampler(LOGITS, [SamplingParams(temperature=0.0)], [None], [[]], banned_token_ids=[{0, 1}])[0] == [2]
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, [3, 5]] = True
    params = SamplingParams(temperature=1.0, seed=4, logprobs=0)
    g = make_generator(params)
    picks = [sampler(LOGITS, [params], [g], [[]], grammar=GrammarMask([0], allowed)) for _ in range(200)]
    assert {tokens[0] for tokens, _ in picks} == {3, 5}
    token, entry = picks[0][0][0], picks[0][1][0]
    assert entry[token] == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[token]))  # the model's own logprob


def test_a_row_with_nothing_allowed_is_marked_so_and_its_batch_mates_are_not():
    nothing = GrammarMask([0], torch.zeros(1, VOCAB, dtype=torch.bool))
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1)] * 2
        tokens, _ = Sampler()(LOGITS.repeat(2, 1), params, [make_generator(p) for p in params],
                              [[], []], grammar=nothing)
        assert tokens[0] == NO_ALLOWED_TOKEN and 0 <= tokens[1] < VOCAB  # its own masks, not the model, at fault


def test_only_rows_that_need_work_are_copied_and_each_gets_what_it_would_alone():
    """Issue 41 item 5: one grammar row used to push every row of the batch onto the float path."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)
    params = [greedy, greedy, sampled, greedy, greedy, greedy]
    mask = torch.zeros(2, VOCAB, dtype=torch.bool)
    mask[0, 6], mask[1, [1, 2]] = True, True  # rows 1 and 4 have grammars
    sampler = Sampler()
    tokens, _ = sampler(logits, params, [make_generator(p) for p in params], [[]] * 6,
                        grammar=GrammarMask([1, 4], mask), banned_token_ids=[(), (), (), (), (), {0}])
    # the float copy is the sampler's work buffer, sized by the rows copied
    assert sampler.work.shape[0] == 4, "rows 1, 2, 4 and 5 need work; rows 0 and 3 take their argmax"
    argmax = logits.float().argmax(-1).tolist()
    assert tokens[0] == argmax[0] and tokens[3] == argmax[3] and tokens[1] == 6 and tokens[4] in (1, 2)
    alone = Sampler()(logits[2:3], [sampled], [make_generator(sampled)], [[]])[0][0]
    assert tokens[2] == alone, "the sampled row draws as it would alone"
    banned_alone = Sampler()(logits[5:6], [greedy], [None], [[]], banned_token_ids=[{0}])[0][0]
    assert tokens[5] == banned_alone != 0


def test_repetition_penalty_follows_transformers_over_prompt_and_output():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 3
    prompt, output = [3, 4, 4, 9], [9, 20]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    params = SamplingParams(temperature=0.0, repetition_penalty=1.7)
    got = Sampler._apply_penalties(logits.clone(), [params], [output], [prompt])
    torch.testing.assert_close(got, expected)


def test_logprobs_are_returned_for_the_chosen_and_top_tokens():
    sampler = Sampler()
    _, logprobs = sampler(LOGITS, [SamplingParams(temperature=0.0, logprobs=2)], [None], [[]])
    entry = logprobs[0]
    assert set(entry) == {0, 1}
    expected = torch.log_softmax(LOGITS[0], -1)
    assert entry == pytest.approx({0: float(expected[0]), 1: float(expected[1])}, abs=1e-6)


def test_listed_token_ids_take_the_top_ones_place_in_their_order_beside_each_rows_own_choice():
    """vLLM's logprob_token_ids: the chosen token first, then the listed ids in the request's order (one listed
    twice or chosen appears once), raw logprobs; in a batch with top-k rows and rows that ask for nothing."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprob_token_ids=[5, 2, 7]), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprob_token_ids=[3, 3])]
    params[3].logit_bias = {3: 50.0}  # chosen after the bias; its logprob still the model's own
    tokens, logprobs = Sampler()(logits, params, [None] * 4, [[]] * 4)
    expected = torch.log_softmax(logits, -1)
    assert params[0].logprobs == 0 and tokens[3] == 3 and logprobs[2] is None
    assert list(logprobs[0]) == list(dict.fromkeys([tokens[0], 5, 2, 7]))
    assert logprobs[0] == pytest.approx({t: float(expected[0, t]) for t in logprobs[0]}, abs=1e-6)
    assert len(logprobs[1]) in (2, 3) and list(logprobs[3]) == [3]
    assert logprobs[3][3] == pytest.approx(float(expected[3, 3]), abs=1e-6)


@pytest.mark.parametrize("fields,message", [
    (dict(logprob_token_ids=[]), "1 to 128"), (dict(logprob_token_ids=[-1]), "1 to 128"),
    (dict(logprob_token_ids=list(range(129))), "1 to 128"), (dict(logprob_token_ids=[1, 2], logprobs=3), "unset or 2"),
])
def test_listed_token_ids_are_refused_by_name_when_malformed(fields, message):
    with pytest.raises(EngineInputError, match=message) as refused:
        SamplingParams(**fields)
    assert refused.value.param == "logprob_token_ids"
    assert SamplingParams(logprob_token_ids=[1, 2], logprobs=2).logprobs == 2  # vLLM's way: logprobs the same count


def test_draws_follow_the_softmax_and_mixed_batches_keep_each_rows_knobs():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=7), n=4000)), minlength=VOCAB)
    expected = torch.softmax(LOGITS[0], -1)
    assert torch.allclose(counts / 4000, expected, atol=0.03), (counts / 4000, expected)
    sampler = Sampler()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2), SamplingParams(temperature=1.0, seed=3)]
    gens = [make_generator(p) for p in params]
    rows = [sampler(LOGITS.repeat(4, 1), params, gens, [[]] * 4)[0] for _ in range(300)]
    assert {r[0] for r in rows} == {0} and {r[1] for r in rows} == {0, 1} and {r[2] for r in rows} == {0}
    assert len({r[3] for r in rows}) >= 4  # the unrestricted row is not clipped by its neighbours' masks


def test_the_float_copy_is_one_buffer_across_steps_and_grows_with_the_batch():
    sampler, params = Sampler(), SamplingParams(temperature=1.0)  # unseeded: the sampler's stream, fresh each step
    sampler(LOGITS.repeat(4, 1), [params] * 4, [None] * 4, [[]] * 4)
    kept = sampler.work
    rows = [sampler(LOGITS.repeat(2, 1), [params] * 2, [None] * 2, [[]] * 2)[0] for _ in range(50)]
    assert sampler.work is kept  # fewer rows: a view of the same buffer
    drawn = [t for r in rows for t in r]
    # each step copies its own logits in: the last step's weights, read as logits, would draw near uniformly
    assert {0, 1} <= set(drawn) and sum(t >= 5 for t in drawn) < 5, drawn  # p(5, 6, 7) is 0.6%
    sampler(LOGITS.repeat(6, 1), [params] * 6, [None] * 6, [[]] * 6)
    assert sampler.work.shape == (6, VOCAB)


def test_the_rows_settings_are_kept_while_the_rows_stay_and_follow_them_when_one_changes():
    sampler = Sampler()
    wide = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    narrow = [*wide[:3], SamplingParams(temperature=1.0, top_k=2, seed=3)]  # the same rows but the last
    gens = [make_generator(p) for p in narrow]
    sampler(LOGITS.repeat(4, 1), wide, gens, [[]] * 4)
    kept = sampler.columns
    sampler(LOGITS.repeat(4, 1), list(wide), gens, [[]] * 4)
    assert sampler.columns is kept  # the same requests in a new list: not rebuilt
    rows = [sampler(LOGITS.repeat(4, 1), narrow, gens, [[]] * 4)[0] for _ in range(100)]
    assert sampler.columns is not kept and {r[3] for r in rows} == {0, 1}  # top_k 2 holds from its first step
    assert len({r[2] for r in rows}) >= 3
    rows = [sampler(LOGITS.repeat(2, 1), narrow[2:], gens[2:], [[]] * 2)[0] for _ in range(100)]
    assert {r[1] for r in rows} == {0, 1} and len({r[0] for r in rows}) >= 3  # fewer rows: the columns of these


def test_the_two_level_inverse_cdf_lands_on_the_token_whose_mass_holds_the_draw():
    weights = torch.tensor([[0.0, 1, 0, 0, 0, 0, 2, 0, 0, 1]])  # blocks of 4, then a tail of 2; total 4
    picks = [inverse_cdf(weights, torch.tensor([[u]]), block=4)[0].item() for u in (1e-6, 0.25, 0.26, 0.75, 0.76, 1.0)]
    assert picks == [1, 1, 6, 6, 9, 9]
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(64, 1000, generator=gen, dtype=torch.float64) * (torch.rand(64, 1000, generator=gen) > 0.7)
    draws = 1.0 - torch.rand(64, 1, generator=gen, dtype=torch.float64)
    reference = torch.searchsorted(weights.cumsum(-1), draws * weights.sum(-1, keepdim=True)).squeeze(1).tolist()
    tokens, has_mass = inverse_cdf(weights, draws, block=64)
    assert tokens.tolist() == reference and bool(has_mass.all())
    assert all(weights[row, token] > 0 for row, token in enumerate(reference))


# -- extreme logits and parameters: every id is in the vocabulary, or the row is marked invalid ---------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402


SPECIAL = [float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 0.0, 1e-45]
logit_values = st.one_of(st.floats(-1e4, 1e4, allow_nan=False), st.sampled_from(SPECIAL))
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-45, 1e-5), st.floats(1e-5, 1e6)),
    top_p=st.one_of(st.just(1.0), st.floats(1e-6, 1.0)),
    top_k=st.one_of(st.just(-1), st.integers(1, 40)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.01, 2.0)),
    seed=st.integers(-(2**63), 2**64 - 1), logprobs=st.one_of(st.none(), st.integers(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), vocab=st.sampled_from([1, 2, 7, 33, 1500]))
def test_every_sampled_id_is_in_the_vocabulary_whatever_the_logits_and_parameters(data, rows, vocab):
    # a few dozen drawn values over a drawn fill: a row of 1,500 drawn value by value made the test 24 s of the suite
    logits = torch.from_numpy(data.draw(arrays("float64", (rows, vocab), elements=logit_values))).float()
    if data.draw(st.booleans()):
        logits[0] = data.draw(st.sampled_from(SPECIAL))  # a whole row equal (or all NaN / inf)
    params = [data.draw(params_strategy) for _ in range(rows)]
    generators = [make_generator(p) for p in params]
    history = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=5)) for _ in range(rows)]
    tokens, logprobs = Sampler()(logits, params, generators, history)
    assert len(tokens) == rows
    for row, token in enumerate(tokens):
        assert token == INVALID_TOKEN or 0 <= token < vocab, (token, logits[row])
        if not torch.isfinite(logits[row]).all():
            assert token == INVALID_TOKEN, "a row with NaN or inf logits has no distribution to draw from"
        elif token != INVALID_TOKEN and params[row].logprobs is not None:
            assert token in logprobs[row]


def test_finite_rows_always_get_a_token_even_at_extreme_temperatures():
    logits = torch.tensor([[0.0, 0.0, 0.0], [1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]])
    for temperature in (1e-40, 1e-5, 1.0, 1e6):
        params = [SamplingParams(temperature=temperature, seed=s) for s in range(3)]
        tokens, _ = Sampler()(logits, params, [make_generator(p) for p in params], [[], [], []])
        assert all(0 <= t < 3 for t in tokens), (temperature, tokens)
        assert tokens[1] == 0


def test_a_temperature_below_epsilon_is_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-40).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("params, draft", [
    (SamplingParams(temperature=1.0, seed=5), 0),  # the likeliest token proposed
    (SamplingParams(temperature=1.0, seed=6), 4),  # an unlikely one
    (SamplingParams(temperature=0.7, top_k=5, seed=7), 2),
    (SamplingParams(temperature=1.3, top_p=0.9, seed=8), 7),  # a draft outside the nucleus: never accepted
])
def test_verifying_a_draft_keeps_the_rows_distribution(params, draft):
    """Speculative sampling must not change what a sampled request draws: chi-square of 6,000 draws with a draft
    against the row's own distribution (the draws without one), at p < 0.001."""
    n = 6000
    logits = LOGITS.repeat(n, 1)
    sampler = Sampler()
    generator = make_generator(params)
    with_draft = sampler(logits, [params] * n, [generator] * n, [[]] * n, draft_token_ids=[draft] * n)[0]
    plain = sampler(logits, [params] * n, [generator] * n, [[]] * n)[0]
    support = sorted(set(plain))
    expected = {t: plain.count(t) / n for t in support}
    assert set(with_draft) <= set(support), "a draft the row could not produce was accepted"
    chi2 = sum((with_draft.count(t) - n * p) ** 2 / (n * p) for t, p in expected.items())
    critical = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3}[len(support) - 1] if len(support) > 1 else 0
    assert chi2 <= critical, (chi2, expected, {t: with_draft.count(t) / n for t in support})


def test_a_greedy_row_ignores_its_draft_and_an_invalid_row_stays_invalid():
    sampler = Sampler()
    greedy = SamplingParams(temperature=0.0)
    assert sampler(LOGITS, [greedy], [None], [[]], draft_token_ids=[3])[0] == [0]
    params = SamplingParams(temperature=1.0, seed=1)
    nan = torch.full((1, VOCAB), float("nan"))
    assert sampler(nan, [params], [make_generator(params)], [[]], draft_token_ids=[2])[0] == [INVALID_TOKEN]
    banned = SamplingParams(temperature=1.0, seed=1, logit_bias={t: -100 for t in range(VOCAB)})
    tokens = sampler(LOGITS, [banned], [make_generator(banned)], [[]], draft_token_ids=[2],
                     banned_token_ids=[set(range(VOCAB))])[0]
    assert tokens == [NO_ALLOWED_TOKEN], "a row left with nothing to choose does not accept its draft"


def test_a_repetition_penalty_small_enough_to_overflow_the_logits_is_refused_by_name():
    with pytest.raises(EngineInputError, match="repetition_penalty") as refused:
        SamplingParams(repetition_penalty=1.7e-149).validate()
    assert refused.value.param == "repetition_penalty"
    SamplingParams(repetition_penalty=0.01).validate()


def test_prompt_logprobs_in_chunks_equal_one_log_softmax_over_all_rows():
    from engine.sampler import PROMPT_LOGPROB_ROWS

    generator = torch.Generator().manual_seed(0)
    rows = 2 * PROMPT_LOGPROB_ROWS + 37  # three chunks, the last partial
    logits = torch.randn(rows, 50, generator=generator)
    targets = torch.randint(0, 50, (rows,), generator=generator).tolist()
    entries, ranks = Sampler.prompt_logprobs(logits, targets, top=3)
    reference = torch.log_softmax(logits, dim=-1)
    assert len(entries) == rows
    for row in (0, PROMPT_LOGPROB_ROWS - 1, PROMPT_LOGPROB_ROWS, rows - 1):
        best = reference[row].topk(3)
        expected = {targets[row]: reference[row, targets[row]].item(), **dict(zip(best.indices.tolist(), best.values.tolist()))}
        assert entries[row].keys() == expected.keys()
        assert all(abs(entries[row][t] - expected[t]) < 1e-6 for t in expected)
        assert ranks[row] == 1 + int((reference[row] > reference[row, targets[row]]).sum())


@pytest.mark.parametrize("knobs", [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=5, min_p=0.05),
                                   dict(temperature=0.0)])
def test_tokens_left_on_the_device_are_the_tokens_the_sampler_gives(knobs):
    """Async scheduling's draw (no host read) against the sampler's own, seeded alike; rows with a NaN, and all -inf,
    have no valid distribution either way."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 4
    logits[1, 7], logits[3] = float("nan"), float("-inf")
    params = [SamplingParams(**knobs, seed=i) for i in range(5)]
    expected, _ = Sampler()(logits, params, [make_generator(p) for p in params], [[]] * 5)
    got = Sampler().tokens_on_device(logits, params, [make_generator(p) for p in params])
    assert got.tolist() == expected
    assert expected[1] == expected[3] == INVALID_TOKEN and INVALID_TOKEN not in expected[::2]


def test_allowed_token_ids_are_the_only_draws_and_keep_the_models_logprobs():
    params = SamplingParams(temperature=1.0, seed=3, logprobs=0, allowed_token_ids=[2, 6])
    allowed, g = [torch.tensor([2, 6])], make_generator(params)
    picks = [Sampler()(LOGITS, [params], [g], [[]], allowed_token_ids=allowed) for _ in range(300)]
    assert {tokens[0] for tokens, _ in picks} == {2, 6}
    token, entry = picks[0][0][0], picks[0][1][0]
    assert entry[token] == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[token]))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), vocab=st.sampled_from([2, 7, 33]))
def test_a_row_gets_a_token_its_masks_allow_or_no_allowed_token_exactly_when_they_allow_none(data, rows, vocab):
    """Finite logits under allowed ids, bans and a grammar, in any mix: the token is one all three allow, and
    NO_ALLOWED_TOKEN (the client's contradiction, a 400) exactly where they leave none; never INVALID_TOKEN (the
    model's fault, a 500)."""
    logits = torch.tensor([data.draw(st.lists(st.floats(-1e4, 1e4), min_size=vocab, max_size=vocab))
                           for _ in range(rows)])
    params = [data.draw(params_strategy) for _ in range(rows)]
    ids = st.lists(st.integers(0, vocab - 1), max_size=vocab)
    some = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab)
    allowed = [data.draw(st.one_of(st.none(), some.map(lambda t: torch.tensor(sorted(set(t)))))) for _ in range(rows)]
    banned = [set(data.draw(ids)) for _ in range(rows)]
    grammar_rows = sorted(set(data.draw(st.lists(st.integers(0, rows - 1), max_size=rows))))
    grammar_allowed = torch.tensor([data.draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
                                    for _ in grammar_rows], dtype=torch.bool).view(len(grammar_rows), vocab)
    grammar = GrammarMask(grammar_rows, grammar_allowed) if grammar_rows else None
    tokens, _ = Sampler()(logits, params, [make_generator(p) for p in params], [[] for _ in range(rows)],
                          banned_token_ids=banned, grammar=grammar, allowed_token_ids=allowed)
    for row, token in enumerate(tokens):
        may = torch.ones(vocab, dtype=torch.bool)
        if allowed[row] is not None:
            may = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, allowed[row], True)
        may[list(banned[row])] = False
        if row in grammar_rows:
            may &= grammar_allowed[grammar_rows.index(row)]
        if not may.any():
            assert token == NO_ALLOWED_TOKEN, (row, token)
        else:
            assert token != INVALID_TOKEN and 0 <= token < vocab and may[token], (row, token, may)
