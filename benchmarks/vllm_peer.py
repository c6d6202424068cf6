"""Runs inside .venv-peers (vLLM's CPU build): the bench workload, timed, as one JSON line on stdout.

Usage: python benchmarks/vllm_peer.py MODEL_DIR WORKLOAD_JSON RUNS DTYPE [KV_CACHE_DTYPE]
The workload is a list of {"prompt_token_ids": [...], "max_tokens": n, "temperature": t, and "top_p", "seed" where
sampled}, tokenized by our side so prompts are identical.
"""
import json
import sys
import time

from vllm import LLM, SamplingParams


def main(model_dir: str, workload_path: str, runs: int, dtype: str, kv_cache_dtype: str = "auto") -> None:
    workload = json.loads(open(workload_path).read())
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, enable_prefix_caching=True,
              kv_cache_dtype=kv_cache_dtype)
    prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in workload]
    knobs = ("temperature", "top_p", "seed")
    params = [SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True, **{k: w[k] for k in knobs if k in w})
              for w in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    results = []
    for _ in range(runs):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.append({"seconds": seconds, "output_tokens": tokens})
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
