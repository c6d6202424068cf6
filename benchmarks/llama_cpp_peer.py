"""llama.cpp decoding one stream of the same GGUF file, for `latency.py --llama-cpp-python`: run under the Python
that has `llama-cpp-python` (make bench-latency-peers builds it from source, for this CPU), never the engine's.

python benchmarks/llama_cpp_peer.py MODEL.gguf --threads 2 --tokens 64 --runs 3 --prompt "..."  -> JSON on stdout:
{"gaps": [seconds between consecutive tokens, all runs], "version": ...}

Greedy, by argmax over the logits llama.cpp returns, so the sampler is not part of what is timed (the engine's
figure includes its own). The prompt is evaluated one token at a time: on an AMX Xeon, llama-cpp-python 0.3.36
built with GGML_NATIVE crashed (SIGSEGV) on any multi-token batch of this Q4_1 file, while single tokens ran.
"""
import argparse
import json
import time

import llama_cpp
import numpy as np


def decode_gaps(llm, prompt: list[int], tokens: int) -> list[float]:
    llm.reset()
    for token in prompt:
        llm.eval([token])
    stamps = []
    for _ in range(tokens):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", default="Hello")
    args = parser.parse_args()
    n_ctx = max(1024, args.tokens + 256)  # room for the prompt and every token
    # n_batch: llama-cpp-python keeps that many rows of scores, indexed by position (512 by default)
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=n_ctx,
                          n_batch=n_ctx, verbose=False)
    prompt = llm.tokenize(args.prompt.encode(), add_bos=False)
    gaps: list[float] = []
    for run in range(args.runs + 1):
        run_gaps = decode_gaps(llm, prompt, args.tokens)
        if run:  # the first is a warm-up
            gaps += run_gaps
    print(json.dumps({"gaps": gaps, "version": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
