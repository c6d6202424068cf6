"""Every engine setting in the app's args reaches the served engine: checked against what its live parts use."""
import pytest

from serve_app.config import AppArgs

pytestmark = pytest.mark.slow


def test_the_served_engine_runs_with_the_settings_it_was_given(serve_app, replica_handle):
    given = AppArgs(**serve_app["args"]).engine_config
    effective = replica_handle.info.remote().result(timeout_s=10)["engine"]
    assert effective == {
        "dtype": "float32", "model_impl": "native", "linear_type": "Linear", "packed_weights": True, "block_weights": False,
        "num_kv_blocks": 1024, "kv_cache_dtype": "float32", "block_size": given.block_size,
        "enable_prefix_caching": True, "max_num_seqs": 64, "max_num_batched_tokens": given.max_num_batched_tokens,
        "long_prefill_token_threshold": given.long_prefill_token_threshold,
        "max_model_len": 8192, "decode_kernel": True, "prefill_kernel": "",  # bf16 only
        "attention_backend": "cpp", "cuda_graphs": None, "async_scheduling": False, "device": "cpu", "lora_adapters": "",
    }
    assert (given.dtype, given.num_kv_blocks, given.max_num_seqs) == ("float32", 1024, 64)
