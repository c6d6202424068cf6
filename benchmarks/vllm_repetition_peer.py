"""Run in vLLM's virtualenv by repetition_cost.py: argv MODEL_DIR (unused) INPUTS_JSON. Checks that ours and vLLM's
check_sequence_repetition flag the same positions of each stream, then times both alternated, round by round."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.sampling_params import RepetitionDetectionParams  # noqa: E402
from vllm.v1.core.sched.utils import check_sequence_repetition  # noqa: E402

from engine.repetition import RepetitionDetection, RepetitionRuns  # noqa: E402


def ours(stream: list[int], rule: tuple) -> list[int]:
    runs, tokens, flagged = RepetitionRuns.within(RepetitionDetection(*rule), len(stream)), [], []
    for i, token in enumerate(stream):
        tokens.append(token)
        if runs.append(tokens, 0):
            flagged.append(i)
    return flagged


def vllm(stream: list[int], rule: tuple) -> list[int]:
    params, tokens, flagged = RepetitionDetectionParams(*rule), [], []
    for i, token in enumerate(stream):
        tokens.append(token)
        if check_sequence_repetition(tokens, params):
            flagged.append(i)
    return flagged


def us_a_token(check, stream: list[int], rule: tuple) -> float:
    start = time.perf_counter()
    check(stream, rule)
    return (time.perf_counter() - start) / len(stream) * 1e6


def main() -> None:
    inputs = json.loads(Path(sys.argv[2]).read_text())
    rows = []
    for name, stream in inputs["streams"].items():
        for rule in map(tuple, inputs["rules"]):
            flagged = ours(stream, rule)
            assert flagged == vllm(stream, rule), f"{name} {rule}: the two disagree"
            times = {"ours": [], "vllm": []}
            for _ in range(inputs["rounds"]):
                times["ours"].append(us_a_token(ours, stream, rule))
                times["vllm"].append(us_a_token(vllm, stream, rule))
            rows.append(dict(stream=name, max_pattern_size=rule[0], min_count=rule[2], flagged=len(flagged),
                             ours_us=statistics.median(times["ours"]), vllm_us=statistics.median(times["vllm"])))
            print(rows[-1], file=sys.stderr)
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
