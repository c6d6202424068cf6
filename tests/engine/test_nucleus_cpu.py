"""Top-p's threshold on CPU in C++ (engine/csrc/nucleus_cpu.cpp): the nucleus by its definition (a token stays when
the mass above it is at most top_p, and so do its ties), whatever the row's shape; the sampler and the engine use it."""
import pytest
import torch

from engine import LLM
from engine.cpu_kernels import build_kernels
from engine.sampler import Sampler, make_generator
from engine.sampling_params import SamplingParams
from tests.fixtures.tiny_models import tiny_checkpoint


@pytest.fixture(scope="module")
def threshold():
    """The kernel's threshold for rows it leaves untouched (it zeroes a copy)."""
    mask = build_kernels().nucleus_mask_
    return lambda probs, top_p: mask(probs.clone(), top_p)


def kept_by_definition(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sorted, the mass above each token summed in float64; every token tied with a kept one kept too."""
    values, order = probs.double().sort(dim=-1, descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, values.cumsum(-1) - values <= top_p.double())
    least = torch.where(kept, probs, torch.inf).amin(-1, keepdim=True)
    return probs >= least


def rows(vocab: int, seed: int) -> torch.Tensor:
    """Peaked to flat, as temperatures make them, and one row whose max alone exceeds any top_p here."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([12.0, 6.0, 3.0, 1.5, 0.5, 0.05, 1.0])[:, None]
    logits = torch.randn(7, vocab, generator=generator, dtype=torch.float64) * scales
    logits[6, vocab // 2] = 60.0
    return logits.softmax(-1).float()


def test_the_kernel_zeroes_what_is_below_the_threshold_and_nothing_else():
    probs = rows(5000, 2)
    masked = probs.clone()
    least = build_kernels().nucleus_mask_(masked, torch.full((7,), 0.9))
    assert torch.equal(masked, torch.where(probs >= least, probs, 0.0))
    assert torch.equal(masked > 0, kept_by_definition(probs, torch.full((7, 1), 0.9)))


@pytest.mark.parametrize("vocab", [5, 40, 5000, 49152])
@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.999])
def test_the_kernel_keeps_what_the_definition_keeps(threshold, vocab, top_p):
    probs = rows(vocab, vocab)
    p = torch.full((probs.shape[0], 1), top_p)
    got = probs >= threshold(probs, p)
    assert torch.equal(got, kept_by_definition(probs, p))
    assert bool((got.sum(-1) >= 1).all()), "every row keeps its most likely token"


def test_each_row_takes_its_own_top_p(threshold):
    probs = rows(3000, 1)
    p = torch.tensor([0.1, 0.5, 0.95, 0.5, 0.99, 0.2, 0.7])[:, None]
    assert torch.equal(probs >= threshold(probs, p), kept_by_definition(probs, p))
    assert threshold(probs[:0], p[:0]).shape == (0, 1)


def test_a_token_with_exactly_top_p_above_it_stays_and_ties_all_stay(threshold):
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.4, 0.2, 0.2, 0.2]])
    kept = probs >= threshold(probs, torch.tensor([0.75, 0.5]))
    assert kept.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_a_token_with_exactly_top_p_above_it_stays_when_the_partition_finds_it(threshold):
    """64 probabilities n/4096 (exact in float and double), laid out so the first pivot is the token with exactly
    top_p above it: the selection itself, not the final sort of a short run, decides that it stays."""
    counts = [n for n in range(32, 95) if n != 85] + [127]
    counts.insert(32, 85)  # the middle of the row, between 32 first and 127 last: the median of the three
    probs = torch.tensor([counts], dtype=torch.float32) / 4096
    top_p = torch.tensor([(127 + sum(range(86, 95))) / 4096])  # the 10 largest; 85 is the 11th
    kept = probs >= threshold(probs, top_p)
    assert int(kept.sum()) == 11 and bool(kept[0, 32])


def test_a_flat_row_of_ties_keeps_them_all_and_a_tiny_top_p_keeps_the_max(threshold):
    """A thousand equal values go through the partition's tie branch; top_p 1e-9 leaves only the most likely."""
    flat = torch.full((1, 1000), 1e-3)
    assert bool((flat >= threshold(flat, torch.tensor([0.5]))).all())
    probs = rows(2000, 3)
    kept = probs >= threshold(probs, torch.full((7,), 1e-9))
    assert torch.equal(kept, probs == probs.amax(-1, keepdim=True))


def test_rows_without_a_distribution_leave_the_others_right(threshold):
    """NaN, inf and all-zero rows (the sampler marks them invalid) neither crash it nor disturb their batch-mates."""
    probs = rows(1000, 4)
    bad = probs.clone()
    bad[1, 3], bad[3, :] = float("nan"), 0.0
    bad[5, 7] = float("inf")
    p = torch.full((7, 1), 0.9)
    got = bad >= threshold(bad, p)
    good = [0, 2, 4, 6]
    assert torch.equal(got[good], kept_by_definition(probs, p)[good])


def test_the_sampler_draws_the_same_tokens_on_the_kernel_as_on_the_torch_tiers():
    """Same seeds, same logits: the same kept sets give the same draws, row by row."""
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(8)) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=s) for s in range(16)]

    def draw(sampler: Sampler) -> list[int]:
        return sampler(logits, params, [make_generator(p) for p in params], None)[0]

    assert draw(Sampler(build_kernels().nucleus_mask_)) == draw(Sampler())


def test_a_cpu_engine_samples_top_p_on_the_kernel_and_draws_what_the_tiers_draw(tmp_path_factory):
    llm = LLM(model=tiny_checkpoint(tmp_path_factory.mktemp("nucleus"), "qwen2-hd128"), dtype="float32", device="cpu",
              num_kv_blocks=64, max_num_seqs=4)
    sampler = llm.engine.sampler.sampler
    assert sampler.cpu_nucleus_mask is not None
    work = [[5 + i, 17, 300 + 7 * i, 42] for i in range(4)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True) for i in range(4)]
    on_kernel = [o.token_ids for o in llm.generate(work, params, use_tqdm=False)]
    sampler.cpu_nucleus_mask = None
    on_tiers = [o.token_ids for o in llm.generate(work, params, use_tqdm=False)]
    assert on_kernel == on_tiers and all(len(t) == 12 for t in on_kernel)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks left held"
