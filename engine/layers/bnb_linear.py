"""NF4 and int8 weights for the native model through bitsandbytes' own modules, on CUDA and on CPU: each decoder
linear's dense weight is handed to `Linear4bit` / `Linear8bitLt`, quantized where it lives, with the settings
transformers uses for the same `BitsAndBytesConfig` (NF4 blocks of 64 without double quantization; LLM.int8 with
outliers above 6.0 in 16-bit), so the native path and the transformers fallback hold the same quantized weights."""
from __future__ import annotations

import torch
from torch import nn

INT8_OUTLIER_THRESHOLD = 6.0  # transformers' llm_int8_threshold default


def bnb_linear(weight: torch.Tensor, bias: torch.Tensor | None, kind: str, compute_dtype: torch.dtype) -> nn.Module:
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError(f"quantization {kind} needs bitsandbytes: pip install 'llm-serve[quant]'") from None

    out_features, in_features = weight.shape
    if kind == "nf4":
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                                  compress_statistics=False, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(weight.detach().cpu(), requires_grad=False, compress_statistics=False,
                                         quant_type="nf4")
    elif kind == "int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None, has_fp16_weights=False,
                                    threshold=INT8_OUTLIER_THRESHOLD, device="meta")
        layer.weight = bnb.nn.Int8Params(weight.detach().cpu().to(torch.float16), requires_grad=False,
                                         has_fp16_weights=False)
    else:
        raise ValueError(f"no bitsandbytes linear for quantization {kind}")
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().cpu().to(compute_dtype), requires_grad=False)
    return layer.to(weight.device)  # bitsandbytes quantizes as the weight moves to its device


def bnb_resident_bytes(layer: nn.Module) -> int:
    tensors = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    state = getattr(layer.weight, "quant_state", None)
    extra = state.absmax.numel() * state.absmax.element_size() if state is not None else 0
    extra += layer.weight.SCB.numel() * 4 if getattr(layer.weight, "SCB", None) is not None else 0
    return sum(t.numel() * t.element_size() for t in tensors) + extra
