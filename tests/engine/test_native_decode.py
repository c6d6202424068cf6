"""Decode steps on the dense, oneDNN-packed weights in one native call (`engine/csrc/decoder_cpu.cpp`) give the
numbers of the Python layers bit for bit; the GGUF blocks' native call has its own test in test_gguf_generation."""
import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import count_native_steps
from tests.engine.test_parity import varied_prompts

pytestmark = pytest.mark.slow


# (dtype, quantization, kv_cache_dtype): an fp8 pool (its KV write rounds, its attention widens) too, on the dense
# weights and on the GGUF blocks, whose one-region call takes only a pool of the model's dtype and so goes op by op
@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", [
    ("float32", None, "auto"), ("bfloat16", None, "auto"), ("float32", None, "fp8_e4m3"), ("float32", "gguf", "fp8")])
def test_dense_decode_steps_in_one_native_call_give_the_layer_by_layer_numbers(tokenizer, monkeypatch, dtype,
                                                                               quantization, kv_cache_dtype):
    # the same prefill shapes twice
    llm = LLM(dtype=dtype, num_kv_blocks=256, enable_prefix_caching=False, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype, max_num_seqs=2 if quantization else 128)  # GGUF: up to its crossover
    inner = llm.engine.model.model
    weights_of = (lambda: inner.native_weights) if quantization else (lambda: inner.native_dense_weights)
    if weights_of() is None:
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")  # bf16 without AVX-512 bf16 or AMX
    native_steps = count_native_steps(inner, monkeypatch, on=lambda weights: weights is weights_of())
    prompts = varied_prompts(tokenizer)[:4]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    native = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
    assert sum(native_steps) >= 2 * (params.max_tokens - 1)  # every decode step, at 4 rows and at 1
    assert not inner.use_native_decode(False)
    layered = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(native, layered)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, f"prompt {i}"
