"""Greedy output of the engine, checked position by position against transformers' fp32 forward on the same
context (teacher-forced), on both attention paths (torch, C++ kernel), in every scheduling mode, at head sizes 64
(the embedded model), 80 (a random Llama) and 128 (a random Qwen2 with qkv bias)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine import LLM, SamplingParams
from engine.cpu_kernels import have_compiler
from tests.engine.helpers import assert_matches_hf, assert_varied, load_hf_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
TOPICS = ["the ocean", "a robot", "tea", "mountains", "prime numbers", "a lighthouse", "jazz", "winter"]
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when movable type made books cheaper "
    "and more common. Scholars shared ideas faster, and literacy spread across Europe over the following centuries. "
)
SYSTEM = "You are a careful assistant. Answer briefly, in plain words, and never invent facts. " * 3


def varied_prompts(tokenizer) -> list[list[int]]:
    """16 prompts from 1 to about 500 tokens: bare ids, plain text, chat, and a long document."""
    prompts = [[tokenizer.encode("Hello")[0]], tokenizer.encode("Once upon a time")]
    for i, topic in enumerate(TOPICS):
        text = f"Write a short story about {topic}." if i % 2 else f"Explain {topic} to a child."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))
    prompts += [PARAGRAPH * n + "Summarize the text above." for n in (2, 4, 8, 12)]
    prompts += ["Count: " + " ".join(str(i) for i in range(60)), "List three colors:"]
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    assert len(ids) == 16 and min(map(len, ids)) == 1 and 400 < max(map(len, ids)) <= 500, [len(i) for i in ids]
    return ids


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {topic}, part {i}."}],
            tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for i, topic in enumerate(TOPICS * 2)
    ]


def random_checkpoint(path, tokenizer, model_class, config):
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)  # init 0.2: varied greedy output (0.02 repeats one or two tokens)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """name -> (checkpoint, HF reference model). Random configs are built here: nothing is downloaded."""
    vocab, root = len(tokenizer), tmp_path_factory.mktemp("parity-models")
    llama80 = LlamaConfig(vocab_size=vocab, hidden_size=160, intermediate_size=320, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=80, max_position_embeddings=1024,
                          initializer_range=0.2, rope_theta=10000.0, tie_word_embeddings=True)
    qwen128 = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                          initializer_range=0.2, rope_theta=1000000.0, tie_word_embeddings=False)
    checkpoints = {
        "smollm2-hd64": "SmolLM2-135M-Instruct",
        "llama-hd80": random_checkpoint(root / "llama", tokenizer, LlamaForCausalLM, llama80),
        "qwen2-hd128": random_checkpoint(root / "qwen2", tokenizer, Qwen2ForCausalLM, qwen128),
    }
    return {name: (path, load_hf_model(path)) for name, path in checkpoints.items()}


# mode -> (prompts, engine arguments, what the run must show it exercised)
MODES = {
    "plain": (varied_prompts, {"num_kv_blocks": 256}, lambda s: s.num_preemptions == 0),
    "preemption": (varied_prompts, {"num_kv_blocks": 48}, lambda s: s.num_preemptions > 0),
    # a pool this small evicts cached blocks while later prompts still hit the shared system prompt
    "prefix-hits": (shared_prefix_prompts, {"num_kv_blocks": 40, "max_num_batched_tokens": 256},
                    lambda s: s.prefix_cache_hits >= 8 * 64 and s.prefix_cache_evictions > 0),
    "chunked-prefill": (varied_prompts, {"num_kv_blocks": 256, "max_num_batched_tokens": 48, "enable_prefix_caching": False},
                        lambda s: s.num_preemptions == 0),
}
BACKENDS = [("torch", ()), ("cpp", pytest.mark.skipif(not have_compiler(), reason="no C++ compiler"))]  # (name, marks)


def parity_cases() -> list:
    """Every model, backend and mode, but the embedded model on torch attention in plain mode only: its 30 layers take
    8-14 s a case there, the C++ path runs it in all four, and the random models (here and in
    test_synthetic_models.py, head size 64 and GQA 3 among them) run torch in all four."""
    return [pytest.param(model, backend, mode, marks=marks)
            for model in ("smollm2-hd64", "llama-hd80", "qwen2-hd128") for backend, marks in BACKENDS for mode in MODES
            if not (model == "smollm2-hd64" and backend == "torch" and mode != "plain")]


@pytest.mark.parametrize("model,backend,mode", parity_cases())
def test_greedy_output_matches_hf_at_every_position(models, tokenizer, model, backend, mode):
    path, hf_model = models[model]
    make_prompts, engine_args, exercised = MODES[mode]
    prompts = make_prompts(tokenizer)
    llm = LLM(model=path, dtype="float32", attention_backend=backend, **engine_args)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert exercised(stats), f"{mode} was not exercised: {stats}"
    assert (llm.engine.runner.decode_kernel is not None) == (backend == "cpp")
    assert_varied(outputs)
    exact = sum(assert_matches_hf(hf_model, prompt, out, f"{model}/{backend}/{mode} prompt {i}")
                for i, (prompt, out) in enumerate(zip(prompts, outputs)))
    assert exact >= len(prompts) * NEW_TOKENS - 2, f"{exact} exact positions: near-ties should be rare"


@pytest.mark.long  # inductor's compile, 30 s for both; `compile` is off by default (BENCHMARKS.md, ninth session)
@pytest.mark.skipif(not have_compiler(), reason="no C++ compiler: inductor's CPU code is C++")
@pytest.mark.parametrize("model", ["llama-hd80", "qwen2-hd128"])
def test_compiled_decoder_matches_hf(models, tokenizer, model, monkeypatch):
    """`compile: true`: every step with a prompt in it runs through one inductor graph with attention as a custom
    op (decode-only steps take the one native call), under preemption and chunked prefill (mixed decode + prefill
    steps), and still matches HF at every position."""
    path, hf_model = models[model]
    prompts = varied_prompts(tokenizer)
    llm = LLM(model=path, dtype="float32", compile=True, num_kv_blocks=48, max_num_batched_tokens=48)
    assert llm.engine.model.model.native_dense_weights is not None
    runner, compiled = llm.engine.runner, llm.engine.model.compiled
    decode_only, execute, compiled_before = [], runner.execute, compiled.steps
    monkeypatch.setattr(runner, "execute", lambda batch: decode_only.append(set(batch.num_new_tokens) == {1}) or execute(batch))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, stats
    assert compiled.steps - compiled_before == decode_only.count(False) > 0 and compiled.graphs == 1, (
        compiled.steps - compiled_before, decode_only.count(False), compiled.graphs)
    assert_varied(outputs)
    exact = sum(assert_matches_hf(hf_model, prompt, out, f"{model}/compiled prompt {i}")
                for i, (prompt, out) in enumerate(zip(prompts, outputs)))
    assert exact >= len(prompts) * NEW_TOKENS - 2, f"{exact} exact positions: near-ties should be rare"
