import pytest
import torch

from engine.layers.kv_cache_dtype import as_stored, raw, resolve_kv_cache_dtype


def test_names_resolve_as_vllms_do():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) is torch.float8_e4m3fn  # vLLM's fp8 is e4m3
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float16) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2


@pytest.mark.parametrize("dtype,largest", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_values_past_the_range_saturate_instead_of_becoming_inf_or_nan(dtype, largest):
    stored = as_stored(torch.tensor([1e5, -1e6, 3.0, -0.0], dtype=torch.bfloat16), dtype).float()
    assert stored.tolist() == [largest, -largest, 3.0, 0.0] and stored[3].signbit()


def test_an_fp8_tensor_moves_as_bytes_and_others_as_themselves():
    fp8 = torch.tensor([1.5, -2.0]).to(torch.float8_e4m3fn)
    assert raw(fp8).dtype == torch.uint8 and raw(fp8).data_ptr() == fp8.data_ptr()
    dense = torch.ones(2)
    assert raw(dense) is dense
