"""Prompt logprobs (completions' echo with logprobs): every prompt token's logprob equals HF's log-softmax in fp32,
across prefill chunks, and the prompt is computed, not taken from the prefix cache."""
import pytest
import torch

from engine import LLM, SamplingParams

from tests.engine.helpers import load_hf_model

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog because it was very tired of running all day in the sun"


def test_prompt_logprobs_match_hf_across_chunks_and_skip_the_prefix_cache():
    llm = LLM(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64)
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks are now cached
    hits = llm.engine.stats().prefix_cache_hits
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits == hits
    ids = out.prompt_token_ids
    assert len(ids) > 16  # more than one chunk
    with torch.no_grad():
        reference = torch.log_softmax(load_hf_model("SmolLM2-135M-Instruct")(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        assert entry[ids[position]] == pytest.approx(float(reference[position - 1, ids[position]]), abs=1e-4)
        assert set(reference[position - 1].topk(2).indices.tolist()) <= set(entry)
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
