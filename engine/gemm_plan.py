"""Which kernel each linear layer of a captured decode step runs: cuBLAS, or the Triton tiling
(`engine/kernels/triton/matmul.py`) that measured faster on this GPU for that layer's shape at that batch bucket.

Timed at start-up, before the CUDA graphs are captured, for the buckets of MIN_ROWS rows and more, where the first
H100 run saw cuBLAS at a third of the part's peak on the narrow projections; each candidate is timed as a graph of
calls over enough copies of the weight that L2 does not hold them (engine/kernel_timing.py), as a step reads each
layer's weights once. Only the captured graphs take a tiling: an eager step launches triton's kernels through Python,
tens of microseconds each on the host, and keeps cuBLAS.

A merged gate/up projection whose output goes through the MLP's SiLU(gate) * up (`gated`) is timed with the
activation: cuBLAS or a tiling then the activation's kernel, against gated tilings that write the activation from
their epilogue (one kernel and a [rows, 2 * intermediate] write and read fewer a layer).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from engine.kernel_timing import time_calls
from engine.kernels.triton.matmul import TILINGS, Tiling, matmul

log = logging.getLogger(__name__)

MIN_ROWS = 64
PLANNED_DTYPES = (torch.bfloat16, torch.float16)  # the only weights the Triton GEMM ever runs on (`plannable`)
COLD_BYTES = 256 << 20  # weight copies a timed graph cycles through: more than any GPU's L2


@dataclass(frozen=True)
class Shape:
    out_features: int
    in_features: int
    bias: bool
    gated: bool = False  # a gate/up projection whose output goes through the MLP's activation


@dataclass
class GemmPlan:
    linears: list  # every Linear the plan may steer (engine/layers/linear.py)
    chosen: dict[tuple[Shape, int], Tiling] = field(default_factory=dict)  # (shape, rows) -> tiling; absent: cuBLAS
    timings: list[dict] = field(default_factory=list)  # per shape and bucket: microseconds a call, cuBLAS and best
    gated: list = field(default_factory=list)  # the gate/up projections among them, the MLP's activation after

    @classmethod
    def measure(cls, linears: list, buckets: list[int], gated: list = (),
                activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GemmPlan:
        """`gated`: gate/up projections whose output `activation` takes (SiLU(gate) * up), which a gated tiling
        may write itself."""
        plan = cls(linears, gated=list(gated))
        timed = [b for b in buckets if b >= MIN_ROWS]
        if not timed:  # no weight copies for nothing: every graph keeps cuBLAS
            return plan
        for shape, module in {plan.shape_of(m): m for m in linears}.items():
            copies = cold_copies(module.weight)
            for rows in timed:
                plan._choose(shape, copies, module.bias, rows, activation if shape.gated else None)
        return plan

    def shape_of(self, module) -> Shape:
        return replace(shape_of(module), gated=any(module is m for m in self.gated))

    def _choose(self, shape: Shape, copies: list[torch.Tensor], bias: torch.Tensor | None, rows: int,
                activation: Callable | None) -> None:
        x = torch.randn(rows, shape.in_features, device=copies[0].device).to(copies[0].dtype)
        after = activation or (lambda y: y)
        cublas = time_calls(lambda w: after(F.linear(x, w, bias)), copies)
        best, best_us = None, cublas
        candidates = [(t, after) for t in TILINGS]
        if activation is not None:  # the activation in the epilogue: the whole sum, so one slice of K
            candidates += [(replace(t, gated=True), lambda y: y) for t in TILINGS if t.split_k == 1]
        for tiling, then in candidates:
            try:
                us = time_calls(lambda w: then(matmul(x, w, bias, tiling)), copies)
            except Exception as error:  # a tiling this GPU cannot run (shared memory), or a compile error
                log.debug("tiling %s skipped for %s: %s", tiling, shape, error)
                continue
            if us < best_us:
                best, best_us = tiling, us
        if best is not None:
            self.chosen[(shape, rows)] = best
        self.timings.append({"out": shape.out_features, "in": shape.in_features, "gated": shape.gated,
                             "rows": rows, "cublas_us": round(cublas, 2), "best_us": round(best_us, 2),
                             "tiling": None if best is None else vars(best)})

    @contextmanager
    def applied(self, rows: int):
        """Every linear on its tiling for `rows` (cuBLAS where none won) while a graph of that bucket is captured."""
        for module in self.linears:
            module.tiling = self.chosen.get((self.shape_of(module), rows))
        try:
            yield
        finally:
            for module in self.linears:
                module.tiling = None

    def step_us(self, rows: int) -> tuple[float, float]:
        """A decode step's linears at bucket `rows` (with the MLP's activation after the gated), in microseconds as timed:
        (all on cuBLAS, as planned)."""
        by_shape = {(t["out"], t["in"], t["gated"]): t for t in self.timings if t["rows"] == rows}
        keys = [(s.out_features, s.in_features, s.gated) for s in map(self.shape_of, self.linears)]
        rows_of = [by_shape[key] for key in keys if key in by_shape]
        return sum(t["cublas_us"] for t in rows_of), sum(t["best_us"] for t in rows_of)

    def summary(self) -> str:
        won = sum(t["tiling"] is not None for t in self.timings)
        fused = sum(t["tiling"] is not None and t["tiling"]["gated"] for t in self.timings)
        largest = max((t["rows"] for t in self.timings), default=None)
        if largest is None:
            return "no bucket of 64 rows or more: cuBLAS throughout"
        cublas, planned = self.step_us(largest)
        return (f"Triton won {won} of {len(self.timings)} (shape, bucket) pairs, {fused} of them writing the MLP's "
                f"activation; a step's linears at {largest} rows {cublas:.0f} us on cuBLAS, {planned:.0f} us as planned")


def shape_of(module) -> Shape:
    return Shape(module.out_features, module.in_features, module.bias is not None)


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and enough copies of it that cycling through them reads from HBM, as a step reads each layer's
    weights once; as many as fit where the KV pool left less room (gpu_memory_utilization near 1)."""
    copies = [weight]
    for _ in range(min(15, COLD_BYTES // (weight.numel() * weight.element_size()))):
        try:
            copies.append(weight.clone())
        except torch.cuda.OutOfMemoryError:
            break
    return copies


def plannable(module) -> bool:
    """A dense 16-bit CUDA linear: not quantized (bitsandbytes drops the dense weight), not on GGUF blocks. fp32
    keeps cuBLAS: the parity tests compare it with transformers' own F.linear."""
    weight = getattr(module, "weight", None)
    return (weight is not None and weight.is_cuda and weight.dtype in PLANNED_DTYPES
            and module.bnb is None and module.blocks is None)
