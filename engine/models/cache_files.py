"""Writing into the engine's cache: whole or not at all (replicas starting together may race; either copy serves),
and with the mode a plainly created file would get (0666 less the umask), so a cache shared between users
(`ENGINE_CACHE_DIR` on a shared volume) is as readable as its umask says. safetensors writes 0600 and tempfile's
staging files and folders are private; without this, a second user's replica failed to read what the first one
converted."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(staging)` to a staging file beside `path`, then the finished file put in its place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".keep-{uuid.uuid4().hex}"
    try:
        write(staging)
        make_shareable(staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def make_shareable(path: Path) -> None:
    """`path`, or every file under the folder `path`, to 0666 less the umask."""
    mode = 0o666 & ~umask()
    for file in (path.rglob("*") if path.is_dir() else [path]):
        if file.is_file():
            file.chmod(mode)


def umask() -> int:
    """This process's umask, read without setting it (os.umask would, for every thread at once)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        return 0o022
