"""Placement, autoscaling and node loss on a local multi-node Ray cluster (the scenario runs in its own process)."""
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # `make test-all`: 3-6 minutes of 2 cores
log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


def run_scenario(timeout_s: float) -> subprocess.CompletedProcess:
    """The scenario in a session of its own: Ray's daemons stay in its process group, so a scenario past the
    deadline is killed with everything it started, and no raylet outlives the test."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("multinode_scenario.py"))], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the multi-node scenario ran past {timeout_s:.0f} s and was killed with its cluster:\n{stderr[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group (normally nothing)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.timeout(800)
def test_replica_per_gpu_scale_out_node_loss_scale_in_and_the_engine_signal_policy():
    proc = run_scenario(timeout_s=700)  # the scenario's own deadline is 600 s; pytest's is 800 s
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-6000:]
    result = json.loads(lines[-1][len("RESULT "):])
    log.warning("multi-node: scale-out to 4 in %.1f s, scale-in to 1 in %.1f s; node loss: %d of %d in-flight failed, "
                "recovered after %.1f s", result["scale_out_s"], result["scale_in_s"], result["failed_after_node_loss"],
                result["in_flight_at_node_loss"], result["recovery_s"])
    assert result["succeeded_after_recovery"] > 0
    requests, engine = result["policies"]["requests"], result["policies"]["engine"]
    log.warning("the same long-context load on two apps: the count policy held 1 replica, waiting %.2f a replica, %d "
                "preemptions, %d done in the window; the engine policy scaled out in %.1f s, waiting %.2f, %d "
                "preemptions, %d done, and back in %.1f s after the load", requests["waiting_mean"],
                requests["preemptions"], requests["completed"], engine["scale_out_s"], engine["waiting_mean"],
                engine["preemptions"], engine["completed"], engine["scale_in_s"])
