"""Greedy output of the engine matches transformers `generate` run one prompt at a time (fp32)."""
import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import assert_matches_reference, hf_greedy, load_hf_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
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


@pytest.fixture(scope="module")
def hf_model():
    return load_hf_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def references(hf_model, tokenizer):
    cache = {}

    def get(prompts):
        for p in prompts:
            if tuple(p) not in cache:
                cache[tuple(p)] = hf_greedy(hf_model, p, NEW_TOKENS)
        return [cache[tuple(p)] for p in prompts]
    return get


def run_engine(prompts, **engine_kwargs):
    engine_kwargs.setdefault("attention_backend", "torch")  # the device-agnostic path, as on CUDA
    llm = LLM(dtype="float32", **engine_kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def check_all(outputs, refs, prompts):
    identical = 0
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        assert out.prompt_token_ids == prompts[i]
        identical += assert_matches_reference(out.token_ids, ref, f"prompt {i} ({len(prompts[i])} tokens)")
    assert identical >= len(outputs) - 2, f"only {identical}/{len(outputs)} identical: near-ties should be rare"


@pytest.mark.parametrize("attention_backend", ["torch", "cpp"])
def test_greedy_matches_hf_plain(tokenizer, references, attention_backend):
    prompts = varied_prompts(tokenizer)
    llm, outputs = run_engine(prompts, attention_backend=attention_backend)
    check_all(outputs, references(prompts), prompts)
    assert llm.engine.stats()["num_preemptions"] == 0


def test_greedy_matches_hf_under_preemption(tokenizer, references):
    prompts = varied_prompts(tokenizer)
    llm, outputs = run_engine(prompts, num_kv_blocks=48, block_size=16)
    assert llm.engine.stats()["num_preemptions"] > 0, "the pool was meant to be too small for the batch"
    check_all(outputs, references(prompts), prompts)


def test_greedy_matches_hf_with_prefix_cache_hits(tokenizer, references):
    prompts = shared_prefix_prompts(tokenizer)
    llm, outputs = run_engine(prompts, max_num_batched_tokens=256)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] >= 8 * 64, stats  # most prompts reuse the system prompt's full blocks
    check_all(outputs, references(prompts), prompts)


def test_greedy_matches_hf_with_chunked_prefill(tokenizer, references):
    prompts = varied_prompts(tokenizer)
    llm, outputs = run_engine(prompts, max_num_batched_tokens=48, enable_prefix_caching=False)
    check_all(outputs, references(prompts), prompts)
