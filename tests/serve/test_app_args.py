"""Every engine setting in the app's args reaches the served engine: checked against what its live parts use."""
import httpx
import pytest

from serve_app.config import AppArgs
from tests.serve.conftest import whole_app

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


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset(serve_app):
    """vLLM's generation config defaults, served: top_k 1 (greedy) and 3 new tokens for requests that set neither,
    through the Responses API too; a request's own fields win."""
    engine_config = {**serve_app["args"]["engine_config"],
                     "override_generation_config": {"top_k": 1, "max_new_tokens": 3}}
    auth = {"Authorization": f"Bearer {serve_app['api_key']}"}
    messages = [{"role": "user", "content": "Name three colours."}]
    with whole_app(serve_app, "defaults", topology="colocated", engine_config=engine_config) as base, \
            httpx.Client(base_url=base, headers=auth, timeout=120) as client:
        def chat(**fields) -> dict:
            reply = client.post("/v1/chat/completions", json={"messages": messages, **fields})
            assert reply.status_code == 200, reply.text
            return reply.json()

        defaulted, greedy = chat(), chat(temperature=0.0, max_tokens=3)
        assert defaulted["usage"]["completion_tokens"] == 3
        assert defaulted["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        response = client.post("/v1/responses", json={"input": "Name three colours."}).json()
        assert response["usage"]["output_tokens"] == 3
        assert response["output"][0]["content"][0]["text"] == greedy["choices"][0]["message"]["content"]
        assert chat(max_tokens=6, ignore_eos=True)["usage"]["completion_tokens"] == 6  # the request's own
