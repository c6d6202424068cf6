"""The Llama family (Llama, SmolLM2, Qwen2/2.5, Qwen3, Mistral without a sliding window) on the engine's own
layers: merged q/k/v and gate/up projections, RMSNorm with the residual add fused, a rotary table, paged attention,
and logits only where a token is sampled. The layout follows nano-vllm's `models/qwen3.py`; the math follows
transformers' `modeling_llama.py` / `modeling_qwen2.py` / `modeling_qwen3.py`, checked against them in fp32 by
`tests/engine/test_parity.py` and `tests/engine/test_synthetic_models.py`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from engine.layers.activation import silu_and_mul
from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.kv_cache_dtype import is_fp8
from engine.layers.linear import Linear, MergedLinear
from engine.layers.logits import LMHead
from engine.layers.norm import RMSNorm
from engine.layers.quantized import BlockWeight
from engine.layers.rotary import RotaryEmbedding, StepRope
from engine.models.crossover_cache import kept_crossover_rows

if TYPE_CHECKING:
    from engine.layers.lora import LoRAStep
    from engine.models.compiled import CompiledForward

# checkpoint name part -> (our merged module, shard)
MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def has_qk_norm(cfg) -> bool:
    return cfg.model_type == "qwen3"


class Attention(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        self.scaling = self.head_dim**-0.5
        # Qwen3 normalises each head of q and k (RMSNorm over head_dim) before the rotary embedding
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if has_qk_norm(cfg) else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if has_qk_norm(cfg) else None

    def forward(self, rope: StepRope, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = self.qkv_proj.split(qkv)
        head_norms = None
        if self.q_norm is not None and rope.norms_heads:  # in the rotary kernel
            head_norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        elif self.q_norm is not None:
            self._normalise_heads(q, k)
        # the Triton ops write K and V into the pool from the rotary kernel: attention then has nothing to write
        kv = (*meta.kv_layers[self.layer], meta.slot_mapping) if rope.writes_kv and meta.triton else None
        q, k = rope.rotate(qkv, q.view(tokens, self.heads, self.head_dim), k.view(tokens, self.kv_heads, self.head_dim),
                           head_norms, kv)
        if kv is not None:
            k = v = None
        else:
            v = v.view(tokens, self.kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer, meta, self.scaling)
        return self.o_proj(out.view(tokens, self.heads * self.head_dim))

    def _normalise_heads(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Qwen3's per-head norms, written back into q and k, views of the merged projection, so that the rotary
        embedding (fused: in place on the projection) reads them."""
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            x.copy_(norm(x.reshape(-1, self.head_dim))[0].view(x.shape))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.fused = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.writes_activation:  # in the projection's epilogue (a captured graph's plan)
            return self.down_proj(self.gate_up_proj(hidden))
        return self.down_proj(self.activation(self.gate_up_proj(hidden)))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up, self.fused)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rope, hidden, residual, meta) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_position: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, head_dim_of(cfg), max_position)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused = None
        self.native_weights: list[torch.Tensor] | None = None  # on GGUF blocks; set by `use_native_decode`
        self.native_dense_weights: list[torch.Tensor] | None = None  # on oneDNN-packed weights
        self.one_region = False  # the native call on blocks in one OpenMP region; set by `use_native_decode`
        self.lora_step: LoRAStep | None = None  # set by engine/models/lora.py's LoRAManager
        attention = self.layers[0].self_attn
        self.shape = (attention.heads, attention.kv_heads, attention.head_dim, cfg.rms_norm_eps, attention.scaling)

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if (weights := self.native_decode_weights(hidden.shape[0], meta)) is not None:
            decode = meta.decode
            # the region reads and writes a pool of the model's dtype; an fp8 one goes op by op
            one_region = self.one_region and weights is self.native_weights and \
                meta.kv_layers[0][0].dtype == self.embed_tokens.weight.dtype
            hidden, residual = self.fused.decode_layers(
                hidden, weights, [t for pair in meta.kv_layers for t in pair], positions, self.rotary.cos,
                self.rotary.sin, meta.slot_mapping, decode.block_tables, decode.context_lens, *self.shape, one_region)
            return self.norm(hidden, residual)[0]
        return self.layers_forward(hidden, positions, meta)

    def layers_forward(self, hidden, positions, meta) -> torch.Tensor:
        """Embedded tokens -> final hidden states, layer by layer; what `engine/models/compiled.py` compiles, where
        the fused C++ ops give way to torch ops that inductor fuses itself."""
        rope = self.rotary(positions, hidden.dtype, None if torch.compiler.is_compiling() else self.fused)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
        return self.norm(hidden, residual)[0]

    @property
    def lora_active(self) -> bool:
        """Whether this step's rows run LoRA adapters, which only the layer-by-layer forward applies."""
        return self.lora_step is not None and self.lora_step.active

    def use_native_decode(self, enabled: bool) -> bool:
        """Run all layers of a decode step as one C++ call (`engine/csrc/decoder_cpu.cpp`): the same kernels in the
        same order as the layers below, without about ten Python calls a layer. Possible on CPU with the fused ops,
        on GGUF blocks where every linear holds them, on packed dense weights where every linear has them.
        -> whether it is on."""
        linears = [m for m in self.layers.modules() if isinstance(m, Linear)]
        on = enabled and getattr(self.fused, "decode_layers", None) is not None
        self.native_weights = _all_layers(self.layers, _block_weights) if on and all(m.blocks is not None for m in linears) else None
        self.native_dense_weights = _all_layers(self.layers, _packed_weights) if on and all(m.packed is not None for m in linears) else None
        self.one_region = self.native_weights is not None and self._fits_one_region(linears)
        return self.native_weights is not None or self.native_dense_weights is not None

    def _fits_one_region(self, linears: list[Linear]) -> bool:
        """Whether the native call on the blocks can run in one OpenMP region (`engine/csrc/decode_region_cpu.cpp`:
        1.2-1.3x a one-row step): every linear's blocks interleaved (AVX-512 and AVX2 builds), fp32 or bf16, head_dim 64 or
        128; else it goes op by op."""
        head_dim = self.shape[2]
        return (all(m.blocks.codes.dim() == 3 for m in linears) and head_dim in (64, 128)
                and self.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16))

    def native_decode_weights(self, num_tokens: int, meta: AttentionMetadata) -> list[torch.Tensor] | None:
        """The weights for one native call over all layers, or None (layer by layer): decodes only, with the C++
        attention and KV write; on the blocks up to their crossover, as the layers read them, past it dense."""
        decode = meta.decode
        pool = meta.kv_layers[0][0].dtype
        if (meta.prefills or decode is None or decode.kernel is None or meta.write_kv is None or self.lora_active
                or (pool != self.embed_tokens.weight.dtype and not is_fp8(pool))):
            return None
        if self.native_weights is not None and num_tokens <= self.layers[0].mlp.down_proj.block_rows:
            return self.native_weights
        return self.native_dense_weights


class LlamaForCausalLM(nn.Module):
    impl = "native"

    def __init__(self, cfg, max_position: int):
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.model = LlamaModel(cfg, max_position)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.compiled: CompiledForward | None = None  # set by `compile`
        self.lora_step: LoRAStep | None = None  # set by engine/models/lora.py's LoRAManager

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        """Flat [T] token ids and positions -> logits [len(logits_indices), vocab]."""
        if (self.compiled is not None and not self.model.lora_active
                and self.model.native_decode_weights(input_ids.shape[0], meta) is None):
            return self.compiled(input_ids, positions, meta, logits_indices)
        return self.lm_head(self.model(input_ids, positions, meta), logits_indices)

    def forward_pooled(self, input_ids, positions, meta: AttentionMetadata, logits_indices, pool_indices
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at `logits_indices` and the final hidden states at `pool_indices` (embedding requests), from
        one pass layer by layer."""
        hidden = self.model(input_ids, positions, meta)
        return self.lm_head(hidden, logits_indices), hidden.index_select(0, pool_indices)

    def compile(self, cache_dir: Path) -> None:
        """Every step but the one-call native decode runs through one inductor graph from now on (compiled on the
        first such step)."""
        from engine.models.compiled import CompiledForward  # here: importing inductor adds 0.75 s to every start

        self.compiled = CompiledForward(self, cache_dir)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockWeight]]) -> None:
        """Checkpoint (HF names) -> this model; every parameter must be loaded exactly once, or it raises. A GGUF
        checkpoint's block weights (`engine/models/gguf.py`) are kept by their linears, beside exact dense values."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        embedding_blocks = None
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # some checkpoints store inv_freq; ours is computed from the config
            module_path, _, param = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in MERGED:
                merged, shard = MERGED[leaf]
                self.get_submodule(f"{parent}.{merged}").load_shard(shard, param, tensor)
                loaded.add(f"{parent}.{merged}.{param}")
            elif name in params and isinstance(tensor, BlockWeight):
                module = self.get_submodule(module_path)
                if isinstance(module, Linear):
                    module.load_blocks(tensor)
                else:
                    params[name].data.copy_(tensor.dequantize())
                    embedding_blocks = tensor if name == "model.embed_tokens.weight" else embedding_blocks
                loaded.add(name)
            elif name in params:
                params[name].data.copy_(tensor)
                loaded.add(name)
            else:
                raise ValueError(f"checkpoint tensor {name} has no place in the native {type(self).__name__}")
        if "lm_head.weight" not in loaded and self.config.tie_word_embeddings:
            self.lm_head.weight.data.copy_(self.model.embed_tokens.weight.data)
            self.lm_head.blocks = embedding_blocks
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint has no weights for {missing[:4]} ({len(missing)} missing)")

    def quantize(self, kind: str, dtype: torch.dtype) -> None:
        """NF4 or int8 weights (bitsandbytes) for every decoder linear; the LM head stays dense, as transformers
        keeps it (its `llm_int8_skip_modules`)."""
        for module in self.model.layers.modules():
            if isinstance(module, Linear):
                module.quantize(kind, dtype)

    def pack(self, cache: Path | None = None) -> None:
        """Pack every linear's dense weight, then measure up to how many rows its GGUF blocks (if any) are faster
        (kept under `cache` per CPU, see crossover_cache.py)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for module in linears:
            module.pack()
        dtype = self.model.embed_tokens.weight.dtype
        for group in ([m for m in linears if m.blocks is not None and m is not self.lm_head],
                      [self.lm_head] if self.lm_head.blocks is not None else []):
            rows = kept_crossover_rows(group, dtype, cache) if group else 0
            for module in group:
                module.block_rows = rows

    def use_fused_ops(self, fused) -> None:
        """Run norms, rotary and SiLU-and-mul as one call each: C++ on CPU (`engine.cpu_kernels.fused_ops()`, which
        also runs decode steps as one call for all layers), Triton where attention does
        (`engine.kernels.triton.fused_ops.TritonFusedOps`); None: torch ops."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, LlamaModel)):
                module.fused = fused
        self.model.use_native_decode(True)

    def block_rows(self) -> dict[str, int]:
        """Up to how many rows the layers and the LM head read GGUF blocks (0: never)."""
        return {"layers": self.model.layers[0].mlp.down_proj.block_rows, "lm_head": self.lm_head.block_rows}

    def weight_bytes(self) -> int:
        """Resident weight bytes, packed copies included (the tied LM head is a second, packed copy)."""
        linear = sum(m.resident_bytes for m in self.modules() if isinstance(m, Linear))
        other = sum(p.numel() * p.element_size() for n, p in self.named_parameters() if not _is_linear_param(self, n))
        return linear + other


def _all_layers(layers: nn.ModuleList, linear_weights) -> list[torch.Tensor]:
    """Every layer's weights in the order `decode_layers` reads them: norm, q/k/v, o, norm, gate/up, down, each
    linear as the 4 tensors `linear_weights` gives, then the q and k norms (Qwen3's; empty elsewhere)."""
    weights = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        head_norms = [_NONE, _NONE] if attention.q_norm is None else [attention.q_norm.weight, attention.k_norm.weight]
        weights += [layer.input_layernorm.weight, *linear_weights(attention.qkv_proj), *linear_weights(attention.o_proj),
                    layer.post_attention_layernorm.weight, *linear_weights(mlp.gate_up_proj), *linear_weights(mlp.down_proj),
                    *head_norms]
    return weights


_NONE = torch.empty(0)  # stands for an absent Q4 min (a Q8_0 matrix), bias, or the blocks' scales of a dense linear


def _block_weights(m: Linear) -> list[torch.Tensor]:
    b = m.blocks
    return [b.codes, b.scales, b.mins, _NONE if m.bias is None else m.bias]


def _packed_weights(m: Linear) -> list[torch.Tensor]:
    return [m.packed, _NONE, _NONE, _NONE if m.bias is None else m.bias]


def _is_linear_param(model: nn.Module, name: str) -> bool:
    return isinstance(model.get_submodule(name.rpartition(".")[0]), Linear)
