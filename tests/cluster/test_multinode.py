"""Placement, autoscaling and node loss on a local multi-node Ray cluster (the scenario runs in its own process)."""
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


def test_replica_per_gpu_scale_out_node_loss_and_scale_in():
    env = {k: v for k, v in __import__("os").environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("multinode_scenario.py"))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-6000:]
    result = json.loads(lines[-1][len("RESULT "):])
    log.warning("multi-node: scale-out to 4 in %.1f s, scale-in to 1 in %.1f s; node loss: %d of %d in-flight failed, "
                "recovered after %.1f s", result["scale_out_s"], result["scale_in_s"], result["failed_after_node_loss"],
                result["in_flight_at_node_loss"], result["recovery_s"])
    assert result["succeeded_after_recovery"] > 0
