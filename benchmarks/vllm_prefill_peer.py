"""Runs inside .venv-peers (vLLM's CPU build): one prompt alone at each length, prefilled with one output token, timed.

Usage: python benchmarks/vllm_prefill_peer.py MODEL_DIR PROMPTS_JSON RUNS DTYPE CHUNK
PROMPTS_JSON is a list of token-id lists made by benchmarks/long_prefill.py, so both sides prefill the same ids.
Prints one line: RESULT {"<length>": [seconds, ...], ...}.
"""
import json
import sys
import time

from vllm import LLM, SamplingParams


def main(model_dir: str, prompts_path: str, runs: int, dtype: str, chunk: int) -> None:
    prompts = json.loads(open(prompts_path).read())
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=max(map(len, prompts)) + 16, enable_prefix_caching=False,
              max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    results = {}
    for ids in prompts:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)  # warm-up at this length
        seconds = []
        for _ in range(runs):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        results[str(len(ids))] = seconds
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the module must import without running
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
