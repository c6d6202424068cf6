"""Shared by the engine tests: the reference is transformers' own forward in fp32, teacher-forced on the engine's
output, so every generated position is checked against HF given exactly the same context."""
from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM

from engine.models import resolve_model_path

NEAR_TIE = 1e-3  # the engine may pick another token only where HF's top two are this close (logprob)
LOGPROB_TOLERANCE = 1e-3  # engine vs HF logprob of the chosen token, fp32; measured gaps are ~2e-5
MIN_DISTINCT_TOKENS = 10  # mean distinct tokens per output: a model that repeats itself would hide broken attention


def load_hf_model(model: str, dtype=torch.float32, kv_cache_dtype: torch.dtype | None = None):
    """transformers' model with SDPA attention; with `kv_cache_dtype` (fp8) every K and V it attends to is first
    rounded to that type as the engine stores it: the reference for kv_cache_dtype fp8."""
    attention = "sdpa" if kv_cache_dtype is None else _rounded_kv_attention(kv_cache_dtype)
    path = resolve_model_path(model)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention).eval()


def _rounded_kv_attention(cache_dtype: torch.dtype) -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.layers.kv_cache_dtype import as_stored

    def attention(module, query, key, value, *args, **kwargs):
        key, value = (as_stored(t, cache_dtype).to(query.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    name = f"sdpa_kv_{str(cache_dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attention)
    return name


@torch.inference_mode()
def teacher_forced_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each generated position [len(output), vocab], from one forward over prompt + output."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    logits = hf_model(ids).logits[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches_hf(hf_model, prompt_ids: list[int], output, label: str = "",
                      logprob_tolerance: float = LOGPROB_TOLERANCE, near_tie: float = NEAR_TIE) -> int:
    """Every position: the engine's token is HF's argmax (or within NEAR_TIE of it) and, where the engine reported
    logprobs, its logprob is HF's within LOGPROB_TOLERANCE. Returns how many positions were exact argmax."""
    best_ids, best_logprobs, chosen_logprobs = hf_verdicts(hf_model, tuple(prompt_ids), tuple(output.token_ids))
    exact = 0
    for position, token in enumerate(output.token_ids):
        best, chosen = best_ids[position], chosen_logprobs[position]
        gap = best_logprobs[position] - chosen
        assert gap < near_tie, f"{label}: token {position} is {token}, HF's argmax is {best}, logprob gap {gap:.2e}"
        exact += token == best
        if output.logprobs is not None:
            got = output.logprobs[position][token]
            assert abs(got - chosen) < logprob_tolerance, f"{label}: token {position} logprob {got:.6f}, HF {chosen:.6f}"
    return exact


@functools.lru_cache(maxsize=512)
def hf_verdicts(hf_model, prompt_ids: tuple[int, ...], output_ids: tuple[int, ...]):
    """HF's argmax, its logprob and the logprob of the engine's token at each position. Cached: the parity tests
    check the same outputs on several attention backends and schedules, and HF's forward is the same for each."""
    reference = teacher_forced_logprobs(hf_model, list(prompt_ids), list(output_ids))
    best = reference.max(dim=-1)
    chosen = reference.gather(1, torch.tensor(output_ids)[:, None])[:, 0]
    return best.indices.tolist(), best.values.tolist(), chosen.tolist()


def assert_varied(outputs) -> None:
    mean_distinct = sum(len(set(o.token_ids)) for o in outputs) / len(outputs)
    assert mean_distinct >= MIN_DISTINCT_TOKENS, f"outputs repeat themselves ({mean_distinct:.1f} distinct tokens each)"


def count_native_steps(native_model, monkeypatch, on) -> list[bool]:
    """Record, for every forward of `native_model` (the native LlamaModel), whether `on(weights)` holds for the
    weights it decodes all layers with in one native call (None: layer by layer)."""
    steps: list[bool] = []
    weights_for = native_model.native_decode_weights

    def counted(*args):
        weights = weights_for(*args)
        steps.append(weights is not None and on(weights))
        return weights

    monkeypatch.setattr(native_model, "native_decode_weights", counted)
    return steps


def logits_with_edge_rows(rows: int, vocab: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Random rows, then rows that break a careless kernel: a tie across loads (and parts), a tie within one, the
    max in the last column, a constant row, a NaN, +inf, -inf, a row all -inf."""
    logits = torch.randn(rows + 8, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    edge = logits[rows:]
    edge[0, [3, vocab - 2]] = 40.0  # the same max in the first and the last sweep
    edge[1, [7, 8]] = 40.0
    edge[2, vocab - 1] = 40.0
    edge[3] = 0.5
    edge[4, vocab // 2] = float("nan")
    edge[5, 1] = float("inf")
    edge[6, vocab - 1] = float("-inf")
    edge[7] = float("-inf")
    return logits.to(device)
