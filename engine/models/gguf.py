"""GGUF checkpoints read as they are stored: Q4_0, Q4_1 and Q8_0 tensors stay in their 32-weight blocks
(`BlockWeight`, run by `engine/layers/quantized.py`), F32/F16/BF16 become dense tensors, and any other type is
refused by name, never guessed. Names map to the HF checkpoint names the native model loads.

Block layouts (llama.cpp's ggml-common.h): Q4_0 {fp16 d; 16 bytes of nibbles} is (q - 8) d; Q4_1 {fp16 d, m; 16
bytes} is q d + m; Q8_0 {fp16 d; 32 int8} is q d. A block's byte j holds element j in its low nibble and element
j + 16 in its high one. Q4_0 is kept as Q4_1 with m = -8d, which is exact.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.layers.quantized import BLOCK, QUANT_BYTES, BlockWeight
from engine.models.gguf_cache import keep, kept_path, load_kept

log = logging.getLogger(__name__)

SUPPORTED = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; token_embd.weight -> model.embed_tokens.weight."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match[2] in LAYER_NAMES:
        return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"
    base, _, param = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{param}"
    raise ValueError(f"GGUF tensor {gguf_name} has no place in a Llama-family model")


def read_tensors(path: Path, hf_config, cache: Path | None = None) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    """(HF name, dense tensor or BlockWeight) for every tensor of a Llama or Qwen2 GGUF file; with a `cache`
    folder, from the copy kept there after the first read (`gguf_cache.py`)."""
    if cache is None:
        return _read(path, hf_config)
    kept = kept_path(path, cache)
    if kept.is_file():
        return load_kept(kept)
    tensors = list(_read(path, hf_config))
    try:
        keep(kept, tensors)
    except OSError as exc:  # a read-only cache costs the next start the reader's time, nothing else
        log.warning("could not keep the tensors of %s in %s: %s", path.name, kept.parent, exc)
    return iter(tensors)


def _read(path: Path, hf_config) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = reader.fields["general.architecture"].contents()
    if architecture not in ("llama", "qwen2"):
        raise ValueError(f"{path.name}: GGUF architecture {architecture!r} is not one the native model runs (llama, qwen2)")
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED:
            raise ValueError(f"{path.name}: tensor {tensor.name} is stored as {kind}, which the engine does not load "
                             f"(supported: {', '.join(SUPPORTED)})")
        name = hf_name(tensor.name)
        value = _to_torch(kind, tensor.data, [int(n) for n in reversed(tensor.shape)])
        if architecture == "llama" and re.search(r"self_attn\.[qk]_proj", name):
            heads = hf_config.num_attention_heads if ".q_proj" in name else hf_config.num_key_value_heads
            value = _unpermute_rows(value, heads)
        yield name, value


def _to_torch(kind: str, data: np.ndarray, shape: list[int]) -> torch.Tensor | BlockWeight:
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(data)).float().view(shape)
    if kind == "BF16":
        return torch.from_numpy(np.array(data)).view(torch.bfloat16).float().view(shape)
    rows = shape[0]
    raw = torch.from_numpy(np.array(data)).view(rows, -1)
    header = 4 if kind == "Q4_1" else 2  # bytes of fp16 d (and m) before each block's codes
    blocks = raw.view(rows, -1, header + (BLOCK if kind == "Q8_0" else QUANT_BYTES))
    scales = blocks[..., :2].contiguous().view(torch.float16).float().view(rows, -1)
    codes = blocks[..., header:].reshape(rows, -1).contiguous()
    if kind == "Q8_0":
        return BlockWeight("q8", codes, scales, None)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).float().view(rows, -1) if kind == "Q4_1" else -8 * scales
    return BlockWeight("q4", codes, scales, mins)


def _unpermute_rows(value: torch.Tensor | BlockWeight, heads: int):
    # llama.cpp's converter interleaves each head's rotary halves; transformers' loader undoes it the same way
    rows = value.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return value.rows(order) if isinstance(value, BlockWeight) else value[order]
