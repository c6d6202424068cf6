"""Model loading: the native Llama-family path or transformers' code chosen by architecture, NF4 through
bitsandbytes, and a second architecture family (GPT-2) on the fallback."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from engine import LLM, SamplingParams
from tests.engine.helpers import assert_matches_hf, assert_varied

pytestmark = pytest.mark.slow


def test_nf4_answers_a_simple_factual_question():
    llm = LLM(quantization="nf4", num_kv_blocks=64)
    assert llm.engine.model.impl == "native"  # bitsandbytes' modules inside the native model (bnb_linear.py)
    linear = llm.engine.model.model.layers[0].mlp.down_proj.bnb
    assert type(linear).__name__ == "Linear4bit", type(linear)
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)[0]
    assert out.text.strip() and "Paris" in out.text, out.text


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, tokenizer):
    """A small randomly initialised GPT-2 (learned positions, fused QKV, Conv1D), saved like any HF checkpoint."""
    torch.manual_seed(0)
    # initializer_range 0.2: varied greedy output (at 0.02 it repeats its last token, which hides broken attention)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=64, n_layer=3, n_head=4, initializer_range=0.2)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_gpt2_family_matches_hf_at_every_position(tiny_gpt2, tokenizer):
    hf = GPT2LMHeadModel.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(t) for t in ("Hello there", "A much longer prompt " * 8, "x")]
    llm = LLM(model=str(tiny_gpt2), dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    assert llm.engine.model.impl == "hf"
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_varied(outs)
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out, f"gpt2 prompt of {len(prompt)}")


def test_native_model_is_refused_where_it_cannot_run(tiny_gpt2):
    with pytest.raises(ValueError, match="no native model for GPT2LMHeadModel"):
        LLM(model=str(tiny_gpt2), model_impl="native", num_kv_blocks=16)


def test_compile_is_refused_on_the_hf_fallback_rather_than_ignored(tiny_gpt2):
    with pytest.raises(ValueError, match="compile runs on the native model only.*GPT2LMHeadModel"):
        LLM(model=str(tiny_gpt2), compile=True, num_kv_blocks=16)


def test_resident_weight_bytes_are_the_checkpoint_plus_the_packed_tied_head(llm32):
    """fp32: every checkpoint tensor once, plus the LM head's own packed copy of the tied embedding."""
    from engine.models.loader import checkpoint_dir, checkpoint_tensors, resolve_model_path

    cfg = llm32.engine.model.config
    assert cfg.tie_word_embeddings
    stored = sum(t.numel() for _, t in checkpoint_tensors(checkpoint_dir(resolve_model_path("SmolLM2-135M-Instruct"))))
    assert llm32.engine.model.weight_bytes() == 4 * (stored + cfg.vocab_size * cfg.hidden_size)


def test_llama_family_runs_native_by_default_and_hf_when_asked(llm32, tokenizer):
    """The embedded model is a Llama: native unless model_impl says hf, and the fallback still matches HF."""
    assert llm32.engine.model.impl == "native"
    llm = LLM(dtype="float32", num_kv_blocks=64, model_impl="hf")
    assert llm.engine.model.impl == "hf"
    prompts = [tokenizer.encode("Once upon a time"), tokenizer.encode("The three primary colors are")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fallback = llm.generate(prompts, params, use_tqdm=False)
    native = llm32.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fallback] == [o.token_ids for o in native]
    assert llm.engine.stats().kv_blocks_free == 64


@pytest.fixture(scope="module")
def stored_nf4(tmp_path_factory):
    """A checkpoint stored in bitsandbytes' 4-bit format, as unsloth's `-bnb-4bit` models are published."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed on this machine")
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.fixtures.tiny_models import tiny_checkpoint

    source = Path(tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-hd64"))
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    path = tmp_path_factory.mktemp("stored-nf4") / "model"
    AutoModelForCausalLM.from_pretrained(source, quantization_config=quantized, device_map={"": "cpu"}).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return str(path)


def test_a_checkpoint_stored_quantized_runs_on_transformers_code_with_its_own_quantization(stored_nf4):
    """The native linears cannot read packed 4-bit weights and their scales (the start failed on a size mismatch):
    such a checkpoint runs on transformers' code, which reads its quantization_config, and matches it."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=stored_nf4, dtype="float32", num_kv_blocks=64)
    assert (llm.engine.settings()["model_impl"], llm.engine.settings()["linear_type"]) == ("hf", "Linear4bit")
    hf_model = AutoModelForCausalLM.from_pretrained(stored_nf4, dtype=torch.float32, device_map={"": "cpu"}).eval()
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7], list(range(40, 80))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert_varied(outputs)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert_matches_hf(hf_model, prompt, out, f"stored nf4 prompt {i}")
    with pytest.raises(ValueError, match=r"model_impl native cannot run .*: pre-quantized weights \(bitsandbytes\)"):
        LLM(model=stored_nf4, dtype="float32", num_kv_blocks=64, model_impl="native")
    with pytest.raises(ValueError, match=r"quantization int8: .* is stored quantized already \(bitsandbytes\)"):
        LLM(model=stored_nf4, dtype="float32", num_kv_blocks=64, quantization="int8")


def test_a_checkpoint_without_a_tokenizer_runs_with_the_one_named(tmp_path):
    """vLLM's --tokenizer: weights shipped without tokenizer files run with another checkpoint's tokenizer (and its
    chat template), as the same weights with their own; one with more tokens than the model embeds is refused."""
    import shutil
    from pathlib import Path

    from tests.fixtures.tiny_models import tiny_checkpoint

    source = Path(tiny_checkpoint(tmp_path, "llama-hd64"))
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (source / name).is_file():
            shutil.copy(source / name, bare / name)
    with pytest.raises(Exception):
        LLM(model=str(bare), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    conversation = [{"role": "user", "content": "Name three colours."}]
    named = LLM(model=str(bare), tokenizer=str(source), dtype="float32", num_kv_blocks=64)
    own = LLM(model=str(source), dtype="float32", num_kv_blocks=64)
    (a,), (b,) = (llm.chat(conversation, params, use_tqdm=False) for llm in (named, own))
    assert (a.prompt_token_ids, a.token_ids, a.text) == (b.prompt_token_ids, b.token_ids, b.text)
    assert_varied([a])
    with pytest.raises(ValueError, match=r"tokenizer 'SmolLM2-135M-Instruct' has 49152 tokens; .* embeds \d+"):
        LLM(model=str(bare), tokenizer="SmolLM2-135M-Instruct", dtype="float32", num_kv_blocks=64)
