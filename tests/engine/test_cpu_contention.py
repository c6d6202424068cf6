"""threads_runnable_elsewhere against real processes and threads: other processes' spinning threads are counted,
this process's own are not."""
from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import threading

from engine.cpu_contention import threads_runnable_elsewhere

SAMPLES = 20


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes each spinning one thread, running (or waiting to) until the block ends."""
    spinning = [subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        for process in spinning:
            assert process.stdout.readline().strip() == "spinning"
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def test_other_processes_spinning_are_counted_every_time():
    """Each spinning process is running or waiting to run at every instant, so every sample counts at least all of
    them, whatever else the machine is doing."""
    with busy_processes(3):
        assert min(threads_runnable_elsewhere() for _ in range(SAMPLES)) >= 3


def runnable_on_the_machine() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].partition("/")[0])


def test_this_processes_own_busy_threads_are_not_counted():
    """Four threads of this process hashing (outside the interpreter lock) are always runnable: what is left for
    other processes is the machine's runnable count less them. Compared with the machine's count sample by sample,
    as other processes (a second test worker) may keep several threads runnable throughout."""
    stop = threading.Event()
    data = bytes(1 << 20)

    def hash_until_stopped() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    workers = [threading.Thread(target=hash_until_stopped) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        samples = [(runnable_on_the_machine(), threads_runnable_elsewhere()) for _ in range(SAMPLES)]
        assert max(machine - elsewhere for machine, elsewhere in samples) >= 4, samples
    finally:
        stop.set()
        for worker in workers:
            worker.join()
