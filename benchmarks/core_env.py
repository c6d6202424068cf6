"""The environment the engine core is served in (engine/core_client.py starts its child process with glibc's heap
on huge pages), for benchmarks that run the engine in their own process: without it they would measure the engine
on 4 KB pages against a served core on 2 MB ones. Peers they start as child processes inherit it too."""
from __future__ import annotations

import os
import sys

from engine.host_memory import heap_on_huge_pages, with_huge_page_heap


def restart_as_served() -> None:
    """Re-run this script with the core's environment, unless it already has it (glibc reads it at start only)."""
    if not heap_on_huge_pages():
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_huge_page_heap(os.environ))
