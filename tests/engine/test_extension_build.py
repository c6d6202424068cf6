"""engine/extension_build.py: a torch build lock left by a killed build no longer makes every later build wait
forever, and a live build's lock is still waited on."""
import fcntl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import cpu_kernels
from engine.extension_build import build_folder

pytestmark = pytest.mark.skipif(not cpu_kernels.have_compiler(), reason="no C++ compiler")
ROOT = Path(__file__).resolve().parents[2]


def start_loading_kernels() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from engine.cpu_kernels import build_kernels; build_kernels()"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kernels_folder() -> Path:
    cpu_kernels.build_kernels()  # built (or loaded) once here, so the processes below only load it
    return build_folder(cpu_kernels.kernels_name())


def test_a_lock_left_by_a_killed_build_is_removed():
    stale = kernels_folder() / "lock"
    stale.touch()  # as a build killed by SIGKILL leaves it: torch's own wait for it never ends
    loader = start_loading_kernels()
    try:
        output, _ = loader.communicate(timeout=120)
    finally:
        loader.kill()
    assert loader.returncode == 0, output
    assert "left by a build that did not finish" in output
    assert not stale.exists()


def test_a_live_builders_lock_is_waited_on():
    folder = kernels_folder()
    with open(folder / "owner.flock", "w") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX)  # a live builder: its lock file is not stale
        (folder / "lock").touch()
        loader = start_loading_kernels()
        try:
            time.sleep(5)
            assert loader.poll() is None, loader.communicate()[0]
            assert (folder / "lock").exists()
            (folder / "lock").unlink()  # the builder finishes
        except BaseException:
            loader.kill()
            raise
    output, _ = loader.communicate(timeout=120)
    assert loader.returncode == 0, output
    assert "left by a build" not in output
