"""Shared by the engine tests: a reference greedy decode with transformers, and the near-tie rule."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from engine.models import resolve_model_path

NEAR_TIE = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # one [vocab] row per generated position


def load_hf_model(model: str, dtype=torch.float32):
    hf_model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=dtype, attn_implementation="sdpa").eval()
    hf_model.generation_config.eos_token_id = None  # never stop, never suppress: compare every position
    return hf_model


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    """transformers `generate`, one prompt at a time, greedy, running past EOS (like `ignore_eos`)."""
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return Reference(tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits])


def assert_matches_reference(got: list[int], ref: Reference, label: str = "") -> bool:
    """Identical, or diverging first at a near-tie: the two chosen tokens' logprobs within NEAR_TIE.

    Returns True when the outputs were identical."""
    assert len(got) == len(ref.token_ids), f"{label}: {len(got)} tokens, reference has {len(ref.token_ids)}"
    for position, (a, b) in enumerate(zip(got, ref.token_ids)):
        if a != b:
            gap = abs(float(ref.logprobs[position][a] - ref.logprobs[position][b]))
            assert gap < NEAR_TIE, f"{label}: diverged at token {position} ({a} vs {b}), logprob gap {gap:.2e} is no tie"
            return False
    return True
