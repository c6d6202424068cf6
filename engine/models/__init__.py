"""Model loading: the native Llama-family implementation where the checkpoint fits it, transformers' modeling
code (`hf.py`) for everything else, chosen by `config.architectures` unless `EngineConfig.model_impl` says."""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from engine.config import EngineConfig
from engine.cpu_kernels import fused_ops
from engine.layers.rotary import STATIC_ROPE_TYPES, rope_type
from engine.models.attention_support import score_shaping, unimplemented_attention
from engine.models.llama import LlamaForCausalLM
from engine.models.gguf import read_tensors as gguf_tensors
from engine.models.loader import (cache_root, checkpoint_dir, checkpoint_tensors, embedded_checkpoint,
                                  embedded_gguf_path, embedding_sizes, gguf_path, is_gguf_file, load_hf_config, load_tokenizer,
                                  model_max_len, quantization_config, resolve_device, resolve_model_path)
from engine.models.dtype_choice import cpu_has_bf16, resolve_dtype

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the fallback is imported where it runs: transformers' PreTrainedModel takes 2.3 s to import
    from engine.models.hf import HFCausalLM

    Model = LlamaForCausalLM | HFCausalLM

NATIVE = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": LlamaForCausalLM,
          "MistralForCausalLM": LlamaForCausalLM}

__all__ = ["load_model", "NATIVE", "native_unsupported", "score_shaping", "unimplemented_attention", "load_hf_config",
           "cache_root", "cpu_has_bf16", "embedded_checkpoint",
           "embedded_gguf_path", "embedding_sizes", "load_tokenizer", "model_max_len", "resolve_device", "resolve_dtype", "resolve_model_path"]


def native_unsupported(hf_config, config: EngineConfig) -> str | None:
    """Why the native path cannot run this model, or None where it can."""
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if architecture not in NATIVE:
        return f"no native model for {architecture}"
    if (method := prequantized(hf_config)) is not None:  # packed weights and scales the native linears cannot read
        return f"pre-quantized weights ({method})"
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        return f"activation {hf_config.hidden_act}"
    if rope_type(hf_config) not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type(hf_config)}"
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention"
    return score_shaping(hf_config)


def prequantized(hf_config) -> str | None:
    """The method of a checkpoint stored quantized (its config's quantization_config: bitsandbytes, GPTQ, AWQ,
    FP8...), or None for dense weights."""
    quantized = getattr(hf_config, "quantization_config", None)
    if not quantized:
        return None
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Model:
    path = resolve_model_path(config.model)
    hf_config = load_hf_config(config)
    if (missing := unimplemented_attention(hf_config)) is not None:
        raise ValueError(f"{config.model}: {missing} not implemented by the engine's paged attention")
    stored = prequantized(hf_config)
    if stored is not None and config.quantization is not None:
        raise ValueError(f"quantization {config.quantization}: {config.model} is stored quantized already ({stored}); "
                         "leave quantization unset to run it as stored")
    reason = native_unsupported(hf_config, config) if config.model_impl != "hf" else "model_impl is hf"
    for asked, what in ((config.quantization == "gguf", "quantization gguf runs"), (config.compile, "compile runs"),
                        (config.serves_lora, "LoRA adapters (lora_modules, lora_root) run")):
        if asked and reason is not None:
            raise ValueError(f"{what} on the native model only, which cannot run {config.model}: {reason}")
    if reason is None:
        model = load_native(path, hf_config, config, device, dtype)
    elif config.model_impl == "native":
        raise ValueError(f"model_impl native cannot run {config.model}: {reason}")
    else:
        log.info("using transformers' modeling code for %s (%s)", config.model, reason)
        from engine.models.hf import load_hf_model

        model = load_hf_model(path, dtype, device, quantization_config(config.quantization, dtype), config.trust_remote_code,
                              stored_quantized=stored is not None)
    model.generation_config = _generation_config(path)
    return model


def load_native(path: str, hf_config, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    max_position = min(config.max_model_len or model_max_len(hf_config), model_max_len(hf_config))
    with _default_dtype(dtype), torch.device(device):
        model = NATIVE[hf_config.architectures[0]](hf_config, max_position)
    if config.quantization == "gguf":
        model.load_weights(gguf_tensors(gguf_path(config), hf_config, cache_root()))
    else:
        model.load_weights(checkpoint_tensors(checkpoint_dir(path)))
    if config.quantization in ("nf4", "int8"):
        model.quantize(config.quantization, dtype)
    model.pack(cache_root())
    if device.type == "cpu":
        model.use_fused_ops(fused_ops())
    if config.compile:
        model.compile(cache_root())
    return model.eval()


def _generation_config(path: str) -> GenerationConfig | None:
    if is_gguf_file(path):
        return None
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # the checkpoint has none
        return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
