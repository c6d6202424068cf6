"""Linear layers whose weights are pre-packed for oneDNN on CPU, and merged projections (q/k/v, gate/up) loaded
from a checkpoint's separate matrices.

`benchmarks/linear_packing.py` measured oneDNN's pre-packed weights (`mkldnn._linear_pointwise`) at 1.2-2.3x
`F.linear` in bf16 and 1.8-2.7x in fp32 over the model's shapes, cold, at 1 to 256 rows; one packing (hinted for
64 rows) serves every row count. Elsewhere (CUDA, fp16) the plain weight goes through `F.linear`, or, in a captured
decode graph, through the Triton tiling that measured faster for its shape (`engine/gemm_plan.py`).

A linear loaded from GGUF blocks (`engine/layers/quantized.py`) also keeps them, and runs them for up to
`block_rows` rows, where reading fewer bytes wins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.bnb_linear import bnb_linear, bnb_resident_bytes
from engine.layers.lora import LinearLoRA
from engine.layers.quantized import BlockWeight, PackedBlocks, block_matmul, concat_rows

PACKING_ROWS_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packs fp32 on any x86 CPU; bf16 only where the CPU computes it (AVX-512 bf16, AMX, avx_ne_convert):
    on an AVX2-only CPU the reorder raises."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Module):
    """y = x W^T + b over 2-D x. Load its weight, then call `pack()` once, before serving."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.blocks: BlockWeight | PackedBlocks | None = None  # PackedBlocks once packed
        self.block_rows = 0
        self.bnb: nn.Module | None = None  # NF4 or int8 weights (bnb_linear.py), in place of the dense ones
        self.lora: LinearLoRA | None = None  # LoRA adapters (engine/models/lora.py), added to the output
        self.tiling = None  # a Triton tiling, set only while a CUDA graph is captured (engine/gemm_plan.py)

    def load_blocks(self, blocks: BlockWeight) -> None:
        """Keep GGUF blocks for small batches, and their exact dense values for the rest."""
        self.blocks = blocks
        self.weight.data.copy_(blocks.dequantize())

    def quantize(self, kind: str, compute_dtype: torch.dtype) -> None:
        """Swap the dense weight for bitsandbytes' NF4 or int8 one; the dense copy is dropped."""
        self.bnb = bnb_linear(self.weight.data, self.bias.data if self.bias is not None else None, kind, compute_dtype)
        self.weight = self.bias = None

    def pack(self) -> None:
        """Swap the weight for its oneDNN layout where that is faster; the plain copy is dropped, not kept twice.
        GGUF blocks go into the layout the block kernel reads."""
        if self.bnb is not None:
            return
        if isinstance(self.blocks, BlockWeight):
            self.blocks = self.blocks.pack()
        if can_pack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACKING_ROWS_HINT)
            self.weight = None

    @property
    def writes_activation(self) -> bool:
        """A merged gate/up projection whose tiling writes the MLP's SiLU(gate) * up (engine/gemm_plan.py): its output
        is the activation's. Never under LoRA (the plan offers it none where there is one)."""
        return self.tiling is not None and self.tiling.gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        return y if self.lora is None else self.lora.add_to(x, y)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bnb is not None:
            return self.bnb(x)
        if self.blocks is not None and not torch.compiler.is_compiling() and x.shape[0] <= self.block_rows:
            return block_matmul(x, self.blocks, self.bias)
        return self.dense_forward(x)

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiling is not None:
            from engine.kernels.triton.matmul import matmul  # imports triton: only where it runs

            return matmul(x, self.weight, self.bias, self.tiling)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # an op of the graph; eager, the call itself (no dispatch: 121 a step)
            return torch.ops.engine.packed_linear(x, self.packed, self.bias, self.out_features)
        return packed_matmul(x, self.packed, self.bias, self.out_features)

    @property
    def resident_bytes(self) -> int:
        if self.bnb is not None:
            return bnb_resident_bytes(self.bnb)
        tensors = [self.packed if self.packed is not None else self.weight] + ([self.bias] if self.bias is not None else [])
        return (sum(t.numel() * t.element_size() for t in tensors) + (self.blocks.nbytes if self.blocks is not None else 0)
                + (self.lora.nbytes if self.lora is not None else 0))


class MergedLinear(Linear):
    """Several projections of the same input as one matmul; shard i of the output is `output_sizes[i]` wide."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self._block_shards: dict[int, BlockWeight] = {}

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor | BlockWeight) -> None:
        """Copy a checkpoint's separate matrix (or bias) `name` into its rows of the merged one."""
        start = sum(self.output_sizes[:shard])
        if isinstance(tensor, BlockWeight):
            self._block_shards[shard] = tensor
            if len(self._block_shards) == len(self.output_sizes):
                self.blocks = concat_rows([self._block_shards.pop(i) for i in range(len(self.output_sizes))])
            tensor = tensor.dequantize()
        getattr(self, name).data[start : start + self.output_sizes[shard]].copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)


# The packed matmul as one opaque node of a compiled graph: inductor lowers oneDNN's linear only on weights it froze
# itself, and a graph with frozen oneDNN weights cannot be cached on disk. (`define`, not `custom_op`: see
# engine/layers/attention_op.py.)
torch.library.define("engine::packed_linear", "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


torch.library.impl("engine::packed_linear", "CompositeExplicitAutograd", packed_matmul)  # the packed weight is MkldnnCPU


@torch.library.register_fake("engine::packed_linear")
def _(x, packed, bias, out_features):
    return x.new_empty((x.shape[0], out_features))
