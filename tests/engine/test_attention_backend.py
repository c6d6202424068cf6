"""Which attention code runs, and which combinations are refused at start-up, before any weight loads."""
import pytest

from engine.attention_backend import choose_attention_backend
from engine.config import EngineConfig


def test_an_fp8_cache_on_cpu_runs_the_torch_path_and_refuses_the_cpp_kernels():
    assert choose_attention_backend(EngineConfig(kv_cache_dtype="fp8"), "cpu") == "torch"
    assert choose_attention_backend(EngineConfig(kv_cache_dtype="fp8_e5m2", attention_backend="torch"), "cpu") == "torch"
    assert choose_attention_backend(EngineConfig(), "cpu") == "cpp"
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 runs on attention_backend torch"):
        choose_attention_backend(EngineConfig(kv_cache_dtype="fp8_e4m3", attention_backend="cpp"), "cpu")


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_e4m3_needs_compute_capability_8_9_and_e5m2_runs_from_8_0(name):
    with pytest.raises(ValueError, match=r"needs compute capability 8.9 .* this GPU is 8.0: use fp8_e5m2"):
        choose_attention_backend(EngineConfig(kv_cache_dtype=name), "cuda", (8, 0))
    assert choose_attention_backend(EngineConfig(kv_cache_dtype=name), "cuda", (8, 9)) == "triton"
    assert choose_attention_backend(EngineConfig(kv_cache_dtype=name), "cuda", (9, 0)) == "triton"
    assert choose_attention_backend(EngineConfig(kv_cache_dtype="fp8_e5m2"), "cuda", (8, 0)) == "triton"
