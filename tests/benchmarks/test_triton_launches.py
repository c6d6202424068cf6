"""benchmarks/triton_launches.py: a native model's decode step on the Triton backend launches one norm kernel per
sub-layer boundary, one rotary (which also writes K/V), one attention and one SiLU kernel a layer, and no KV write."""
from benchmarks.triton_launches import launches_per_decode_step


def test_a_decode_step_launches_four_kernels_a_layer_and_the_final_norm():
    counts, layers = launches_per_decode_step(batch=3)
    assert dict(counts) == {"_add_rms_norm_kernel": 2 * layers + 1, "_rotary_kernel": layers, "_decode_kernel": layers,
                            "_silu_and_mul_kernel": layers}
