"""Where a machine's CPU goes during a run: each process's CPU (100% is one core) and wake-ups a second over a window,
and the same for the threads of the engine core process. Run it while `make loadtest` or `make soak` holds a steady
load: on a small box the serving processes' share and the core's involuntary switches (the times another process
took one of its OpenMP threads mid-step) say why served throughput is below the engine alone.

python benchmarks/cpu_by_process.py --seconds 60
"""
from __future__ import annotations

import time

import psutil
import typer
from rich.console import Console
from rich.table import Table

cli = typer.Typer(add_completion=False)
CORE_MARKER = "engine.core_process"


def label(proc: psutil.Process) -> str:
    try:
        words = proc.cmdline() or [proc.name()]
    except psutil.Error:
        return "?"
    text = " ".join(w.rsplit("/", 1)[-1] for w in words)  # paths say little; the names say which Ray process
    return text[:70]


def switches(pid: int, tid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of one thread: a process's own /proc status counts its main thread only."""
    try:
        status = open(f"/proc/{pid}/task/{tid}/status").read()
    except OSError:
        return 0, 0
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def thread_snapshot(pid: int) -> dict[int, tuple[float, int, int]]:
    """tid -> (CPU seconds, voluntary, involuntary switches)."""
    out = {}
    for thread in psutil.Process(pid).threads():
        out[thread.id] = (thread.user_time + thread.system_time, *switches(pid, thread.id))
    return out


def snapshot() -> dict[int, tuple[float, int, int, str]]:
    """pid -> (CPU seconds, voluntary and involuntary switches summed over its threads, label)."""
    out = {}
    for proc in psutil.process_iter():
        try:
            with proc.oneshot():
                cpu, threads = proc.cpu_times(), proc.threads()
                name = label(proc)
        except psutil.Error:
            continue
        per_thread = [switches(proc.pid, t.id) for t in threads]
        out[proc.pid] = (cpu.user + cpu.system, sum(v for v, _ in per_thread), sum(i for _, i in per_thread), name)
    return out


def rows(before: dict, after: dict, seconds: float) -> list[tuple]:
    """(key, CPU %, voluntary/s, involuntary/s, *rest) for every key in both snapshots, busiest first."""
    out = []
    for key, (cpu, vol, invol, *rest) in after.items():
        if key in before:
            cpu0, vol0, invol0, *_ = before[key]
            out.append((key, (cpu - cpu0) / seconds * 100, (vol - vol0) / seconds, (invol - invol0) / seconds, *rest))
    return sorted(out, key=lambda r: -r[1])


def table(title: str, data: list[tuple], min_cpu: float) -> Table:
    t = Table(title=title)
    for name in ("id", "CPU %", "wake-ups/s", "preempted/s", "process"):
        t.add_column(name, justify="left" if name == "process" else "right")
    for key, cpu, vol, invol, *rest in data:
        if cpu >= min_cpu:
            t.add_row(str(key), f"{cpu:.1f}", f"{vol:.0f}", f"{invol:.0f}", rest[0] if rest else "")
    return t


@cli.command()
def main(seconds: float = 60, min_cpu: float = typer.Option(0.5, help="leave out processes below this CPU %")):
    before = snapshot()
    core = next((pid for pid, (*_, name) in before.items() if CORE_MARKER in name), None)
    threads_before = thread_snapshot(core) if core else {}
    time.sleep(seconds)
    after = snapshot()
    console = Console(width=140)
    per_process = rows(before, after, seconds)
    console.print(table(f"CPU by process over {seconds:g} s (100% is one core of {psutil.cpu_count()})",
                        per_process, min_cpu))
    console.print(f"all processes: {sum(r[1] for r in per_process):.1f}%, wake-ups {sum(r[2] for r in per_process):,.0f}/s")
    if core and psutil.pid_exists(core):
        console.print(table(f"threads of the engine core (pid {core})",
                            rows(threads_before, thread_snapshot(core), seconds), min_cpu))


if __name__ == "__main__":
    cli()
