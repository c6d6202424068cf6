"""A model's generation_config.json as the sampling defaults of requests that leave a field unset (vLLM's
`--generation-config auto`), `generation_config: vllm` for the neutral ones, and the config's overrides."""
import shutil

import pytest
from transformers import GenerationConfig

from engine import LLM, EngineConfig, SamplingParams
from engine.sampling_defaults import sampling_defaults
from tests.fixtures.tiny_models import tiny_checkpoint

QWEN_LIKE = GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=512,
                             do_sample=True, bos_token_id=1, eos_token_id=2)


def test_the_model_file_gives_the_defaults_and_the_config_overrides_them(caplog):
    assert sampling_defaults(QWEN_LIKE, EngineConfig()) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 512}
    assert sampling_defaults(QWEN_LIKE, EngineConfig(generation_config="vllm")) == {}
    overridden = EngineConfig(override_generation_config={"temperature": 0.2, "min_p": 0.1})
    assert sampling_defaults(QWEN_LIKE, overridden) == {
        "temperature": 0.2, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 512, "min_p": 0.1}
    assert sampling_defaults(GenerationConfig(bos_token_id=1, eos_token_id=2), EngineConfig()) == {}  # ids alone
    assert sampling_defaults(None, EngineConfig(override_generation_config={"top_k": 0})) == {"top_k": -1}  # HF's off
    assert sampling_defaults(GenerationConfig(top_p=0.0, temperature=0.5), EngineConfig()) == {"temperature": 0.5}
    assert "the generation config's top_p is left out: top_p must be in (0, 1]" in caplog.text


def test_an_override_names_a_field_a_default_can_set():
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineConfig(override_generation_config={"presence_penalty": 0.5})


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory):
    """A tiny checkpoint whose authors recommend top_k 1 (greedy) and 5 new tokens."""
    source = tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-hd64")
    path = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(source, path)
    GenerationConfig(do_sample=True, top_k=1, max_new_tokens=5, eos_token_id=2).save_pretrained(path)
    return str(path)


def test_a_prompt_without_sampling_params_samples_as_the_model_recommends(greedy_by_default):
    llm = LLM(model=greedy_by_default, dtype="float32", num_kv_blocks=64)
    assert (llm.get_default_sampling_params().top_k, llm.get_default_sampling_params().temperature) == (1, 1.0)
    prompts = ["the quick brown fox", "once upon a time"]
    defaulted = llm.generate(prompts, use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(out.token_ids) == 5 or out.finish_reason == "stop" for out in defaulted)  # max_new_tokens
    assert [out.token_ids for out in defaulted] == [g.token_ids[:len(d.token_ids)] for g, d in zip(greedy, defaulted)]
    explicit = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # the caller's
    assert [len(out.token_ids) for out in explicit] == [8, 8]
    assert llm.inputs.with_defaults(SamplingParams(top_k=5), frozenset({"top_p"})).top_k == 5  # only the unset fields
    assert llm.inputs.with_defaults(SamplingParams(top_k=5), frozenset({"top_k"})).top_k == 1


def test_generation_config_vllm_keeps_the_neutral_defaults(greedy_by_default):
    llm = LLM(model=greedy_by_default, dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.inputs.limits.sampling_defaults == {}
