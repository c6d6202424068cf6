"""LoRA on the engine's linears: y = base(x) + (x A^T)(scale B)^T for the rows of each adapter in a step, so requests
of several adapters and of the base model share one batch, as vLLM's punica kernels allow. Here each adapter present
in a step costs a gather, two thin matmuls and a scatter-add per linear; a step of one adapter only, two matmuls."""
from __future__ import annotations

import torch


class LoRAStep:
    """Which rows of the step's flat batch run which adapter: set by the model runner before each forward, read by
    every linear that has adapters. Rows of the base model are in no group."""

    def __init__(self, names: list[str]):
        self.index = {name: i for i, name in enumerate(names)}  # adapter name -> its index in every LinearLoRA
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (adapter index, row indices; None: every row)

    @property
    def active(self) -> bool:
        return bool(self.groups)


class LinearLoRA:
    """One linear's adapters, by index: `down` [in, rank] (A^T) and `up` [rank, out] (scale B^T)."""

    def __init__(self, step: LoRAStep):
        self.step = step
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for index, rows in self.step.groups:
            pair = self.adapters.get(index)
            if pair is None:  # this adapter leaves this linear alone
                continue
            down, up = pair
            if rows is None:
                y.addmm_(x @ down, up)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ down) @ up)
        return y

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.adapters.values() for t in pair)
