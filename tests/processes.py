"""What tests ask of a process by its pid, read from /proc."""
from pathlib import Path


def alive(pid: int) -> bool:
    """Running or sleeping: a zombie (exited, not yet reaped) or a reaped process is not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False
