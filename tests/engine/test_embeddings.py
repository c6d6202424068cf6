"""Embedding requests (vLLM's LLM.embed and pooling): each prompt's last final hidden state, checked against
transformers' own in fp32, alone and beside generations, chunked, from the prefix cache, preempted, on every attention
backend and on the transformers fallback."""
import asyncio

import pytest
import torch

from engine import LLM, AsyncLLMEngine, EngineInputError, PoolingParams, SamplingParams
from engine.config import SpeculativeConfig
from engine.cpu_kernels import have_compiler
from tests.engine.helpers import assert_matches_hf, load_hf_model
from tests.fixtures.tiny_models import TINY, random_checkpoint, synthetic_tokenizer, tiny_checkpoint, CONFIGS
from tests.fixtures.triton_interpreter import cpu_triton_marks

pytestmark = pytest.mark.slow  # a minute; on a GPU machine (`gpu or not slow`) only the cases marked gpu run
TOLERANCE = 2e-4  # largest gap between the engine's and HF's unit vectors, fp32 (measured: ~1e-6)
TEXTS = ["The capital of France is", "a", "Paged attention keeps the KV cache in blocks of sixteen tokens, " * 12,
         "Embeddings of a decoder model come from the last token.", "x " * 100]


@pytest.fixture(scope="module")
def hf32():
    return load_hf_model("SmolLM2-135M-Instruct")


@torch.inference_mode()
def hf_embedding(hf_model, ids: list[int], normalize: bool = True) -> torch.Tensor:
    hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden


def assert_embeds_as_hf(hf_model, outputs, tolerance: float = TOLERANCE) -> None:
    for out in outputs:
        got, want = torch.tensor(out.embedding), hf_embedding(hf_model, out.prompt_token_ids)
        gap = (got - want).abs().max().item()
        assert gap < tolerance, f"{out.prompt_token_ids[:8]}...: gap {gap:.2e}"


def test_each_embedding_is_hfs_last_hidden_state_at_unit_length(llm32, hf32):
    outputs = llm32.embed(TEXTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [llm32.inputs.tokenizer.encode(t) for t in TEXTS]
    assert all(o.finish_reason == "stop" and o.token_ids == [] and len(o.embedding) == 576 for o in outputs)
    assert all(abs(sum(x * x for x in o.embedding) - 1) < 1e-5 for o in outputs)
    assert_embeds_as_hf(hf32, outputs)
    assert len({tuple(o.embedding) for o in outputs}) == len(TEXTS)


def test_score_is_the_cosine_of_hfs_embeddings_one_to_many_and_pair_by_pair(llm32, hf32):
    tokenizer = llm32.inputs.tokenizer
    hf = [hf_embedding(hf32, tokenizer.encode(t)) for t in TEXTS]
    one_to_many = llm32.score(TEXTS[0], TEXTS, use_tqdm=False)
    assert len(one_to_many) == len(TEXTS) and abs(one_to_many[0] - 1) < 1e-5
    assert max(abs(got - float(hf[0] @ want)) for got, want in zip(one_to_many, hf)) < TOLERANCE
    pairs = llm32.score(TEXTS[:2], TEXTS[3:], use_tqdm=False)
    assert max(abs(got - float(a @ b)) for got, a, b in zip(pairs, hf[:2], hf[3:])) < TOLERANCE
    with pytest.raises(EngineInputError, match="give text_1 one text, or as many as text_2") as refused:
        llm32.score(TEXTS[:2], TEXTS, use_tqdm=False)
    assert refused.value.param == "text_1"
    with pytest.raises(EngineInputError) as empty:
        llm32.score(TEXTS[0], [], use_tqdm=False)
    assert empty.value.param == "text_2"


def test_normalize_false_gives_the_hidden_state_itself(llm32, hf32):
    out, = llm32.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)
    want = hf_embedding(hf32, out.prompt_token_ids, normalize=False)
    assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-3, rtol=1e-4)
    assert want.norm() > 2  # not already unit length: the test tells the two apart


def test_embeddings_beside_generations_in_one_step_leave_both_exact(hf32):
    """Embedding and generation requests share steps (a prefill chunk's rows pooled, others sampled); a long prompt
    is chunked over several steps, and its hidden state is read at its last chunk only."""
    llm = LLM(dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64)
    tokenizer = llm.inputs.tokenizer
    ids = [f"gen-{i}" for i in range(3)] + [f"emb-{i}" for i in range(len(TEXTS))]
    for i in range(3):
        llm.add_request(ids[i], TEXTS[i + 2], SamplingParams(max_tokens=12, temperature=0.0))
    for i, text in enumerate(TEXTS):
        llm.add_request(ids[3 + i], text, pooling=PoolingParams())
    finals, steps_with_both = {}, 0
    while llm.has_unfinished_requests():
        running = {s.request_id: s for s in llm.engine.scheduler.running}
        outs = llm.step()
        steps_with_both += any(r.startswith("gen") for r in running) and any(r.startswith("emb") for r in running)
        finals.update({o.request_id: o for o in outs if o.finished})
    assert steps_with_both > 0
    for i in range(3):
        assert len(finals[ids[i]].token_ids) == 12
        assert_matches_hf(hf32, tokenizer.encode(TEXTS[i + 2]), finals[ids[i]], ids[i])
    assert_embeds_as_hf(hf32, [finals[i] for i in ids[3:]])


def test_a_prompt_from_the_prefix_cache_still_computes_its_last_token(llm32, hf32):
    text = TEXTS[2]  # 12 blocks and more
    first, = llm32.embed(text, use_tqdm=False)
    second, = llm32.embed(text, use_tqdm=False)
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - 16 > 0
    assert_embeds_as_hf(hf32, [first, second])
    assert torch.allclose(torch.tensor(first.embedding), torch.tensor(second.embedding), atol=1e-5)
    # a generation of the same prompt reads the blocks an embedding request published
    gen, = llm32.generate(text, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert gen.num_cached_tokens > 0
    assert_matches_hf(hf32, gen.prompt_token_ids, gen)


def test_preempted_embedding_requests_recompute_and_match(hf32):
    llm = LLM(dtype="float32", num_kv_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=False)
    texts = [TEXTS[2], TEXTS[4], TEXTS[2] + " again"]
    for i in range(2):
        llm.add_request(f"gen-{i}", TEXTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for i, text in enumerate(texts):
        llm.add_request(f"emb-{i}", text, pooling=PoolingParams())
    finals, preempted = {}, set()
    while llm.has_unfinished_requests():
        finals.update({o.request_id: o for o in llm.step() if o.finished})
        preempted |= {seq.request_id for seq in llm.engine.scheduler.waiting if seq.num_preemptions}
    assert any(r.startswith("emb") for r in preempted), preempted  # an embedding request's prefill was thrown away
    assert_embeds_as_hf(hf32, [finals[f"emb-{i}"] for i in range(3)])
    for i in range(2):
        assert_matches_hf(hf32, finals[f"gen-{i}"].prompt_token_ids, finals[f"gen-{i}"])


def test_truncation_and_the_limits_of_an_embedding_request(llm32, hf32):
    tokenizer = llm32.inputs.tokenizer
    ids = tokenizer.encode(TEXTS[2])
    out, = llm32.embed(TEXTS[2], PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)
    assert out.prompt_token_ids == ids[-10:]
    assert_embeds_as_hf(hf32, [out])
    with pytest.raises(EngineInputError) as refused:
        llm32.embed([1] * (llm32.engine.max_model_len + 1), use_tqdm=False)
    assert refused.value.param == "input"
    short = LLM(dtype="float32", num_kv_blocks=64, max_model_len=200)  # -1 fills the context: a short one
    full, = short.embed(ids * 2, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert full.prompt_token_ids == (ids * 2)[-200:]
    with pytest.raises(EngineInputError) as refused:
        llm32.embed("hello", PoolingParams(dimensions=64), use_tqdm=False)
    assert refused.value.param == "dimensions" and "Matryoshka" in str(refused.value)
    with pytest.raises(EngineInputError) as refused:
        PoolingParams(dimensions=0)
    assert refused.value.param == "dimensions"
    assert llm32.embed("hello", PoolingParams(dimensions=576), use_tqdm=False)[0].embedding  # its own size: accepted


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("cpp", marks=pytest.mark.skipif(not have_compiler(), reason="no C++ compiler")),
    pytest.param("triton", marks=cpu_triton_marks()),
    pytest.param("cuda-triton", marks=pytest.mark.gpu), pytest.param("cuda-torch", marks=pytest.mark.gpu)])
def test_matryoshka_models_cut_and_renormalize_on_every_backend(tmp_path, backend):
    """A model whose config says it was trained to be cut (Matryoshka) serves `dimensions` from its list; tiny random
    models, so the case runs on a GPU machine without the embedded model."""
    device, attention = backend.split("-") if "-" in backend else ("cpu", backend)
    model_class, fields = TINY["llama-hd64"]
    path = random_checkpoint(tmp_path / "mrl", model_class, CONFIGS["llama-hd64"],
                             dict(fields, max_position_embeddings=2048, initializer_range=0.2,
                                  matryoshka_dimensions=[64, 128]))
    hf = load_hf_model(path)
    tokenizer = synthetic_tokenizer()
    llm = LLM(model=path, dtype="float32", device=device, attention_backend=attention, num_kv_blocks=64,
              max_num_batched_tokens=48)
    prompts = [tokenizer.encode(" ".join(["blocks of sixteen tokens"] * k)) for k in (1, 4, 12)]
    whole = llm.embed(prompts, use_tqdm=False)
    cut = llm.embed(prompts, PoolingParams(dimensions=64), use_tqdm=False)
    for full, short in zip(whole, cut):
        want = hf_embedding(hf, full.prompt_token_ids, normalize=False)
        assert (torch.tensor(full.embedding) - torch.nn.functional.normalize(want, dim=0)).abs().max() < TOLERANCE
        assert (torch.tensor(short.embedding) - torch.nn.functional.normalize(want[:64], dim=0)).abs().max() < TOLERANCE
    with pytest.raises(EngineInputError, match="64, 128"):
        llm.embed(prompts[0], PoolingParams(dimensions=100), use_tqdm=False)


def test_the_transformers_fallback_embeds_as_hf(hf32):
    llm = LLM(dtype="float32", model_impl="hf", num_kv_blocks=64)
    assert llm.engine.model.impl == "hf"
    assert_embeds_as_hf(hf32, llm.embed(TEXTS[:3], use_tqdm=False))


def test_speculative_and_async_engines_embed_beside_generations(hf32):
    """Drafts are never proposed for an embedding request, and a step with one never launches ahead."""
    for config in (dict(speculative=SpeculativeConfig(num_speculative_tokens=3)), dict(async_scheduling=True)):
        llm = LLM(dtype="float32", num_kv_blocks=128, **config)
        prompt = llm.inputs.tokenizer.encode(TEXTS[2])[:33]  # two whole blocks and one token
        finals = {}
        for i in range(2):  # the second time, the prompt's last token alone is computed: a decode-shaped row
            llm.add_request(f"emb-{i}", prompt, pooling=PoolingParams())
            llm.add_request(f"gen-{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0))
            while llm.has_unfinished_requests():
                finals.update({o.request_id: o for o in llm.step() if o.finished})
        assert_embeds_as_hf(hf32, [finals["emb-0"], finals["emb-1"]])
        assert finals["emb-1"].num_cached_tokens == 32
        for i in range(2):
            assert_matches_hf(hf32, finals[f"gen-{i}"].prompt_token_ids, finals[f"gen-{i}"])


def test_a_core_process_sends_embeddings_to_the_async_front_end(hf32):
    async def run():
        engine = AsyncLLMEngine(dtype="float32", num_kv_blocks=64, engine_process=True)
        try:
            streams = [engine.add_request(f"e{i}", text, pooling=PoolingParams()) for i, text in enumerate(TEXTS[:3])]
            gen = engine.add_request("g", TEXTS[0], SamplingParams(max_tokens=8, temperature=0.0))
            outputs = [[o async for o in s] for s in streams]
            assert [len(o) for o in outputs] == [1, 1, 1]  # one output, finished, with the embedding
            _ = [o async for o in gen]
            return [o[0] for o in outputs]
        finally:
            engine.shutdown()

    assert_embeds_as_hf(hf32, asyncio.run(run()))


def test_a_lora_adapter_embeds_as_peft_beside_the_base_model(tmp_path, hf32):
    """`model` may name an adapter for embeddings too: its rows run the adapter in the same step as base rows."""
    from peft import PeftModel

    from engine.config import DEFAULT_MODEL, LoRAModule
    from engine.models import resolve_model_path
    from tests.fixtures.lora_adapters import make_adapter

    path = make_adapter(resolve_model_path(DEFAULT_MODEL), tmp_path / "a", 3, b_std=0.05, r=8, lora_alpha=16,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    peft = PeftModel.from_pretrained(load_hf_model(DEFAULT_MODEL), path).eval()
    llm = LLM(dtype="float32", num_kv_blocks=64, lora_modules=[LoRAModule(name="a", path=path)])
    outputs = llm.embed(TEXTS[:3] * 2, use_tqdm=False, lora_name=["a"] * 3 + [None] * 3)
    assert_embeds_as_hf(peft, outputs[:3])
    assert_embeds_as_hf(hf32, outputs[3:])
    assert (torch.tensor(outputs[0].embedding) - torch.tensor(outputs[3].embedding)).abs().max() > 1e-2
