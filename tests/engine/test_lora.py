"""LoRA adapters (EngineConfig.lora_modules) on the random tiny models: adapters made and applied by Hugging Face's
PEFT are the reference, in fp32, at every generated position, with requests of two adapters and of the base model in
the same batches. An adapter's prompt blocks never serve another adapter or the base model."""
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, LoRAModule
from engine.cpu_kernels import have_compiler
from engine.errors import EngineInputError
from engine.metrics import PrometheusSink, StepMetrics
from tests.engine.helpers import assert_matches_hf, assert_varied, load_hf_model
from tests.engine.test_synthetic_models import varied_prompts
from tests.fixtures.lora_adapters import make_adapter
from tests.fixtures.tiny_models import TINY, synthetic_tokenizer, tiny_checkpoint

pytestmark = pytest.mark.slow  # over a minute; on a GPU machine (`gpu or not slow`) only the cases marked gpu run

NEW_TOKENS = 16
# name -> PEFT LoraConfig settings: every projection at rank 8, and attention's q and v only at rank 4 with rsLoRA's
# scale (alpha / sqrt(r)), as adapters commonly come
ADAPTERS = {
    "all-linears": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]),
    "attention-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def peft_reference(base_path: str, adapter_path: str):
    """transformers' model with PEFT's adapter applied by PEFT itself, fp32."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf_model(base_path), adapter_path).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """model name -> (checkpoint, {adapter name: adapter path}, {None or adapter name: HF reference})."""
    pytest.importorskip("peft", reason="peft is not installed (a GPU machine has it where `make gpu-wheels` shipped it)")
    root = tmp_path_factory.mktemp("lora")
    result = {}
    for model in TINY:
        path = tiny_checkpoint(root, model)
        adapters = {name: make_adapter(path, root / f"{model}-{name}", seed, **settings)
                    for seed, (name, settings) in enumerate(ADAPTERS.items())}
        references = {None: load_hf_model(path)} | {name: peft_reference(path, a) for name, a in adapters.items()}
        result[model] = (path, adapters, references)
    return result


_ENGINES: list[LLM] = []  # every engine a test made, checked idle with every block free after it


@pytest.fixture(autouse=True)
def every_block_free_after_test():
    yield
    engines = [_ENGINES.pop() for _ in range(len(_ENGINES))]
    for llm in engines:
        stats = llm.engine.stats()
        assert stats.idle and stats.kv_blocks_free == llm.engine.runner.num_blocks, stats


def lora_llm(path: str, adapters: dict[str, str], device: str = "cpu", **settings) -> LLM:
    modules = tuple(LoRAModule(name=name, path=adapter) for name, adapter in adapters.items())
    llm = LLM(model=path, dtype="float32", device=device, lora_modules=modules, **settings)
    _ENGINES.append(llm)
    return llm


# (device, attention backend); on CUDA (marker gpu, deselected where there is none) base rows replay CUDA graphs
BACKENDS = [("cpu", "torch"), pytest.param("cpu", "cpp", marks=pytest.mark.skipif(not have_compiler(), reason="no C++ compiler")),
            pytest.param("cuda", "triton", marks=pytest.mark.gpu), pytest.param("cuda", "torch", marks=pytest.mark.gpu)]


@pytest.mark.slow
@pytest.mark.parametrize("model", list(TINY))
@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("max_num_batched_tokens", [1024, 48])
@pytest.mark.parametrize("mixed_steps", ["stacked", "by-adapter"])
def test_each_adapter_matches_peft_beside_the_base_model_in_one_batch(served, tokenizer, model, device, backend,
                                                                       max_num_batched_tokens, mixed_steps):
    """Prompts take the base model and the two adapters in turn, so every step mixes them (with 48 tokens a step,
    prefill chunks of one adapter beside decodes of another); each output is PEFT's at every position. Mixed steps
    run every adapter masked per row, or (as where adapters are many) adapter by adapter over their rows."""
    path, adapters, references = served[model]
    llm = lora_llm(path, adapters, device, attention_backend=backend, num_kv_blocks=256,
                   max_num_batched_tokens=max_num_batched_tokens)
    linears = [m.lora for m in llm.engine.model.modules() if getattr(m, "lora", None) is not None]
    assert linears and all(lora.stacked for lora in linears)  # two thin adapters: stacked everywhere
    for lora in linears:
        lora.stacked = mixed_steps == "stacked"
    prompts = varied_prompts(tokenizer)
    names = [[None, *ADAPTERS][i % 3] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
    assert_varied(outputs)
    for i, (prompt, name, out) in enumerate(zip(prompts, names, outputs)):
        assert_matches_hf(references[name], prompt, out, f"{model}/{device}/{backend} prompt {i} on {name}")
    base = llm.generate(prompts, params, use_tqdm=False)
    changed = [a.token_ids != b.token_ids for a, b, name in zip(outputs, base, names) if name is not None]
    assert sum(changed) >= len(changed) - 1, "the adapters hardly change the output: this test could not fail"
    assert llm.engine.stats().kv_blocks_free == llm.engine.runner.num_blocks


@pytest.mark.slow
def test_an_adapters_prompt_blocks_serve_that_adapter_only(served, tokenizer):
    """The same prompt through the base model, then an adapter, then the other adapter, then the first again: only
    the last finds its prompt in the cache, and every output is still its own model's."""
    path, adapters, references = served["llama-hd64"]
    llm = lora_llm(path, adapters, num_kv_blocks=128)
    assert llm.engine.settings()["lora_adapters"] == "all-linears,attention-qv"
    prompt = varied_prompts(tokenizer)[-3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    order = [None, "all-linears", "attention-qv", "all-linears"]
    outputs = [llm.generate([prompt], params, use_tqdm=False, lora_name=name)[0] for name in order]
    assert [o.num_cached_tokens for o in outputs[:3]] == [0, 0, 0]
    assert outputs[3].num_cached_tokens >= len(prompt) - 16
    for name, out in zip(order, outputs):
        assert_matches_hf(references[name], prompt, out, f"on {name}")


@pytest.mark.slow
def test_an_unknown_adapter_is_refused_naming_lora_name(served, tokenizer):
    path, adapters, _ = served["llama-hd64"]
    llm = lora_llm(path, adapters, num_kv_blocks=64)
    with pytest.raises(EngineInputError, match="'nope' is not a LoRA adapter.*'all-linears' and 'attention-qv'") as error:
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False, lora_name="nope")
    assert error.value.param == "lora_name"
    plain = lora_llm(path, {}, num_kv_blocks=64)
    with pytest.raises(EngineInputError, match="it serves no adapter"):
        plain.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False, lora_name="all-linears")


def _rewritten(source: str, target, change) -> str:
    """A copy of the adapter at `source` whose adapter_config.json `change` edits."""
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    change(config)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.slow
@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(use_dora=True), "use_dora is set"),
    (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save is set"),
    (lambda c: c.update(bias="all"), "bias is 'all'"),
    (lambda c: c.update(r=128, lora_alpha=256), r"rank r=128 is outside \[1, max_lora_rank=64\]"),
    (lambda c: c.update(peft_type="IA3"), "peft_type is IA3"),
])
def test_adapters_the_engine_cannot_apply_exactly_are_refused_at_start(served, tmp_path, change, message):
    path, adapters, _ = served["llama-hd64"]
    bad = _rewritten(adapters["attention-qv"], tmp_path / "bad", change)
    with pytest.raises(ValueError, match=message):
        lora_llm(path, {"bad": bad}, num_kv_blocks=64)


@pytest.mark.slow
def test_an_adapter_for_another_base_model_or_on_transformers_code_is_refused(served, tmp_path):
    llama, adapters, _ = served["llama-hd64"]
    qwen, _, _ = served["qwen2-hd128"]
    with pytest.raises(ValueError, match="trained for another base model"):
        lora_llm(qwen, {"wrong": adapters["all-linears"]}, num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"LoRA adapters \(lora_modules, lora_root\) run on the native model only"):
        lora_llm(llama, adapters, num_kv_blocks=64, model_impl="hf")
    with pytest.raises(ValueError, match="each adapter needs a name of its own"):
        EngineConfig(lora_modules=[LoRAModule(name="a", path="x"), LoRAModule(name="a", path="y")])


@pytest.mark.slow
def test_requests_and_tokens_are_counted_by_adapter(served, tokenizer):
    path, adapters, _ = served["llama-hd64"]
    llm = lora_llm(path, adapters, num_kv_blocks=128)
    sink = PrometheusSink()
    llm.engine.attach_metrics(StepMetrics(sink, "m"))
    prompts = varied_prompts(tokenizer)[:4]
    lengths = [5, 3, 4, 6]
    llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths],
                 use_tqdm=False, lora_name=["all-linears", None, "all-linears", "attention-qv"])

    def count(metric: str, adapter: str) -> float | None:
        return sink.registry.get_sample_value(metric, {"model_name": "m", "lora_name": adapter})

    assert count("engine_lora_requests_total", "all-linears") == 2 and count("engine_lora_requests_total", "attention-qv") == 1
    assert count("engine_lora_generation_tokens_total", "all-linears") == 5 + 4
    assert count("engine_lora_generation_tokens_total", "attention-qv") == 6
    assert sink.registry.get_sample_value("engine_generation_tokens_total", {"model_name": "m"}) == sum(lengths)


@pytest.mark.slow
def test_an_adapter_on_nf4_weights_matches_peft_on_transformers_nf4_model(served, tokenizer):
    """QLoRA's serving case: the base in NF4 (bitsandbytes), the adapter dense. The reference is transformers' own
    NF4 model with PEFT's adapter; NF4 prompts drift by up to 0.05 in logprob on this random model whatever the
    adapter (test_synthetic_models.py), so a token may differ from the reference's argmax only within 0.1 of it."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed on this machine")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.models.loader import quantization_config

    path, adapters, _ = served["qwen2-hd128"]
    hf_nf4 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                                  quantization_config=quantization_config("nf4", torch.float32))
    reference = PeftModel.from_pretrained(hf_nf4, adapters["all-linears"]).eval()
    llm = lora_llm(path, adapters, quantization="nf4", num_kv_blocks=256)
    prompts = varied_prompts(tokenizer)[:6]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_name="all-linears")
    base = llm.generate(prompts, params, use_tqdm=False)
    assert sum(a.token_ids != b.token_ids for a, b in zip(outputs, base)) >= len(prompts) - 1
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert_matches_hf(reference, prompt, out, f"nf4 + adapter, prompt {i}", near_tie=0.1)


@pytest.mark.slow
def test_an_adapter_on_the_embedded_models_gguf_blocks_matches_peft(tmp_path):
    """`make serve`'s weights (the GGUF's Q4_1 blocks for small batches, dense copies past them) with an adapter,
    against PEFT on the dequantized checkpoint in fp32 (the same weights, value for value)."""
    from transformers import AutoTokenizer

    from engine.config import DEFAULT_MODEL
    from engine.models import resolve_model_path
    from tests.engine.test_gguf_generation import BLOCKS_LOGPROB_TOLERANCE
    from tests.engine.test_parity import varied_prompts as smollm_prompts

    checkpoint = str(resolve_model_path(DEFAULT_MODEL))
    adapter = make_adapter(checkpoint, tmp_path / "adapter", 0, r=8, lora_alpha=16,
                           target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    llm = lora_llm(DEFAULT_MODEL, {"smol": adapter}, quantization="gguf", num_kv_blocks=256)
    prompts = smollm_prompts(AutoTokenizer.from_pretrained(checkpoint))[:8]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_name="smol")
    base = llm.generate(prompts, params, use_tqdm=False)
    assert sum(a.token_ids != b.token_ids for a, b in zip(outputs, base)) >= len(prompts) - 1
    reference = peft_reference(checkpoint, adapter)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert_matches_hf(reference, prompt, out, f"gguf + adapter, prompt {i}", BLOCKS_LOGPROB_TOLERANCE)


@pytest.mark.slow
def test_speculative_drafts_and_async_steps_change_no_adapter_token(served, tokenizer, tmp_path):
    """Draft rows verify on their sequence's adapter, and steps launched ahead (async scheduling) run each row's
    adapter: greedy output is the same as plain steps', in fp32, with adapters and the base model mixed. The model
    loops (small random weights), so drafts are accepted as well as rejected."""
    from engine.config import SpeculativeConfig
    from tests.engine.test_synthetic_models import repetitive_prompts

    path = tiny_checkpoint(tmp_path, "qwen2-hd128", initializer_range=0.02)
    adapters = {"looped": make_adapter(path, tmp_path / "looped", 3, r=4, lora_alpha=4, target_modules=["o_proj", "up_proj"])}
    prompts = repetitive_prompts(tokenizer)
    names = [["looped", None][i % 2] for i in range(len(prompts))]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    reference = lora_llm(path, adapters, num_kv_blocks=128).generate(prompts, greedy, use_tqdm=False, lora_name=names)
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=16, weigh_cost=False, prompt_lookup_min=1)
    drafting = lora_llm(path, adapters, num_kv_blocks=128, speculative=spec)
    ahead = lora_llm(path, adapters, num_kv_blocks=128, async_scheduling=True)
    for llm in (drafting, ahead):
        outputs = llm.generate(prompts, greedy, use_tqdm=False, lora_name=names)
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert drafting.engine.stats().spec_accepted_tokens > 0, drafting.engine.stats()
    assert ahead.engine.stats().num_steps_ahead > 0, ahead.engine.stats()
    base = lora_llm(path, adapters, num_kv_blocks=128).generate(prompts, greedy, use_tqdm=False)
    assert any(r.token_ids != b.token_ids for r, b, name in zip(reference, base, names) if name), "the adapter changes nothing"


def _copy_adapters(adapters: dict[str, str], root) -> str:
    import shutil

    root.mkdir()
    for name, adapter in adapters.items():
        shutil.copytree(adapter, root / name)
    return str(root)


@pytest.mark.slow
def test_adapters_under_lora_root_load_on_first_use_and_idle_ones_go_past_max_loras(served, tokenizer, tmp_path):
    """Ray Serve LLM's dynamic loading from a path: nothing is loaded at start; each adapter loads when a request
    first names it (one at a time, in order, on the loader thread); once idle, the least recently used goes, and a
    later request loads it again. Every output is PEFT's."""
    path, adapters, references = served["llama-hd64"]
    root = _copy_adapters(adapters, tmp_path / "adapters")
    llm = lora_llm(path, {}, lora_root=root, max_loras=1, num_kv_blocks=256)
    assert llm.engine.settings()["lora_adapters"] == ""
    prompts = varied_prompts(tokenizer)[:6]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def check(names: list[str | None]) -> None:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
        for i, (prompt, name, out) in enumerate(zip(prompts, names, outputs)):
            assert out.error is None, out.error
            assert_matches_hf(references[name], prompt, out, f"prompt {i} on {name}")

    check(["all-linears", "attention-qv", None] * 2)
    # all-linears' requests may end before attention-qv is read, and then it is dropped to make room
    assert llm.engine.settings()["lora_adapters"] in ("all-linears,attention-qv", "attention-qv")
    check(["attention-qv"] * 6)
    assert llm.engine.settings()["lora_adapters"] == "attention-qv"
    check(["all-linears", None] * 3)
    assert llm.engine.settings()["lora_adapters"] == "all-linears"
    assert llm.engine.stats().lora_loads in (3, 4)  # each first use, and all-linears again (twice if it went early)
    for name in ("nope", "../llama-hd64-all-linears", ".hidden"):
        with pytest.raises(EngineInputError, match="not a LoRA adapter of this engine") as error:
            llm.generate(["hello"], params, use_tqdm=False, lora_name=name)
        assert error.value.param == "lora_name"


@pytest.mark.slow
def test_an_adapter_replaced_on_disk_finds_none_of_its_old_blocks_and_a_broken_one_fails_alone(served, tokenizer,
                                                                                                tmp_path):
    import shutil

    path, adapters, references = served["llama-hd64"]
    root = _copy_adapters(adapters, tmp_path / "adapters")
    llm = lora_llm(path, {}, lora_root=root, max_loras=1, num_kv_blocks=256)
    prompt = varied_prompts(tokenizer)[-3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False, lora_name="attention-qv")[0]
    assert llm.generate([prompt], params, use_tqdm=False, lora_name="attention-qv")[0].num_cached_tokens > 0
    llm.generate(["x"], params, use_tqdm=False, lora_name="all-linears")  # attention-qv, idle, goes
    shutil.rmtree(tmp_path / "adapters" / "attention-qv")
    shutil.copytree(adapters["all-linears"], tmp_path / "adapters" / "attention-qv")
    replaced = llm.generate([prompt], params, use_tqdm=False, lora_name="attention-qv")[0]
    assert replaced.num_cached_tokens == 0 and replaced.token_ids != first.token_ids
    assert_matches_hf(references["all-linears"], prompt, replaced, "the replaced adapter")
    broken = _rewritten(adapters["all-linears"], tmp_path / "adapters" / "broken", lambda c: c.update(use_dora=True))
    assert broken
    outputs = llm.generate([prompt, prompt], params, use_tqdm=False, lora_name=["broken", "all-linears"])
    assert "could not be loaded" in outputs[0].error and "use_dora" in outputs[0].error
    assert outputs[1].error is None
    assert_matches_hf(references["all-linears"], prompt, outputs[1], "beside the broken adapter")
    assert llm.engine.stats().kv_blocks_free == llm.engine.runner.num_blocks


@pytest.mark.slow
def test_an_adapter_loads_beside_the_steps_of_other_requests(served, tokenizer, tmp_path, monkeypatch):
    """A client naming adapter after adapter must not stall everyone: reading an adapter (made to take 1.5 s here)
    happens on a loader thread while other requests keep decoding; the request waits, out of the batch, then runs."""
    import time

    from engine import lora_manager

    path, adapters, references = served["llama-hd64"]
    root = _copy_adapters(adapters, tmp_path / "adapters")
    llm = lora_llm(path, {}, lora_root=root, num_kv_blocks=256)
    prepare = lora_manager.prepare_adapter

    def slow_prepare(*args):
        time.sleep(1.5)
        return prepare(*args)

    monkeypatch.setattr(lora_manager, "prepare_adapter", slow_prepare)
    prompts = varied_prompts(tokenizer)
    threads = torch.get_num_threads()
    llm.add_request("base", prompts[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    llm.step()
    llm.add_request("adapted", prompts[3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                    lora_name="attention-qv")
    started, tokens_meanwhile, longest_step, adapted = time.monotonic(), 0, 0.0, None
    while adapted is None:
        step_started = time.monotonic()
        for out in llm.step():
            if out.request_id == "base" and adapted is None:
                tokens_meanwhile = out.num_tokens
            if out.request_id == "adapted" and out.finished:
                adapted = out
        longest_step = max(longest_step, time.monotonic() - step_started)
        assert time.monotonic() - started < 30
    assert time.monotonic() - started >= 1.5 and longest_step < 0.5, longest_step
    assert tokens_meanwhile >= 20, f"the base request made {tokens_meanwhile} tokens while the adapter loaded"
    assert_matches_hf(references["attention-qv"], prompts[3], adapted, "after its load")
    # a thread that starts now (a step loop, a server's executor) takes the process's count: the loader's must not leak
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as fresh:
        assert fresh.submit(torch.get_num_threads).result() == threads, "the loader's thread count leaked"
    llm.abort("base")
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.engine.stats().kv_blocks_free == llm.engine.runner.num_blocks


@pytest.mark.slow
def test_an_adapter_in_a_dropped_adapters_slot_gets_none_of_its_weights(served, tokenizer, tmp_path):
    """attention-qv (q and v only) takes the slot all-linears left: the linears it leaves alone must hold zeros
    there, or its rows get all-linears' o, gate/up and down adapters in mixed steps."""
    path, adapters, references = served["llama-hd64"]
    root = _copy_adapters(adapters, tmp_path / "adapters")
    llm = lora_llm(path, {}, lora_root=root, max_loras=1, num_kv_blocks=256)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = varied_prompts(tokenizer)[:4]
    llm.generate(prompts[:1], params, use_tqdm=False, lora_name="all-linears")
    assert llm.engine.loras.step.index == {"all-linears": 0}
    names = ["attention-qv", None, "attention-qv", None]  # mixed steps: every slot multiplied, masked per row
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
    assert llm.engine.loras.step.index == {"attention-qv": 0} and llm.engine.loras.step.slots == 1
    for i, (prompt, name, out) in enumerate(zip(prompts, names, outputs)):
        assert_matches_hf(references[name], prompt, out, f"prompt {i} on {name}")
