"""The Triton top-p (`engine/kernels/triton/nucleus.py`) keeps the same tokens as the sampler's sort-based rule
(`sampler.nucleus_threshold_by_candidates`, the CPU's): a token stays when the mass above it is at most top_p. On CPU under triton's
interpreter, on the GPU where there is one. Rows without ties at the boundary, so both rules name one set."""
import pytest
import torch

from engine.kernels.triton.nucleus import nucleus
from engine.sampler import nucleus_threshold_by_candidates

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    values, order = probs.sort(dim=-1, descending=True)
    drop = values.cumsum(-1) - values > top_p[:, None]
    return torch.zeros_like(probs).scatter(1, order, values.masked_fill(drop, 0.0))


def rows(vocab: int, seed: int) -> torch.Tensor:
    """Peaked, flat and in-between rows, as temperatures make them; one row whose max alone exceeds top_p."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=generator) * torch.tensor([8.0, 3.0, 1.0, 0.3, 0.05, 2.0])[:, None]
    logits[5, vocab // 3] = 40.0
    return logits.softmax(-1).to(DEVICE)


@pytest.mark.parametrize("vocab", [7, 1000, 5000])
@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.999])
def test_the_nucleus_keeps_what_the_sort_keeps(vocab, top_p):
    probs = rows(vocab, vocab)
    p = torch.full((probs.shape[0],), top_p, device=DEVICE)
    got = nucleus(probs, p)
    assert torch.equal(got > 0, by_sort(probs, p) > 0)
    assert torch.equal(got[got > 0], probs[got > 0]), "kept probabilities are untouched"
    assert bool(((got > 0).sum(-1) >= 1).all()), "every row keeps its most likely token"


def test_each_row_takes_its_own_top_p_and_the_sampler_rule_agrees():
    probs = rows(3000, 1)
    p = torch.tensor([0.1, 0.5, 0.95, 0.5, 0.99, 0.2], device=DEVICE)
    got = nucleus(probs, p[:, None])
    assert torch.equal(got > 0, by_sort(probs, p) > 0)
    assert torch.equal(got > 0, probs >= nucleus_threshold_by_candidates(probs, p[:, None]))  # the CPU's tiers
    assert nucleus(probs[:0], p[:0]).shape == (0, 3000)
