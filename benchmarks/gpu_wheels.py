"""Slims the wheels `make gpu-wheels` downloads, so that they and the tree fit the GPU machine's 64 MiB copy: what
the GPU checks never load is dropped from a wheel, and from its RECORD, which pip reads when it installs.

Ray's wheel is 79 MB, 34 of them a Java jar; bitsandbytes' is 43 MB, libraries for every CUDA and ROCm release of
which the GPU image's torch (built for CUDA 13) loads one. What remains of Ray is what Serve runs on: its core
binaries, Serve, the dashboard agent's Python (it hosts the metrics agent), without the dashboard's web client.
Members are recompressed with LZMA, which pip reads as any zip member (Python's zipfile): Ray's wheel took 38.3 MiB
in deflate, the tree 6.5 MiB beside the wheels' 56.7 on 2026-12-02, within a MiB of the copy's limit.

It then checks the fit: the wheels within WHEELS_BUDGET, and with every file git would send, under the 64 MiB copy
(`make test` checks the tree's side without downloading: the tree within what the budget leaves).

    python benchmarks/gpu_wheels.py .whl
"""
from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_COPY_LIMIT = 64 << 20
# 46.0 MiB on 2026-12-02 (36 wheels, Ray's and bitsandbytes' in LZMA); the tree (6.5 MiB then) gets the rest
WHEELS_BUDGET = 47 << 20

DROP = {  # distribution -> the paths inside its wheel that never load on the GPU machine
    "ray": re.compile(r"^ray/(jars|rllib|data|tune|train|air|llm)/|^ray/dashboard/client/build/|\.js\.map$"),
    "bitsandbytes": re.compile(r"^bitsandbytes/libbitsandbytes_(rocm|cuda1[0-2])"),
}


WHEEL_RECORD = re.compile(r"^[^/]+\.dist-info/RECORD$")


def slim(wheel: Path, drop: re.Pattern) -> tuple[int, int]:
    """Rewrites `wheel` without the members `drop` matches; its size before and after."""
    before, slimmed = wheel.stat().st_size, wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_LZMA) as target:
        for info in source.infolist():
            if drop.search(info.filename):
                continue
            data = source.read(info)
            if WHEEL_RECORD.match(info.filename):  # the wheel's own, not those of packages it vendors
                kept = [line for line in data.decode().splitlines() if not drop.search(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            info.compress_type = zipfile.ZIP_LZMA
            target.writestr(info, data)
    slimmed.replace(wheel)
    return before, wheel.stat().st_size


def tree_bytes(root: Path = ROOT) -> int:
    """Every file the device copy takes: tracked and untracked, not ignored."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    return sum((root / f).stat().st_size for f in files if (root / f).is_file())


def misfit(wheels: int, tree: int) -> str | None:
    """Why the wheels and the tree would not travel together, or None."""
    if wheels > WHEELS_BUDGET:
        return f"the wheels take {wheels / 2**20:.1f} MiB, over their budget of {WHEELS_BUDGET / 2**20:.0f}"
    if wheels + tree >= DEVICE_COPY_LIMIT:
        return f"the tree {tree / 2**20:.1f} MiB + the wheels {wheels / 2**20:.1f} MiB reach the 64 MiB copy"
    return None


def main(folder: str) -> None:
    for wheel in sorted(Path(folder).glob("*.whl")):
        drop = DROP.get(wheel.name.split("-")[0].lower())
        if drop is not None:
            before, after = slim(wheel, drop)
            print(f"{wheel.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    wheels, tree = sum(p.stat().st_size for p in Path(folder).glob("*.whl")), tree_bytes()
    print(f"tree {tree / 2**20:.1f} MiB + wheels {wheels / 2**20:.1f} MiB of the 64 MiB copy")
    problem = misfit(wheels, tree)
    if problem:
        sys.exit(problem)


if __name__ == "__main__":
    main(sys.argv[1])
