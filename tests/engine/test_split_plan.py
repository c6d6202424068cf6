"""The decode attention's split counts timed at start-up (`engine/split_plan.py`): the choosing with the clock faked
on any machine; on CUDA (marker `gpu`) timed for real, and the chosen count computing what one split does."""
import pytest
import torch

import engine.split_plan as split_plan
from engine.split_plan import SplitPlan, decode_inputs
from tests.fixtures.triton_interpreter import cpu_triton_marks


def pool(layers: int, num_blocks: int, device="cpu", dtype=torch.float32, kv_heads=2, block_size=16, head_dim=64):
    kv = torch.randn(layers, 2, kv_heads, num_blocks, block_size, head_dim, device=device).to(dtype)
    return [(layer[0], layer[1]) for layer in kv]


def fake_clock(monkeypatch, cost):
    """time_calls returns cost(splits, context) of the call it is given, read from the kernel's arguments; a cost
    that is an exception is raised, as a count that fails to compile or launch would."""
    seen = []

    def fake_attention(query, k, v, tables, lens, scale, splits, out):
        seen.append((query.shape[0], splits, int(lens[0])))

    def fake_time(call, inputs):
        call(inputs[0])
        value = cost(*seen[-1][1:])
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(split_plan, "decode_attention", fake_attention)
    monkeypatch.setattr(split_plan, "time_calls", fake_time)
    return seen


def test_each_bucket_of_64_rows_and_more_takes_the_count_fastest_relative_to_each_context(monkeypatch):
    """At 128 tokens one split is fastest and two 10% slower; at 1,024 and 4,096 two are fastest and one 40% and 100%
    slower: two splits win on average (1.03 against 1.47). Sixteen fail to compile and are never taken. Buckets under
    64 rows are not timed and keep the rule."""
    table = {128: {1: 10.0, 2: 11.0, 4: 14.0, 8: 20.0}, 1024: {1: 28.0, 2: 20.0, 4: 21.0, 8: 24.0},
             4096: {1: 160.0, 2: 80.0, 4: 82.0, 8: 90.0}}
    seen = fake_clock(monkeypatch, lambda s, c: RuntimeError("no") if s == 16 else table[c][s])
    plan = SplitPlan.measure(pool(2, 64), 6, torch.float32, [8, 64, 128], 8192, rule=lambda b: 3 if b < 64 else 1)
    assert plan.chosen == {64: 2, 128: 2} and plan.splits(8) == 3 and plan.splits(128) == 2
    assert {rows for rows, _, _ in seen} == {64, 128}
    assert {(s, c) for _, s, c in seen} == {(s, c) for s in (1, 2, 4, 8, 16) for c in (128, 1024, 4096)}
    row = plan.timings[0]
    assert (row["rows"], row["rule"], row["splits"]) == (64, 1, 2)
    assert row["us"]["2x1024"] == 20.0 and "16x128" not in row["us"]
    assert "changed for {64: 2, 128: 2}" in plan.summary()


def test_a_tie_keeps_fewer_splits_and_contexts_stop_at_the_longest_admitted(monkeypatch):
    seen = fake_clock(monkeypatch, lambda s, c: 5.0 if s in (4, 8) else 9.0)
    plan = SplitPlan.measure(pool(1, 64), 2, torch.float32, [64], 600, rule=lambda b: 1)
    assert plan.chosen == {64: 4}
    assert {c for _, _, c in seen} == {128, 600}


def test_a_bucket_where_every_count_failed_keeps_the_rule(monkeypatch):
    fake_clock(monkeypatch, lambda s, c: RuntimeError("out of resources"))
    plan = SplitPlan.measure(pool(1, 64), 2, torch.float32, [64], 4096, rule=lambda b: 1)
    assert plan.chosen == {} and plan.splits(64) == 1 and plan.timings[0]["us"] == {}


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=cpu_triton_marks())])
def test_every_timed_count_runs_the_real_kernel_and_computes_one_splits_output(monkeypatch, device):
    """The timed calls as the plan makes them, on the real kernel (under triton's interpreter here), with only the
    clock faked: at every context every candidate count computes what one split computes, into the given buffer."""
    from engine.kernels.triton.decode import decode_attention

    seen = []

    def checked(query, k, v, tables, lens, scale, splits, out):
        got = decode_attention(query, k, v, tables, lens, scale, splits, out)
        assert got is out
        torch.testing.assert_close(got, decode_attention(query, k, v, tables, lens, scale, 1), rtol=1e-5, atol=1e-5)
        seen.append((splits, int(lens[0])))

    def fake_time(call, inputs):
        call(inputs[0])
        return 1.0 if seen[-1][0] == 4 else 2.0

    monkeypatch.setattr(split_plan, "MIN_ROWS", 2)
    monkeypatch.setattr(split_plan, "CONTEXTS", (20, 70))  # one tile; two tiles of 64 positions, the second ragged
    monkeypatch.setattr(split_plan, "decode_attention", checked)
    monkeypatch.setattr(split_plan, "time_calls", fake_time)
    plan = SplitPlan.measure(pool(2, 16, kv_heads=1), 3, torch.float32, [2], 4096, rule=lambda b: 1)
    assert plan.chosen == {2: 4}
    assert sorted(seen) == sorted((s, c) for s in (1, 2, 4, 8, 16) for c in (20, 70))


def test_timed_inputs_read_distinct_blocks_until_the_pool_wraps():
    k = pool(1, 40)[0][0]
    query, tables, lens, out = decode_inputs(k, 3, 200, 6, torch.float32)  # 13 blocks a sequence, 39 in all
    assert tables.shape == (3, 13) and tables.unique().numel() == 39 and lens.tolist() == [200] * 3
    assert query.shape == out.shape == (3, 6, 64)
    _, tables, _, _ = decode_inputs(k, 4, 200, 6, torch.float32)  # 52 blocks asked of 40
    assert tables.unique().numel() == 40 and int(tables.max()) == 39


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_every_count_is_timed_and_the_chosen_one_computes_what_one_split_does():
    from engine.kernels.triton.decode import decode_attention

    kv_layers = pool(4, 4096, "cuda", torch.bfloat16, head_dim=128)
    plan = SplitPlan.measure(kv_layers, 12, torch.bfloat16, [8, 64, 256], 2048, rule=lambda b: 1)
    assert [t["rows"] for t in plan.timings] == [64, 256] and set(plan.chosen) == {64, 256}
    for t in plan.timings:
        assert len(t["us"]) == 5 * 3 and all(us > 0 for us in t["us"].values()), t
    query, tables, lens, _ = decode_inputs(kv_layers[0][0], 256, 1000, 12, torch.bfloat16)
    k, v = kv_layers[0]
    one = decode_attention(query, k, v, tables, lens, 128**-0.5, 1)
    torch.testing.assert_close(decode_attention(query, k, v, tables, lens, 128**-0.5, plan.splits(256)), one,
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_graphs_are_captured_with_the_plans_counts_and_give_the_eager_tokens(tmp_path):
    from engine import LLM, SamplingParams
    from tests.fixtures.tiny_models import tiny_checkpoint

    args = dict(model=tiny_checkpoint(tmp_path, "qwen2-hd128"), dtype="float32", device="cuda",
                attention_backend="triton", num_kv_blocks=512, max_num_seqs=64)
    llm = LLM(**args)
    runner = llm.engine.runner
    assert set(runner.split_plan.chosen) == {64}
    assert runner.graphs.meta[64].decode.num_splits == runner.split_plan.splits(64)
    assert runner.graphs.meta[8].decode.num_splits == runner.split_plan.rule(8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 17, 300 + 7 * i, 42] for i in range(64)]  # 64 rows: the timed bucket's graph
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == [o.token_ids for o in LLM(enforce_eager=True, **args).generate(prompts, params, use_tqdm=False)]
