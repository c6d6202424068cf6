"""The fast subset of `make eval`: benchmarks/eval.py's bars on 8 paragraphs and 8 instructions, passed by shipped
configurations and failed by a deliberately broken one (Llama 2's rotary base instead of SmolLM2's)."""
import copy
import importlib.util
import sys
from pathlib import Path

import pytest

from engine import LLM
from engine.config import DEFAULT_MODEL
from engine.layers.rotary import RotaryEmbedding

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # eval.py imports its sibling eval_texts.py
_spec = importlib.util.spec_from_file_location("quality_eval", BENCHMARKS / "eval.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)

PARAGRAPHS, INSTRUCTIONS, TOKENS = quality.PARAGRAPHS[:8], quality.INSTRUCTIONS[:8], 16


@pytest.fixture(scope="module")
def hf_perplexity(llm32):
    return quality.hf_perplexity(DEFAULT_MODEL, llm32, PARAGRAPHS)


@pytest.fixture(scope="module")
def reference_answers(llm32):
    return quality.greedy_answers(llm32, INSTRUCTIONS, TOKENS)


def eval_row(llm: LLM, reference_answers) -> dict:
    identical, _ = quality.agreement(reference_answers, quality.greedy_answers(llm, INSTRUCTIONS, TOKENS))
    return {"perplexity": quality.perplexity(llm, PARAGRAPHS), "identical": identical}


@pytest.mark.parametrize("name", ["fp32", "gguf", "gguf-blocks", "spec", "fp8-e4m3"])
def test_shipped_configurations_pass_their_bar(name, llm32, hf_perplexity, reference_answers):
    llm = llm32 if name == "fp32" else quality.engine_for(name, DEFAULT_MODEL)
    assert quality.failed_bars(name, eval_row(llm, reference_answers), hf_perplexity) == []


def test_a_wrong_rotary_base_fails_the_bar(hf_perplexity, reference_answers):
    llm = LLM(dtype="float32", num_kv_blocks=256)
    model = llm.engine.model
    config = copy.deepcopy(model.config)
    assert config.rope_parameters["rope_theta"] != 10000.0
    config.rope_parameters["rope_theta"] = 10000.0
    rotary = model.model.rotary
    wrong = RotaryEmbedding(config, model.model.layers[0].self_attn.head_dim, rotary.cos.shape[0])
    rotary.cos.copy_(wrong.cos)
    rotary.sin.copy_(wrong.sin)
    problems = quality.failed_bars("fp32", eval_row(llm, reference_answers), hf_perplexity)
    assert any(p.startswith("perplexity") for p in problems), problems
