"""Whether other processes want the CPUs now: a step's OpenMP team leaves them a core when they do.

A team that shares a core with a busy thread waits at every barrier for the member that thread preempted, for a
scheduler slice each time: beside a front end checking schemas, a one-stream step of 40 ms took 0.72 s on two cores
(BENCHMARKS.md, forty-sixth session). One thread fewer runs at its own speed instead.
"""
from __future__ import annotations

import os


def threads_runnable_elsewhere() -> int:
    """Threads of other processes running or waiting to run now: the machine's runnable count (/proc/loadavg) less
    this process's running threads. 0 where /proc cannot say (not Linux). The count is the whole machine's, as a
    container sees it; on a many-core host something is nearly always runnable, and a team of many gives up one."""
    try:
        with open("/proc/loadavg", "rb") as f:
            runnable = int(f.read().split()[3].partition(b"/")[0])
        return max(0, runnable - _running_threads_here())
    except (OSError, ValueError, IndexError):
        return 0


def _running_threads_here() -> int:
    running = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as f:
                running += f.read().rpartition(b")")[2].split(None, 1)[0] == b"R"  # the name, in (), may hold spaces
        except OSError:  # the thread ended meanwhile
            pass
    return running
