"""torch's `load_inline` under a lock that ends with its holder.

torch lets one process at a time build an extension through a lock file in its build folder, which only that process
removes: a build killed by SIGKILL (the OOM killer, a killed test run) leaves the file, and every later build or load
of that extension waits on it forever, silently. An `flock` beside it is dropped by the kernel however its holder
ends, so while holding it a process knows that a torch lock file in the folder has no live owner, and removes it.
Every build of the project's extensions goes through here.
"""
from __future__ import annotations

import fcntl
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def build_folder(name: str) -> Path:
    """The folder load_inline builds extension `name` in (created if missing; torch is pinned)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def load_inline_locked(name: str, **kwargs):
    """`torch.utils.cpp_extension.load_inline(name=name, **kwargs)`, after removing a lock its builder left behind."""
    from torch.utils.cpp_extension import load_inline

    folder = build_folder(name)
    with open(folder / "owner.flock", "w") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX)  # waits while another process builds or loads it
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink()
        return load_inline(name=name, **kwargs)
