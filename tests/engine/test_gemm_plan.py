"""The linears' kernel plan (`engine/gemm_plan.py`): what it steers and when, with the Triton linear on CUDA where
there is one, else on CPU under triton's interpreter; timed against cuBLAS and captured in a graph on CUDA (marker
`gpu`)."""
import pytest
import torch
import torch.nn.functional as F

from engine.gemm_plan import GemmPlan, Shape, plannable, shape_of
from engine.kernels.triton.matmul import Tiling
from engine.layers.linear import Linear

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_plan_keeps_the_faster_kernel_and_a_graph_replays_it():
    """Every shape is timed at every bucket of 64 rows and more; a tiling is kept only where it beat cuBLAS; a graph
    captured inside `applied` replays the same values as the eager cuBLAS call, to bf16's rounding."""
    down, gate_up = linear(1536, 8960, False, "cuda", torch.bfloat16), linear(17920, 1536, False, "cuda", torch.bfloat16, 1)
    assert plannable(down) and plannable(gate_up)
    plan = GemmPlan.measure([down, gate_up], [1, 8, 64, 256])
    assert sorted((t["out"], t["rows"]) for t in plan.timings) == [(1536, 64), (1536, 256), (17920, 64), (17920, 256)]
    for t in plan.timings:
        assert 0 < t["best_us"] <= t["cublas_us"]
        won = (Shape(t["out"], t["in"], False), t["rows"]) in plan.chosen
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
