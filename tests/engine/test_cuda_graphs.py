"""Decode steps from CUDA graphs (`engine/cuda_graphs.py`): the same tokens as eager steps, with batches that shrink
and grow across buckets so padded rows are exercised. On CPU the graphs' buffers run eagerly (capture=False) with the
Triton kernels under triton's interpreter; on CUDA (marker `gpu`) the graphs are captured and replayed."""
import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import batch_buckets
from tests.fixtures.tiny_models import tiny_checkpoint
from tests.fixtures.triton_interpreter import cpu_triton_marks

pytestmark = pytest.mark.slow


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("graphs"), "qwen2-hd128")


def run(llm, lengths: list[int]):
    """Requests of different lengths, so the decode batch shrinks step by step across buckets."""
    prompts = [[5 + i, 17, 300 + 7 * i, 42] * (1 + i % 3) for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=cpu_triton_marks()),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_steps_from_the_graphs_give_the_eager_tokens(checkpoint, device, monkeypatch):
    lengths = [3, 9, 14, 20, 6, 11]
    args = dict(model=checkpoint, dtype="float32", device=device, attention_backend="triton", num_kv_blocks=64,
                max_num_seqs=8)
    eager = run(LLM(enforce_eager=True, **args), lengths)
    llm = LLM(**args)
    runner = llm.engine.runner
    graphs = runner.graphs if device == "cuda" else runner.capture_graphs(8, llm.engine.max_model_len, capture=False)
    assert (graphs.graphs != {}) == (device == "cuda")
    batches, run_graph = [], graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, pos, meta: batches.append(meta.decode.size) or run_graph(ids, pos, meta))
    assert run(llm, lengths) == eager
    assert {graphs.bucket(n) for n in batches} >= {8, 4, 2, 1} and len(batches) >= max(lengths) - 2, batches


def wide_vocab_engine(root, vocab: int, **kwargs):
    """The tiny Qwen2 on CUDA with a `vocab`-row embedding and head (the tokenizer's ids are a small part of it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.fixtures.tiny_models import TINY, random_checkpoint

    fields = dict(TINY["qwen2-hd128"][1], max_position_embeddings=2048, initializer_range=0.2)
    checkpoint = random_checkpoint(root / f"vocab-{vocab}", Qwen2ForCausalLM, Qwen2Config, fields, vocab_size=vocab)
    return LLM(model=checkpoint, dtype="float32", device="cuda", attention_backend="triton", num_kv_blocks=64,
               max_num_seqs=64, **kwargs)


@pytest.mark.gpu
def test_the_graphs_hold_hidden_states_not_logits(tmp_path):
    """Each graph's output stays allocated while the graph lives. The LM head runs after the replay, so what the
    graphs hold does not grow with the vocabulary: 32k more rows of it would have added the buckets' 175 rows of
    logits (23 MB in fp32; the first H100 run's graphs held ~635 MiB of 152k-vocabulary logits). Compared between two
    vocabularies after a first engine's capture: the first capture in a process also allocates cuBLAS's workspaces for
    the capture stream (tens of MB on Hopper), which every later graph shares."""
    wide_vocab_engine(tmp_path, 32768)
    narrow, wide = (wide_vocab_engine(tmp_path, vocab) for vocab in (32768, 65536))
    graphs = [llm.engine.runner.graphs for llm in (narrow, wide)]
    logits_bytes = sum(graphs[0].buckets) * 32768 * 4
    assert all(g.graphs for g in graphs)
    assert abs(graphs[1].memory_bytes - graphs[0].memory_bytes) < logits_bytes / 4, [g.memory_bytes for g in graphs]
    lengths = [3, 9, 14, 20, 6, 11]
    assert run(wide, lengths) == run(wide_vocab_engine(tmp_path, 65536, enforce_eager=True), lengths)
