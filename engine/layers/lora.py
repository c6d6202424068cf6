"""LoRA on the engine's linears: y = base(x) + (x A^T)(scale B)^T for the rows of each adapter in a step, so requests
of several adapters and of the base model share one batch, as vLLM's punica kernels allow.

A linear keeps its adapters' pairs stacked in slots, each padded to the linear's widest adapter: `down` [in, slots x
width], `up` [slots x width, out]; loading an adapter fills one slot, dropping it frees it. A step whose rows all
run one adapter multiplies by that adapter's slices (two ops). A step that mixes adapters (or adapters and the base
model) multiplies by all slots and masks each row's intermediate to its own adapter's columns: three ops whatever the
mix, where a gather, two matmuls and a scatter-add per adapter cost 1.6x the step at four adapters (BENCHMARKS.md).
The extra multiply-adds are what the other slots' columns cost; past `in_features` columns in all (many or wide
slots) the linear takes the per-adapter path instead.

On CPU a bf16 matmul this thin costs ~20 us whatever its rows, fp32 3 us for one row, so in bf16 a step of up to
FP32_ROWS rows computes the adapters from fp32 copies (crossover measured at 32-48 rows on a 2-core AMX Xeon, rank 16
against SmolLM2's 576 x 960 projection)."""
from __future__ import annotations

import torch

FP32_ROWS = 32


class LoRAStep:
    """Which rows of the step's flat batch run which adapter: set by the model runner before each forward, read by
    every linear that has adapters. Rows of the base model run none."""

    def __init__(self, slots: int):
        self.slots = slots  # adapters every LinearLoRA has room for
        self.index: dict[str, int] = {}  # adapter name -> its slot in every LinearLoRA
        self.used = slots  # slots up to the highest one in use: a mixed step multiplies these only
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (adapter slot, its rows; None: every row)
        self.row_adapters: torch.Tensor | None = None  # mixed steps: one-hot [rows, slots]
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set_rows(self, groups: list[tuple[int, torch.Tensor | None]], row_adapters: torch.Tensor | None) -> None:
        self.groups, self.row_adapters, self._masks = groups, row_adapters, {}

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, used x width]: 1 where a column belongs to the row's adapter; one per width, dtype and step."""
        mask = self._masks.get((width, dtype))
        if mask is None:
            mask = self._masks[width, dtype] = self.row_adapters[:, : self.used].to(dtype).repeat_interleave(width, 1)
        return mask


class LinearLoRA:
    """One linear's adapters in slots: slot i's A^T is down[:, i*width:(i+1)*width], its scale * B^T the same rows of
    up (a narrower adapter zero-padded); a slot whose adapter leaves this linear alone, or is dropped, holds zeros."""

    def __init__(self, step: LoRAStep, slots: int, width: int, in_features: int, out_features: int, like: torch.Tensor):
        self.step, self.slots, self.width = step, slots, width
        self.in_features, self.out_features = in_features, out_features
        self.down = like.new_zeros(in_features, slots * width)
        self.up = like.new_zeros(slots * width, out_features)
        thin_rows_in_fp32 = like.device.type == "cpu" and like.dtype != torch.float32
        self.fp32 = (self.down.float(), self.up.float()) if thin_rows_in_fp32 else None
        self.filled: set[int] = set()
        self.stacked = slots * width <= in_features  # else mixed steps go adapter by adapter

    def put(self, slot: int, down: torch.Tensor, up: torch.Tensor) -> None:
        """An adapter's pair, down [in, rank'] and up [rank', out] with rank' <= width, into `slot`."""
        self.clear(slot)
        start = slot * self.width
        for stacked_down, stacked_up in self._copies():
            stacked_down[:, start : start + down.shape[1]] = down
            stacked_up[start : start + up.shape[0]] = up
        self.filled.add(slot)

    def clear(self, slot: int) -> None:
        """Zeros in `slot`: an adapter that leaves this linear alone may take it next, and a mixed step multiplies
        every slot (masked, but a mask selects the slot for that adapter's rows)."""
        start = slot * self.width
        for stacked_down, stacked_up in self._copies():
            stacked_down[:, start : start + self.width].zero_()
            stacked_up[start : start + self.width].zero_()
        self.filled.discard(slot)

    def _copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.down, self.up), *([self.fp32] if self.fp32 is not None else [])]

    def resized(self, slots: int, width: int) -> "LinearLoRA":
        """A copy with room for `slots` slots of `width`, holding this one's filled slots."""
        bigger = LinearLoRA(self.step, slots, width, self.in_features, self.out_features, self.down)
        for slot in self.filled:
            start = slot * self.width
            bigger.put(slot, self.down[:, start : start + self.width], self.up[start : start + self.width])
        return bigger

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.step.groups:
            return y
        if self.fp32 is not None and x.shape[0] <= FP32_ROWS:
            return self._add(x.float(), y, *self.fp32)
        return self._add(x, y, self.down, self.up)

    def _add(self, x: torch.Tensor, y: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step.row_adapters is not None and self.stacked:
            columns = step.used * self.width  # the slots past the last one in use hold zeros
            return y.add_(((x @ down[:, :columns]) * step.mask(self.width, x.dtype)) @ up[:columns])
        for index, rows in step.groups:
            if index not in self.filled:
                continue
            start = index * self.width
            down_i, up_i = down[:, start : start + self.width], up[start : start + self.width]
            if rows is None:
                y.add_((x @ down_i) @ up_i)
            else:
                y.index_add_(0, rows, ((x.index_select(0, rows) @ down_i) @ up_i).to(y.dtype))
        return y

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.down, self.up, *(self.fp32 or ())))
