"""Matmuls straight from GGUF blocks (Q4_0/Q4_1/Q8_0, see `engine/models/gguf.py`), for the few rows of a decode
step at low load, where reading the weights is the whole cost: Q4_1 is about a sixth of fp32's bytes.

The kernels use each block's exact values and accumulate in fp32, whatever the model's dtype. Before serving,
`BlockWeight.pack` puts the blocks in the layout this CPU's kernel reads (`PackedBlocks`): on AVX-512 and AVX2, 16
output rows interleaved (`engine/csrc/interleaved_matmul_cpu.cpp`), so each extra row of a step costs little;
elsewhere the file's own (`engine/csrc/quantized_matmul_cpu.cpp`). The AVX2 and interleaved kernels round the
activations to 16 bits per 32-element block (at most 2^-16 of the block's largest |x|), which is what makes them
fast; the portable one, and AVX-512 on matrices that are not whole 16-row groups, match the dequantized fp32 matmul
within fp32 rounding. Past some row count oneDNN's packed dense matmul wins (about 16 rows against bf16 with AMX;
64-128 against fp32 on an AVX2 Zen 3 with the interleaved blocks, 16-32 in the file's layout), so a `Linear` with blocks keeps its packed dense copy too and picks by
row count, at a crossover timed on this CPU at its first load (then kept: `engine/models/crossover_cache.py`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.cpu_kernels import build_block_matmul

BLOCK = 32
QUANT_BYTES = 16  # bytes of codes in a Q4 block; a Q8 block holds 32

CALIBRATION_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # AVX-512 fp32: blocks won at 128


@dataclass
class BlockWeight:
    """A [rows, cols] matrix in 32-weight blocks: codes [rows, cols/32 * bytes] uint8, fp32 scales and (Q4) mins
    [rows, cols/32]. `kind` is "q4" (q d + m, nibbles) or "q8" (q d, int8)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    def rows(self, index: torch.Tensor) -> "BlockWeight":
        return BlockWeight(self.kind, self.codes[index], self.scales[index], None if self.mins is None else self.mins[index])

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix the blocks hold, value for value."""
        rows, cols = self.shape
        if self.kind == "q8":
            codes = self.codes.view(torch.int8).view(rows, -1, BLOCK).float()
            return (codes * self.scales[..., None]).view(rows, cols)
        blocks = self.codes.view(rows, -1, QUANT_BYTES)
        codes = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()
        return torch.addcmul(self.mins[..., None], codes, self.scales[..., None]).view(rows, cols)

    def pack(self) -> "PackedBlocks":
        """The blocks in the layout this CPU's kernel reads: 16 rows interleaved where it wants them (AVX-512, AVX2) and
        the scales fit fp16 exactly (GGUF stores them in fp16), else the file's."""
        lanes = build_block_matmul().interleaved_rows()
        rows = self.shape[0]
        if lanes and rows % lanes == 0 and all(_fits_fp16(t) for t in (self.scales, self.mins) if t is not None):
            return self._interleaved(lanes)
        return PackedBlocks(self.kind, self.codes, self.scales, self.mins if self.mins is not None else _NONE)

    def _interleaved(self, lanes: int) -> "PackedBlocks":
        rows, cols = self.shape
        groups = cols // BLOCK
        if self.kind == "q4":
            blocks = self.codes.view(rows, groups, QUANT_BYTES)
            values = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # element order
            chunks = values.view(rows // lanes, lanes, groups, 4, 8).permute(0, 2, 3, 1, 4)
            codes = chunks[..., [0, 2, 1, 3]] | (chunks[..., [4, 6, 5, 7]] << 4)
        else:
            chunks = self.codes.view(rows // lanes, lanes, groups, 8, 4).permute(0, 2, 3, 1, 4)
            codes = chunks[..., [0, 2, 1, 3]]
        codes = codes.reshape(rows // lanes, groups, -1).contiguous()

        def per_lane(t: torch.Tensor) -> torch.Tensor:
            return t.view(rows // lanes, lanes, groups).transpose(1, 2).half().contiguous()

        mins = per_lane(self.mins) if self.mins is not None else _NONE
        return PackedBlocks(self.kind, codes, per_lane(self.scales), mins)


_NONE = torch.empty(0)


def _fits_fp16(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t)


@dataclass(frozen=True)
class PackedBlocks:
    """GGUF blocks as this CPU's kernel reads them (see `BlockWeight.pack`); only the kernels look inside. `mins`
    is empty for Q8_0."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))


def concat_rows(parts: list[BlockWeight]) -> BlockWeight:
    """Several matrices of one input stacked as one (merged q/k/v, gate/up)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot merge projections stored as different GGUF types: {sorted(kinds)}")
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    return BlockWeight(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


def block_matmul(x: torch.Tensor, blocks: PackedBlocks, bias: torch.Tensor | None) -> torch.Tensor:
    kernels = build_block_matmul()
    dtype = x.dtype
    x32 = x if dtype == torch.float32 else x.float()  # a no-op `.float()` is still a dispatch: 210 a step add up
    if blocks.kind == "q4":
        y = kernels.q4_matmul(x32, blocks.codes, blocks.scales, blocks.mins)
    else:
        y = kernels.q8_matmul(x32, blocks.codes, blocks.scales)
    if bias is not None:
        y += bias
    return y if dtype == torch.float32 else y.to(dtype)


def crossover_rows(linears: list, dtype: torch.dtype, repeats: int = 3) -> int:
    """The most rows for which the block kernel beats the dense one on this CPU (0: never), timed over the model's
    own linears in turn, so that each weight comes cold from memory as it does in a step."""
    best = 0
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in linears}
            blocks = _median_s(lambda: [block_matmul(inputs[m.in_features], m.blocks, m.bias) for m in linears], repeats)
            dense = _median_s(lambda: [m.dense_forward(inputs[m.in_features]) for m in linears], repeats)
            if blocks >= dense:
                break
            best = rows
    return best


def _median_s(sweep, repeats: int) -> float:
    sweep()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sweep()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
