"""LinearLoRA alone: every way a step can run adapters (all rows one adapter; rows of several adapters and of the
base model, stacked and masked or adapter by adapter; thin steps from fp32 copies in bf16) adds exactly each row's
own adapter's x A^T B^T, checked against a float64 reference."""
import pytest
import torch

from engine.layers.lora import FP32_ROWS, LinearLoRA, LoRAStep

IN, OUT = 96, 80


def pairs() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Adapter 0 of width 8, adapter 2 of width 4; slot 1's adapter leaves this linear alone (or was dropped)."""
    torch.manual_seed(0)
    return {0: (torch.randn(IN, 8), torch.randn(8, OUT)), 2: (torch.randn(IN, 4), torch.randn(4, OUT))}


def filled(step: LoRAStep, dtype: torch.dtype) -> LinearLoRA:
    """Slots of width 8 (adapter 2's pair is narrower: zero-padded); slot 1 held an adapter since dropped, and the
    adapter there now leaves this linear alone."""
    lora = LinearLoRA(step, 3, 8, IN, OUT, torch.empty(0, dtype=dtype))
    lora.put(1, torch.randn(IN, 8).to(dtype), torch.randn(8, OUT).to(dtype))
    lora.clear(1)
    for slot, (down, up) in pairs().items():
        lora.put(slot, down.to(dtype), up.to(dtype))
    return lora


def test_a_mixed_step_multiplies_only_the_slots_up_to_the_last_in_use():
    step = LoRAStep(5)
    lora = LinearLoRA(step, 5, 8, IN, OUT, torch.empty(0))  # slots 3 and 4 empty
    for slot, (down, up) in pairs().items():
        lora.put(slot, down, up)
    step.used = 3
    x, y = torch.randn(6, IN), torch.randn(6, OUT)
    rows = [0, None, 2, 2, None, 0]
    got = run_step(lora, step, x, y, rows, slots=5)
    torch.testing.assert_close(got.double(), reference(x, y, rows), rtol=1e-5, atol=1e-4)


def test_a_wider_adapter_grows_the_slots_and_keeps_the_others():
    step = LoRAStep(3)
    lora = filled(step, torch.float32).resized(4, 12)
    assert (lora.slots, lora.width, lora.filled) == (4, 12, {0, 2})
    x, y = torch.randn(5, IN), torch.randn(5, OUT)
    rows = [0, 2, None, 0, 2]
    torch.testing.assert_close(run_step(lora, step, x, y, rows, slots=4).double(), reference(x, y, rows),
                               rtol=1e-5, atol=1e-4)


def reference(x: torch.Tensor, y: torch.Tensor, adapter_of_row: list[int | None]) -> torch.Tensor:
    expected = y.double().clone()
    for row, adapter in enumerate(adapter_of_row):
        if adapter in pairs():
            down, up = pairs()[adapter]
            expected[row] += x[row].double() @ down.double() @ up.double()
    return expected


def run_step(lora: LinearLoRA, step: LoRAStep, x: torch.Tensor, y: torch.Tensor, adapter_of_row: list[int | None],
             slots: int = 3):
    rows_of: dict[int, list[int]] = {}
    for row, adapter in enumerate(adapter_of_row):
        if adapter is not None:
            rows_of.setdefault(adapter, []).append(row)
    everyone = len(rows_of) == 1 and None not in adapter_of_row
    step.set_rows([(a, None if everyone else torch.tensor(r)) for a, r in rows_of.items()],
                  None if everyone else torch.nn.functional.one_hot(
                      torch.tensor([0 if a is None else a + 1 for a in adapter_of_row]), slots + 1)[:, 1:].float())
    return lora.add_to(x, y.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, FP32_ROWS + 9])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("mix", ["one adapter", "two adapters and the base", "an adapter this linear lacks"])
def test_each_row_gets_its_own_adapter(dtype, rows, stacked, mix):
    step = LoRAStep(3)
    lora = filled(step, dtype)
    assert (lora.fp32 is not None) == (dtype == torch.bfloat16)
    lora.stacked = stacked
    adapter_of_row = {"one adapter": [2] * rows, "two adapters and the base": [[None, 0, 2][r % 3] for r in range(rows)],
                      "an adapter this linear lacks": [[1, 0][r % 2] for r in range(rows)]}[mix]
    x, y = torch.randn(rows, IN, dtype=dtype), torch.randn(rows, OUT, dtype=dtype)
    got = run_step(lora, step, x, y, adapter_of_row)
    # bf16: deltas of std ~28 rounded to 8 bits (spacing 0.125-0.5), added to y; a wrong or missing adapter is off by tens
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 1.0)
    torch.testing.assert_close(got.double(), reference(x, y, adapter_of_row), rtol=rtol, atol=atol)
    assert got.dtype == dtype


def test_no_adapter_rows_leave_the_output_alone():
    step = LoRAStep(3)
    lora = filled(step, torch.float32)
    y = torch.randn(4, OUT)
    step.set_rows([], None)
    assert torch.equal(lora.add_to(torch.randn(4, IN), y.clone()), y)
