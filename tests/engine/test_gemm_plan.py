"""The linears' kernel plan (`engine/gemm_plan.py`): what it steers and when, with the Triton linear on CUDA where
there is one, else on CPU under triton's interpreter; timed against cuBLAS and captured in a graph on CUDA (marker
`gpu`)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.gemm_plan import GemmPlan, Shape, plannable, shape_of
from engine.kernels.triton.fused_ops import TritonFusedOps
from engine.kernels.triton.matmul import TILINGS, Tiling
from engine.layers.linear import Linear
from engine.models.llama import MLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def linear(out_features: int, in_features: int, bias: bool, device="cpu", dtype=torch.float32, seed=0) -> Linear:
    module = Linear(in_features, out_features, bias)
    generator = torch.Generator().manual_seed(seed)
    module.weight.data = torch.randn(out_features, in_features, generator=generator).to(device, dtype)
    if bias:
        module.bias.data = torch.randn(out_features, generator=generator).to(device, dtype)
    return module


def test_a_tiling_applies_only_to_its_bucket_and_only_inside_the_context():
    """Inside `applied(rows)` each linear computes on its shape's tiling for that bucket (a shape that none won
    keeps cuBLAS); after it, even one left by an error, every linear is back on cuBLAS."""
    qkv, down = linear(96, 64, True), linear(64, 160, False, seed=1)
    tiling = Tiling(64, 64, 128, 2)
    plan = GemmPlan([qkv, down], {(shape_of(down), 64): tiling})
    with plan.applied(64):
        assert down.tiling == tiling and qkv.tiling is None
    with plan.applied(80):
        assert down.tiling is None
    with pytest.raises(RuntimeError), plan.applied(64):
        raise RuntimeError("a capture that failed")
    assert down.tiling is None and qkv.tiling is None


def test_a_linear_on_a_tiling_computes_what_cublas_would():
    down = linear(72, 300, True, DEVICE, seed=2)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    down.tiling = Tiling(64, 64, 128, 4)
    torch.testing.assert_close(down(x), F.linear(x, down.weight, down.bias), rtol=1e-5, atol=1e-4)


def test_a_cpu_linear_is_not_planned_and_a_shape_names_its_bias():
    assert not plannable(linear(8, 8, False))
    assert shape_of(linear(8, 16, True)) == Shape(8, 16, True) != shape_of(linear(8, 16, False))


def test_the_plan_keeps_a_tiling_only_where_it_timed_faster_and_skips_one_that_fails(monkeypatch):
    """The choosing alone, with the clock faked (each candidate still computes once, under the interpreter): cuBLAS
    takes 10 us; at 64 rows one tiling takes 7 and another fails to launch; at 128 rows none beats cuBLAS."""
    import engine.gemm_plan as gemm_plan
    from engine.kernels.triton.matmul import TILINGS

    fast, broken = TILINGS[1], TILINGS[2]
    costs = iter([10.0] + [7.0 if t == fast else RuntimeError("out of shared memory") if t == broken else 12.0
                           for t in TILINGS] + [10.0] + [11.0] * len(TILINGS))

    def fake_time(call, weights):
        cost = next(costs)
        if isinstance(cost, Exception):
            raise cost
        call(weights[0])
        return cost

    monkeypatch.setattr(gemm_plan, "time_calls", fake_time)
    down = linear(40, 96, False, DEVICE)
    plan = GemmPlan.measure([down], [8, 64, 128])
    assert plan.chosen == {(shape_of(down), 64): fast}
    assert [(t["rows"], t["cublas_us"], t["best_us"], t["tiling"] is not None) for t in plan.timings] == \
        [(64, 10.0, 7.0, True), (128, 10.0, 10.0, False)]
    assert plan.step_us(64) == (10.0, 7.0) and "at 128 rows 10 us on cuBLAS, 10 us as planned" in plan.summary()


def test_a_gate_up_projection_is_timed_with_the_activation_and_may_write_it(monkeypatch):
    """A gated shape's baseline is cuBLAS then the activation; the plain tilings run before the activation too, the
    gated ones (one slice of K) write it themselves. With the clock faked, a gated tiling at 6 us beats 10 and 12."""
    import engine.gemm_plan as gemm_plan

    winner = dataclasses.replace(TILINGS[4], gated=True)
    fed = []

    def fake_time(call, weights):
        before = len(fed)
        call(weights[0])
        return 10.0 if len(fed) == before else 6.0 if fed[-1] == winner else 12.0  # cuBLAS, or a tiling

    def counting_matmul(x, weight, bias, tiling):
        fed.append(tiling)
        return real_matmul(x, weight, bias, tiling)

    real_matmul = gemm_plan.matmul
    monkeypatch.setattr(gemm_plan, "time_calls", fake_time)
    monkeypatch.setattr(gemm_plan, "matmul", counting_matmul)
    gate_up, down = linear(80, 96, False, DEVICE), linear(96, 40, False, DEVICE, seed=1)
    activations = []
    plan = GemmPlan.measure([gate_up, down], [64], gated=[gate_up],
                            activation=lambda y: activations.append(y.shape) or TritonFusedOps.silu_and_mul(y))
    one_slice = [dataclasses.replace(t, gated=True) for t in TILINGS if t.split_k == 1]
    assert fed[:len(TILINGS) + len(one_slice)] == list(TILINGS) + one_slice and len(one_slice) == 4
    assert activations == [(64, 80)] * (1 + len(TILINGS)), "after cuBLAS and after each plain tiling"
    assert plan.chosen == {(Shape(80, 96, False, gated=True), 64): winner}
    assert [(t["out"], t["gated"], t["best_us"]) for t in plan.timings] == [(80, True, 6.0), (96, False, 10.0)]
    with plan.applied(64):
        assert gate_up.writes_activation and down.tiling is None
    assert not gate_up.writes_activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mlp_whose_gate_up_projection_writes_the_activation_gives_the_same_output(dtype):
    """On a gated tiling the MLP skips its activation kernel, and its output is, to the bit, what the same tiling
    then the activation kernel give: the graphs' fused MLP changes no token. (An intermediate size on the tiles:
    numpy's matmul under the interpreter rounds an fp32 column by its place in the tile.)"""
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=128)).to(DEVICE, dtype)
    generator = torch.Generator().manual_seed(11)
    for module in (mlp.gate_up_proj, mlp.down_proj):
        module.weight.data = (torch.randn(module.weight.shape, generator=generator) / 8).to(DEVICE, dtype)
    mlp.fused = TritonFusedOps()
    hidden = torch.randn(70, 64, generator=generator).to(DEVICE, dtype)
    plain = Tiling(64, 64, 128, 1)
    mlp.gate_up_proj.tiling = plain
    expected = mlp(hidden)
    mlp.gate_up_proj.tiling = dataclasses.replace(plain, gated=True)
    mlp.activation = None  # the gated path must not call it
    assert torch.equal(mlp(hidden), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_plan_keeps_the_faster_kernel_and_a_graph_replays_it():
    """Every shape is timed at every bucket of 64 rows and more; a tiling is kept only where it beat cuBLAS; a graph
    captured inside `applied` replays the same values as the eager cuBLAS call, to bf16's rounding."""
    down, gate_up = linear(1536, 8960, False, "cuda", torch.bfloat16), linear(17920, 1536, False, "cuda", torch.bfloat16, 1)
    assert plannable(down) and plannable(gate_up)
    plan = GemmPlan.measure([down, gate_up], [1, 8, 64, 256], gated=[gate_up], activation=TritonFusedOps.silu_and_mul)
    assert sorted((t["out"], t["rows"], t["gated"]) for t in plan.timings) == \
        [(1536, 64, False), (1536, 256, False), (17920, 64, True), (17920, 256, True)]
    for t in plan.timings:
        assert 0 < t["best_us"] <= t["cublas_us"]
        won = (Shape(t["out"], t["in"], False, t["gated"]), t["rows"]) in plan.chosen
        assert won == (t["tiling"] is not None) == (t["best_us"] < t["cublas_us"])
    x = torch.randn(256, 8960, device="cuda").to(torch.bfloat16)
    down.tiling = Tiling(64, 64, 128, 4)  # a split tiling, whatever the plan chose
    down(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = down(x)
    down.tiling = None
    graph.replay()
    torch.testing.assert_close(y, down(x), rtol=2e-2, atol=2e-2)
    hidden = torch.randn(256, 1536, device="cuda").to(torch.bfloat16)
    gate_up.tiling = Tiling(64, 128, 64, 1, gated=True)  # the activation from the epilogue, on the GPU's own MMA
    activated = gate_up(hidden)
    gate_up.tiling = None
    torch.testing.assert_close(activated, TritonFusedOps.silu_and_mul(gate_up(hidden)), rtol=2e-2, atol=2e-2)
