"""The fallback for every architecture without a native model: transformers' own modeling code, with the engine's
paged attention registered into its attention interface, behind the same forward as the native models."""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from engine.layers.attention import AttentionMetadata, ScoreShape, paged_attention

ATTN_IMPLEMENTATION = "paged"


def hf_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, paged_metadata=None,
                       sliding_window=None, softcap=None, s_aux=None, **_):
    """transformers' call: query [1, heads, T, D], key/value [1, kv_heads, T, D] -> ([1, T, heads, D], None). A
    layer's sliding window and soft-capping shape its scores (on the torch path, which the engine then runs)."""
    if paged_metadata is None:
        raise RuntimeError("paged attention was called without paged_metadata: run the model through ModelRunner")
    if s_aux is not None:
        raise RuntimeError("this model's attention sinks (s_aux) are not implemented by the paged attention")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          module.layer_idx, paged_metadata, scaling, ScoreShape.of(sliding_window, softcap))
    return out.unsqueeze(0), None


def no_mask(*args, **kwargs):
    """Causality and sequence boundaries come from AttentionMetadata, so transformers builds no mask."""
    return None


def register() -> str:
    # the mask function must be registered under the same name, or transformers passes None and causality is lost
    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)
    return ATTN_IMPLEMENTATION


class HFCausalLM(nn.Module):
    impl = "hf"

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        return self.hf(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), logits_to_keep=logits_indices,
                       use_cache=False, paged_metadata=meta).logits[0]

    def forward_pooled(self, input_ids, positions, meta: AttentionMetadata, logits_indices, pool_indices
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at `logits_indices` and the final hidden states (after the last norm: transformers' last
        `hidden_states`) at `pool_indices`."""
        out = self.hf(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), logits_to_keep=logits_indices,
                      use_cache=False, paged_metadata=meta, output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0].index_select(0, pool_indices)

    def weight_bytes(self) -> int:
        return self.hf.get_memory_footprint()


def load_hf_model(path: str, dtype: torch.dtype, device: torch.device, quantization_config, trust_remote_code: bool,
                  stored_quantized: bool = False) -> HFCausalLM:
    """`quantization_config`: weights to quantize as they load; `stored_quantized`: a checkpoint stored quantized,
    which transformers reads by its own quantization_config. Either way, loaded onto the device by transformers."""
    placed = quantization_config is not None or stored_quantized
    # no quantization_config argument at all for a stored one: transformers 5 reads an explicit None as "dense"
    quantizing = {"quantization_config": quantization_config} if quantization_config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        device_map={"": device} if placed else None,
        attn_implementation=register(),
        trust_remote_code=trust_remote_code,
        **quantizing,
    )
    if not placed:
        model.to(device)
    return HFCausalLM(model.eval())
