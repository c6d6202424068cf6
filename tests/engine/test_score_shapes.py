"""Models whose attention scores are shaped beyond the causal mask, on transformers' code (the fallback): sliding
windows (Gemma 3's local layers, Mistral's every layer) and logit soft-capping (Gemma 2). Random tiny checkpoints with
a 16-token window, so prompts of up to ~300 tokens, chunked prefill and cached prefixes all cross it; greedy output
is checked against transformers' eager attention in fp32 at every position."""
import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          MistralConfig, MistralForCausalLM)

from engine import LLM, SamplingParams
from engine.attention_backend import choose_attention_backend
from engine.config import EngineConfig
from engine.models import load_hf_config, score_shaping
from tests.engine.helpers import assert_matches_hf, assert_varied
from tests.engine.test_synthetic_models import shared_prefix_prompts, varied_prompts
from tests.fixtures.tiny_models import random_checkpoint, synthetic_tokenizer
from tests.fixtures.triton_interpreter import cpu_triton_marks

WINDOW = 16
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=2048, initializer_range=0.2)
# name -> (model class, config class, fields, what the engine must say only the torch path computes)
# Gemma's embeddings are scaled up by sqrt(hidden): tied to the head, a random one predicts its input token again
GEMMA = dict(SMALL, sliding_window=WINDOW, query_pre_attn_scalar=32, initializer_range=0.08, tie_word_embeddings=False)
MODELS = {
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(GEMMA, layer_types=["sliding_attention", "full_attention"]),
               "sliding-window attention"),
    # a cap of 2 bends scores of this random model's size (at Gemma 2's 50 the tanh is all but linear)
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(GEMMA, attn_logit_softcapping=2.0),
               "sliding-window attention and attention logit soft-capping"),
    "mistral": (MistralForCausalLM, MistralConfig, dict(SMALL, sliding_window=WINDOW), "sliding-window attention"),
}
MODES = {"plain": {}, "chunked-prefill": {"max_num_batched_tokens": 40, "enable_prefix_caching": False},
         "prefix-hits": {"max_num_batched_tokens": 128}}


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("score-shapes")
    return {name: random_checkpoint(root / name, model_class, config_class, fields)
            for name, (model_class, config_class, fields, _) in MODELS.items()}


# (device, attention backend that `auto` picks, which cases): on CPU the torch path in every case, and the Triton
# kernels under the interpreter where both a window and a cap cross chunks of 40 tokens; on CUDA (marker gpu) the
# Triton kernels in every case. A cached prefix reaches the kernels as an earlier chunk's context does (a block table
# and a context length), so the interpreted prefix-hit case (12 s) ran no other kernel path
def interpreted(name: str, mode: str) -> bool:
    return name == "gemma2" and mode == "chunked-prefill"


CASES = [pytest.param(name, mode, device, backend,
                      marks=[pytest.mark.gpu] if device == "cuda" else cpu_triton_marks() if backend == "triton" else [])
         for name in MODELS for mode in MODES
         for device, backend in (("cpu", "torch"), ("cpu", "triton"), ("cuda", "triton"))
         if backend != "triton" or device == "cuda" or interpreted(name, mode)]


@pytest.mark.parametrize("name,mode,device,backend", CASES)
def test_windows_and_soft_caps_match_transformers_at_every_position(checkpoints, tokenizer, name, mode, device,
                                                                      backend):
    path = checkpoints[name]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = (shared_prefix_prompts if mode == "prefix-hits" else varied_prompts)(tokenizer)
    chosen = {"attention_backend": backend} if device == "cpu" and backend == "triton" else {}  # else auto's pick
    llm = LLM(model=path, dtype="float32", device=device, num_kv_blocks=256, **chosen, **MODES[mode])
    assert llm.engine.model.impl == "hf" and llm.engine.settings()["attention_backend"] == backend
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    assert_varied(outputs)
    exact = sum(assert_matches_hf(hf_model, prompt, out, f"{name}/{mode} prompt {i}")
                for i, (prompt, out) in enumerate(zip(prompts, outputs)))
    assert exact >= len(prompts) * 20 - 2, f"{exact} exact positions"
    stats = llm.engine.stats()
    assert stats.idle and (mode != "prefix-hits" or stats.prefix_cache_hits > 0), stats


@pytest.mark.parametrize("name", list(MODELS))
def test_the_engine_names_what_the_cpu_kernels_cannot_compute_and_refuses_them(checkpoints, name):
    path, reason = checkpoints[name], MODELS[name][3]
    assert score_shaping(load_hf_config(EngineConfig(model=path))) == reason
    assert choose_attention_backend(EngineConfig(model=path), "cuda", (9, 0), reason) == "triton"
    assert choose_attention_backend(EngineConfig(model=path), "cpu", None, reason) == "torch"
    with pytest.raises(ValueError, match=f"attention_backend cpp cannot compute this model's {reason}"):
        LLM(model=path, attention_backend="cpp", num_kv_blocks=16)


def test_models_without_windows_keep_their_kernels(tmp_path):
    """Qwen2-style configs carry a sliding_window their use_sliding_window turns off; Llama's have none."""
    from transformers import Qwen2Config

    qwen = Qwen2Config(sliding_window=4096, use_sliding_window=False, num_hidden_layers=2)
    assert score_shaping(qwen) is None
    assert score_shaping(Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=0,
                                                  num_hidden_layers=2)) == "sliding-window attention"
    assert score_shaping(MistralConfig(sliding_window=None)) is None


def test_a_model_with_attention_sinks_is_refused_before_its_weights_load(tmp_path):
    from transformers import GptOssConfig

    GptOssConfig(num_hidden_layers=2, num_local_experts=4, hidden_size=64, intermediate_size=64, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)  # a config, no weights
    with pytest.raises(ValueError, match=r"attention sinks \(gpt_oss\) are not implemented"):
        LLM(model=str(tmp_path), num_kv_blocks=16)


def test_attention_the_engine_does_not_compute_is_named_not_approximated():
    """Chunked attention (Llama 4's) and bidirectional attention come from masks transformers builds, which the
    paged attention does not read: refused, as sinks are."""
    from transformers import Gemma3TextConfig, Qwen2Config

    from engine.models import unimplemented_attention

    chunked = Qwen2Config(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"])
    assert unimplemented_attention(chunked) == "layer types chunked_attention are"
    assert unimplemented_attention(Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)) == \
        "bidirectional attention is"
    assert unimplemented_attention(Gemma3TextConfig(num_hidden_layers=2)) is None
