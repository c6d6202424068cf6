"""`dtype: auto`: bf16 on CUDA and where a CPU computes it; fp32 on a CPU without it, and for a GGUF model on a CPU
whose dense linears time faster in fp32 (timed once per CPU and kept)."""
import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.models import dtype_choice, load_hf_config
from engine.models.dtype_choice import SLOWER_BY, layer_shapes, resolve_dtype, time_both

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm_config():
    return load_hf_config(EngineConfig())


def timings(monkeypatch, bf16_s: float, fp32_s: float) -> list:
    calls = []
    monkeypatch.setattr(dtype_choice, "cpu_has_bf16", lambda: True)
    timed = {"bf16_s": bf16_s, "fp32_s": fp32_s}
    monkeypatch.setattr(dtype_choice, "time_both", lambda *args: calls.append(args) or timed)
    return calls


def test_a_named_dtype_is_taken_as_named_and_auto_is_bf16_on_cuda(smollm_config, monkeypatch):
    calls = timings(monkeypatch, 2.0, 1.0)
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(EngineConfig(dtype=name, quantization="gguf"), CPU, smollm_config) == getattr(torch, name)
    assert resolve_dtype(EngineConfig(quantization="gguf"), torch.device("cuda"), smollm_config) == torch.bfloat16
    assert calls == []


def test_auto_on_a_cpu_without_bf16_is_fp32_and_a_dense_model_keeps_bf16_untimed(smollm_config, monkeypatch):
    calls = timings(monkeypatch, 2.0, 1.0)
    assert resolve_dtype(EngineConfig(), CPU, smollm_config) == torch.bfloat16  # dense: small batches win in bf16
    assert resolve_dtype(EngineConfig(quantization="nf4"), CPU, smollm_config) == torch.bfloat16
    monkeypatch.setattr(dtype_choice, "cpu_has_bf16", lambda: False)
    assert resolve_dtype(EngineConfig(quantization="gguf"), CPU, smollm_config) == torch.float32
    assert calls == []


def test_a_gguf_model_takes_fp32_only_where_bf16_is_clearly_slower_and_the_timing_is_kept(smollm_config, tmp_path,
                                                                                          monkeypatch):
    gguf = EngineConfig(quantization="gguf")
    calls = timings(monkeypatch, SLOWER_BY * 1.01, 1.0)
    assert resolve_dtype(gguf, CPU, smollm_config, tmp_path) == torch.float32
    assert resolve_dtype(gguf, CPU, smollm_config, tmp_path) == torch.float32  # read back, not timed
    assert len(calls) == 1
    assert calls[0][0] == layer_shapes(smollm_config) == [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    calls = timings(monkeypatch, SLOWER_BY * 0.99, 1.0)
    assert resolve_dtype(gguf, CPU, smollm_config, tmp_path / "other") == torch.bfloat16  # a near tie keeps bf16
    assert resolve_dtype(gguf, CPU, smollm_config, None) == torch.bfloat16
    assert len(calls) == 2  # without a cache, every call times
    [kept] = (tmp_path / "cpu-dtype").glob("*.json")
    kept.write_text('{"bf16_s": ')  # a torn write from elsewhere: timed again
    calls = timings(monkeypatch, 2.0, 1.0)
    assert resolve_dtype(gguf, CPU, smollm_config, tmp_path) == torch.float32 and len(calls) == 1
    kept.write_text('{"bf16_s": "slow", "fp32_s": 1.0}')  # reads, but not as numbers: timed once, rewritten
    assert resolve_dtype(gguf, CPU, smollm_config, tmp_path) == torch.float32
    assert resolve_dtype(gguf, CPU, smollm_config, tmp_path) == torch.float32 and len(calls) == 2


def test_fp32_is_never_chosen_where_its_weights_would_take_over_a_quarter_of_memory(smollm_config, monkeypatch):
    calls = timings(monkeypatch, 2.0, 1.0)
    fp32_bytes = 4 * dtype_choice.dense_parameters(smollm_config, layer_shapes(smollm_config))
    assert 500e6 < fp32_bytes < 700e6  # 135M parameters, the embeddings tied
    monkeypatch.setattr(dtype_choice, "physical_memory", lambda: 4 * fp32_bytes - 1)
    assert resolve_dtype(EngineConfig(quantization="gguf"), CPU, smollm_config) == torch.bfloat16
    assert calls == []
    monkeypatch.setattr(dtype_choice, "physical_memory", lambda: 4 * fp32_bytes)
    assert resolve_dtype(EngineConfig(quantization="gguf"), CPU, smollm_config) == torch.float32


def test_the_timing_runs_the_engines_packed_linears_in_both_dtypes():
    timed = time_both([(64, 96), (96, 64)], rows=8, rounds=3)
    assert set(timed) == {"bf16_s", "fp32_s"}
    assert all(0 < seconds < 1 for seconds in timed.values())


def test_an_engine_computes_in_the_dtype_auto_picked(monkeypatch):
    timings(monkeypatch, 2.0, 1.0)
    uncached = lambda cache, folder, depends_on, measure, numbers: (measure(), False)  # noqa: E731
    monkeypatch.setattr(dtype_choice, "kept_measurement", uncached)
    llm = LLM(quantization="gguf", num_kv_blocks=16)
    engine = llm.engine
    assert engine.dtype == torch.float32
    assert engine.model.model.embed_tokens.weight.dtype == torch.float32
    assert engine.runner.kv_cache.dtype == torch.float32
