"""Greedy output on the embedded model's GGUF blocks (`quantization: gguf`): checked position by position against
transformers' fp32 forward on the dequantized checkpoint (the same weights, value for value), and against the engine's
dense fp32 path."""
import pytest

from engine import LLM, SamplingParams
from engine.cpu_kernels import build_kernels
from engine.layers.linear import Linear
from engine.models import llama
from tests.engine.helpers import assert_matches_hf, assert_varied, count_native_steps, load_hf_model
from tests.engine.test_parity import varied_prompts

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
# The AVX2 and AVX-512 block kernels round activations to 16 bits per 32-element block
# (engine/csrc/quantized_matmul_cpu.cpp): on the 16 parity prompts, 768 positions, their logprob gaps to HF were
# median 1.1e-4, p99 2.0e-3, max 2.9e-3 (AVX2) and 5.5e-3 (AVX-512, interleaved rows; one position, the rest below
# 4e-3) on an AMX Xeon; the fp32 paths': ~2e-5. A wrong block, scale or row is off by far more.
BLOCKS_LOGPROB_TOLERANCE = 1e-2


def block_linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.blocks is not None]


@pytest.fixture(scope="module")
def gguf32():
    """One fp32 engine on the blocks for the module (a first GGUF load is ~10 s: the reader, the crossover timed);
    no prefix caching, so that no test reads KV another computed."""
    return LLM(dtype="float32", quantization="gguf", num_kv_blocks=256, enable_prefix_caching=False)


def test_every_matmul_on_blocks_matches_hf_on_the_dequantized_weights(gguf32, tokenizer, monkeypatch):
    llm = gguf32
    linears = block_linears(llm)
    assert len(linears) == 30 * 4 + 1  # merged qkv, o, merged gate/up, down per layer; the tied Q8_0 LM head
    for module in linears:
        monkeypatch.setattr(module, "block_rows", 1 << 30)  # the block kernel at every batch size, prefill chunks too
    prompts = varied_prompts(tokenizer)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    assert_varied(outputs)
    hf_model = load_hf_model("SmolLM2-135M-Instruct")
    exact = sum(assert_matches_hf(hf_model, prompt, out, f"gguf prompt {i}", BLOCKS_LOGPROB_TOLERANCE) for i, (prompt, out) in enumerate(zip(prompts, outputs)))
    assert exact >= len(prompts) * NEW_TOKENS - 2


def test_the_served_mix_of_blocks_and_dense_agrees_with_the_dense_fp32_path(gguf32, llm32, tokenizer):
    llm = gguf32
    rows = llm.engine.model.block_rows()
    assert rows["layers"] >= 1 and rows["lm_head"] >= 1, f"blocks never win on this CPU? {rows}"
    prompts = varied_prompts(tokenizer)[:12]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # one at a time (the block kernel's batch sizes), then all together (dense past the crossover)
    alone = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    dense = [o.token_ids for o in llm32.generate(prompts, params, use_tqdm=False)]
    for name, outputs in (("alone", alone), ("together", together)):
        identical = sum(a == b for a, b in zip(outputs, dense))
        assert identical >= len(prompts) - 1, f"{name}: {identical} of {len(prompts)} identical to the dense fp32 path"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_in_one_native_call_give_the_layer_by_layer_numbers(llm32, tokenizer, monkeypatch, dtype):
    """`engine/csrc/decoder_cpu.cpp` runs the same kernels in the same order as the Python layers: the same tokens
    and the same logprobs, bit for bit, at 1 to 4 rows a step (prefill steps stay layer by layer)."""
    assert llm32.engine.model.model.native_weights is None  # dense weights: no blocks
    # blocks up to 4 rows, not the crossover timed at load: a busy machine can put it at 0, and timing bf16's dense
    # matmuls on an AVX2 CPU took 28 s of this test
    monkeypatch.setattr(llama, "kept_crossover_rows", lambda linears, dtype, cache: 4)
    llm = LLM(dtype=dtype, quantization="gguf", num_kv_blocks=256, enable_prefix_caching=False)  # same prefill shapes twice
    assert {module.block_rows for module in block_linears(llm)} == {4}
    inner = llm.engine.model.model
    assert inner.native_weights is not None
    assert inner.one_region == bool(build_kernels().interleaved_rows())  # AVX-512 and AVX2 builds: in one OpenMP region
    native_steps = count_native_steps(inner, monkeypatch, on=lambda weights: weights is inner.native_weights)
    prompts = varied_prompts(tokenizer)[:4]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    def generate():
        return llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)

    native = generate()
    assert sum(native_steps) >= 2 * (params.max_tokens - 1)
    inner.one_region = False
    op_by_op = generate()
    assert not inner.use_native_decode(False)
    layered = generate()
    for i, (a, b, c) in enumerate(zip(native, op_by_op, layered)):
        assert a.token_ids == b.token_ids == c.token_ids and a.logprobs == b.logprobs == c.logprobs, f"prompt {i}"


def test_weight_bytes_report_the_blocks_and_the_dense_copies(gguf32, llm32):
    model = gguf32.engine.model
    blocks = sum(m.blocks.nbytes for m in block_linears(gguf32))
    assert 80e6 < blocks < 130e6  # 4.5 bits per layer weight plus fp32 scales, 8.5 per head weight
    dense_only = llm32.engine.model.weight_bytes()
    assert model.weight_bytes() == dense_only + blocks


def test_gguf_is_refused_for_a_checkpoint_that_is_not_gguf(tmp_path):
    with pytest.raises(ValueError, match="quantization gguf needs the embedded model or a local .gguf file"):
        LLM(model=str(tmp_path), dtype="float32", quantization="gguf")
