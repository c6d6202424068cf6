"""The GPU datasheet table behind `roofline.py`, `make gpu-check`'s roofline goal and the kernels' share of peak: the
GPU torch names is found by its most specific key, and a decode step is bound by FLOPs once its batch is large."""
from benchmarks.gpu_check import SIZES, goals, roofline_tok_s
from benchmarks.roofline import GPUS, estimate, gpu_spec


def test_each_gpu_torch_names_gets_its_own_datasheet_figures():
    assert gpu_spec("NVIDIA H100 80GB HBM3") == GPUS["H100"]  # the SXM part
    assert gpu_spec("NVIDIA H100 PCIe") == GPUS["H100 PCIe"]
    assert gpu_spec("NVIDIA H200") == GPUS["H200"]
    assert gpu_spec("NVIDIA L40S") == GPUS["L40S"] != GPUS["L4"]
    assert gpu_spec("NVIDIA L4") == GPUS["L4"]
    assert gpu_spec("cpu (interpreter)") is None


def test_a_decode_step_is_bound_by_bytes_at_small_batches_and_by_flops_at_large_ones():
    bandwidth, tflops = GPUS["H200"]
    small, large, larger = (estimate(bandwidth, tflops, batch, 128, 128) for batch in (1, 1024, 2048))
    assert small["step_ms"] < large["step_ms"]
    # compute-bound: twice the batch takes twice as long (the KV read grows as fast), so tok/s stops growing
    assert abs(larger["tok_s"] / large["tok_s"] - 1) < 1e-9
    # the H100's batch-256 figure the first GPU run was judged on is unchanged: that batch is bound by its bytes
    assert round(roofline_tok_s({"gpu": "NVIDIA H100 80GB HBM3"}, 256, SIZES["cuda"])) == 140869


def test_the_roofline_goal_is_judged_on_an_h200():
    rows = [{"batch": 1, "tok_s": 100.0}, {"batch": 256, "tok_s": 110_000.0}]
    results = {"decode": {"eager": [{"batch": 1, "tok_s": 10.0}], "graphs": rows, "graphs_async": rows},
               "engine_static": {"tok_s": 30_000.0}, "engine_static_async": {"tok_s": 20_000.0},
               "hf_static": {"tok_s": 2_000.0}}
    judged = goals(results, {"gpu": "NVIDIA H200"}, SIZES["cuda"])
    roof = judged["decode_50pct_roofline"]["roofline_tok_s"]
    assert roof == round(roofline_tok_s({"gpu": "NVIDIA H200"}, 256, SIZES["cuda"])) > 140869
    assert judged["decode_50pct_roofline"]["met"] is (110_000 >= roof / 2)
    assert judged["engine_10x_hf_static"] == {"ratio": 15.0, "met": True}
