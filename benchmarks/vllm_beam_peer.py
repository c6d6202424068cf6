"""Runs inside .venv-peers (vLLM's CPU build): the beam-search benchmark's runs with vLLM's LLM.beam_search, timed,
as one JSON line on stdout.

Usage: python benchmarks/vllm_beam_peer.py MODEL_DIR INPUTS_JSON DTYPE
INPUTS_JSON: {"runs": [[ids, ...], ...], "beam_width": w, "max_tokens": n}; tokenized by our side, so both sides run
the same prompts.
"""
import json
import sys
import time

from vllm import LLM
from vllm.sampling_params import BeamSearchParams


def main(model_dir: str, inputs_path: str, dtype: str) -> None:
    inputs = json.loads(open(inputs_path).read())
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, enable_prefix_caching=True)
    params = BeamSearchParams(beam_width=inputs["beam_width"], max_tokens=inputs["max_tokens"], ignore_eos=True)
    as_prompts = lambda batch: [{"prompt_token_ids": ids} for ids in batch]  # noqa: E731
    llm.beam_search(as_prompts(inputs["runs"][0][:1]), params)  # warm-up
    runs = []
    for batch in inputs["runs"]:
        start = time.perf_counter()
        outputs = llm.beam_search(as_prompts(batch), params)
        runs.append({"seconds": time.perf_counter() - start,
                     "beams": [[list(s.tokens[len(ids):]) for s in o.sequences] for o, ids in zip(outputs, batch)]})
    print("RESULT " + json.dumps(runs), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
