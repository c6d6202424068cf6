"""Runs inside .venv-peers (vLLM's CPU build): the LoRA benchmark's scenarios with vLLM's own LoRA serving, timed,
as one JSON line on stdout.

Usage: python benchmarks/vllm_lora_peer.py MODEL_DIR INPUTS_JSON RUNS DTYPE
INPUTS_JSON: {"adapters": [paths], "rank": r, "scenarios": {name: {"prompts": [ids...], "max_tokens": [n...],
"adapter": [index or null per prompt]}}}; prompts are tokenized by our side, so both sides run the same.
"""
import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def main(model_dir: str, inputs_path: str, runs: int, dtype: str) -> None:
    inputs = json.loads(open(inputs_path).read())
    adapters = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(inputs["adapters"])]
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, enable_prefix_caching=True, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=inputs["rank"])
    results = {}
    for name, scenario in inputs["scenarios"].items():
        prompts = [{"prompt_token_ids": ids} for ids in scenario["prompts"]]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in scenario["max_tokens"]]
        lora = [None if i is None else adapters[i] for i in scenario["adapter"]]
        llm.generate(prompts[:2], params[:2], lora_request=lora[:2], use_tqdm=False)  # warm-up, adapters loaded
        results[name] = []
        for _ in range(runs):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            seconds = time.perf_counter() - start
            results[name].append({"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                                  "token_ids": [list(o.outputs[0].token_ids) for o in outputs]})
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
