"""Runs inside .venv-peers (vLLM's CPU build): the embeddings benchmark's runs with vLLM's pooling runner (a causal
LM converted to an embedding model: last-token pooling, normalized), timed, as one JSON line on stdout.

Usage: python benchmarks/vllm_embed_peer.py MODEL_DIR INPUTS_JSON DTYPE
INPUTS_JSON: {"batches": [[ids, ...], ...], "queries": [ids, ...]}; tokenized by our side, so both sides run the same.
"""
import json
import sys
import time

from vllm import LLM


def main(model_dir: str, inputs_path: str, dtype: str) -> None:
    inputs = json.loads(open(inputs_path).read())
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, runner="pooling", convert="embed")
    as_prompts = lambda batch: [{"prompt_token_ids": ids} for ids in batch]  # noqa: E731
    llm.embed(as_prompts(inputs["batches"][0][:4]), use_tqdm=False)  # warm-up
    batches = []
    for batch in inputs["batches"]:
        start = time.perf_counter()
        outputs = llm.embed(as_prompts(batch), use_tqdm=False)
        batches.append({"seconds": time.perf_counter() - start, "vectors": [o.outputs.embedding for o in outputs]})
    latencies = []
    for ids in inputs["queries"]:
        start = time.perf_counter()
        llm.embed(as_prompts([ids]), use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    print("RESULT " + json.dumps({"batches": batches, "latencies": latencies}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
