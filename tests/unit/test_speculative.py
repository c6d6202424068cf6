"""N-gram proposals and the acceptance bookkeeping of speculative decoding (pure logic)."""
from engine.config import SpeculativeConfig
from engine.draft_stats import DraftStats
from engine.speculative import StepCosts, accepted_length, expected_accepted, propose_ngram


def propose(tokens, k=3, min_n=1, max_n=3, window=1000):
    return propose_ngram(tokens, k, min_n, max_n, window)


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_suffix_are_proposed():
    assert propose([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3]) == [4, 6, 7]  # latest of the two "2 3"s
    assert propose([1, 2, 3, 4, 5, 1, 2], k=2) == [3, 4]


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    # "7 8 9" occurred once, early; "8 9" alone occurred later, followed by something else
    assert propose([7, 8, 9, 1, 2, 8, 9, 5, 5, 7, 8, 9]) == [1, 2, 8]


def test_nothing_is_proposed_without_an_earlier_occurrence_or_below_the_minimum_length():
    assert propose([1, 2, 3, 4]) == []
    assert propose([5, 1, 2, 5], min_n=2) == []  # only a one-token suffix ("5") occurred before
    assert propose([5, 1, 2, 5], min_n=1) == [1, 2, 5]
    assert propose([]) == [] and propose([3]) == []


def test_a_match_must_fall_on_token_boundaries():
    # as 4-byte little-endian ints, 256 = 00 01 00 00 and 1 = 01 00 00 00: the bytes of "256, 1" contain those of
    # "1, 0" shifted by one byte, which a byte search alone would take for a match
    assert propose([256, 1, 9, 1, 0], min_n=2, max_n=2) == []
    assert propose([1, 0, 4, 1, 0], min_n=2, max_n=2) == [4, 1, 0]


def test_only_the_window_is_searched_and_k_bounds_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6] + [0] * 20 + [1, 2]
    assert propose(tokens, k=2, min_n=2) == [3, 4]
    assert propose(tokens, k=2, min_n=2, window=10) == []


def test_accepted_length_counts_the_confirmed_prefix():
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_length([], [3]) == 0


def test_a_sequence_whose_drafts_keep_failing_pauses_then_tries_again():
    config = SpeculativeConfig(min_acceptance=0.2, pause_steps=3)
    stats = DraftStats()
    for _ in range(10):
        stats.record(4, 4, config)
    assert stats.may_propose()
    for _ in range(4):
        stats.record(4, 0, config)
    assert stats.may_propose(), "four misses after a good run are not enough (0.7^4 = 0.24 of the rate is left)"
    stats.record(4, 0, config)
    assert [stats.may_propose() for _ in range(4)] == [False, False, False, True]


def test_the_draft_length_follows_what_was_accepted():
    config = SpeculativeConfig(min_acceptance=0.0)
    stats = DraftStats()
    assert stats.next_length(4) == 4
    stats.record(4, 1, config)
    assert stats.next_length(4) == 2
    stats.record(2, 2, config)  # all confirmed: one more next time
    assert stats.next_length(4) == 3
    stats.record(3, 0, config)
    assert stats.next_length(4) == 1
    stats.record(1, 1, config)
    stats.record(2, 2, config)
    stats.record(3, 3, config)
    stats.record(4, 4, config)
    assert stats.next_length(4) == 4, "never past k"


def test_drafts_go_to_the_sequences_that_pay_for_their_rows():
    costs = StepCosts()
    drafts = [(4, expected_accepted(0.9, 4)), (4, expected_accepted(0.3, 4))]
    assert costs.best_share(2, drafts) == 0, "the plain step is measured first"
    costs.record(2, 0.020)
    assert costs.best_share(2, drafts) == 1, "an unmeasured row count is tried"
    costs.record(6, 0.024)  # four more rows cost 20% more: 2 + 3.1 tokens instead of 2 pays
    assert costs.best_share(2, drafts) == 2
    costs.record(10, 0.060)  # four more again cost 2.5x: 2 + 3.1 + 0.4 tokens in 60 ms is worse than 5.1 in 24
    assert costs.best_share(2, drafts) == 1
    costs.seconds[6] = 0.060  # drafting costs triple: none pays
    assert costs.best_share(2, drafts) == 0
    assert round(expected_accepted(0.5, 3), 3) == 0.875
