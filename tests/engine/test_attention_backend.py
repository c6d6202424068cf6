"""Which attention code runs, and which combinations are refused at start-up, before any weight loads."""
import pytest

from engine.attention_backend import choose_attention_backend
from engine.config import EngineConfig


def test_an_fp8_cache_keeps_each_devices_default_backend():
    assert choose_attention_backend(EngineConfig(kv_cache_dtype="fp8"), "cpu") == "cpp"
    torch_path = EngineConfig(kv_cache_dtype="fp8_e5m2", attention_backend="torch")
    assert choose_attention_backend(torch_path, "cpu") == "torch"
    assert choose_attention_backend(EngineConfig(kv_cache_dtype="fp8_e5m2"), "cuda", (9, 0)) == "triton"


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_e4m3_needs_compute_capability_8_9_and_e5m2_runs_from_8_0(name):
    with pytest.raises(ValueError, match=r"needs compute capability 8.9 .* this GPU is 8.0: use fp8_e5m2"):
        choose_attention_backend(EngineConfig(kv_cache_dtype=name), "cuda", (8, 0))
    assert choose_attention_backend(EngineConfig(kv_cache_dtype=name), "cuda", (8, 9)) == "triton"
    assert choose_attention_backend(EngineConfig(kv_cache_dtype=name), "cuda", (9, 0)) == "triton"
    assert choose_attention_backend(EngineConfig(kv_cache_dtype="fp8_e5m2"), "cuda", (8, 0)) == "triton"
