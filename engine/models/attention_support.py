"""What of a model's attention the engine computes, read from its config before any weight loads: transformers'
modeling code (the fallback, `hf.py`) passes each layer's sliding window and soft-cap to the paged attention, and
leaves sinks, chunked and bidirectional attention to inputs the engine does not give it."""
from __future__ import annotations

SINK_MODELS = {"gpt_oss"}  # transformers' code passes their per-head sinks (s_aux) to the attention
LAYER_TYPES = {"full_attention", "sliding_attention"}  # what the paged attention computes (causal, maybe windowed)


def unimplemented_attention(hf_config) -> str | None:
    """What in the model's attention the engine cannot compute, where transformers' code would leave it to a mask
    the engine does not build or to an argument it cannot honour; None where it can."""
    text = hf_config.get_text_config()
    if text.model_type in SINK_MODELS:
        return f"attention sinks ({text.model_type}) are"
    if unknown := sorted(set(getattr(text, "layer_types", None) or ()) - LAYER_TYPES):
        return f"layer types {', '.join(unknown)} are"
    if getattr(text, "use_bidirectional_attention", False):
        return "bidirectional attention is"
    return None


def score_shaping(hf_config) -> str | None:
    """What the model's attention does to its scores beyond the causal mask, which the torch path and the Triton
    kernels compute and the C++ ones do not (transformers' modeling code passes it to the paged attention per
    layer, `engine/models/hf.py`): sliding windows, logit soft-capping; or None."""
    text = hf_config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if layer_types:
        windowed = "sliding_attention" in layer_types
    else:  # Mistral's, Phi-3's: one window for every layer, unless the config turns it off
        windowed = window is not None and getattr(text, "use_sliding_window", True)
    capped = getattr(text, "attn_logit_softcapping", None) is not None
    reasons = ["sliding-window attention"] * windowed + ["attention logit soft-capping"] * capped
    return " and ".join(reasons) or None
