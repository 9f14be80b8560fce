"""Two launches of one fit for the kill-and-resume tests: to its end, and SIGKILLed (its whole
process group) as soon as a checkpoint's marker exists."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def run_to_end(command: list[str], env: dict) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


def kill_once_written(command: list[str], env: dict, marker: Path, timeout_s: float = 900) -> None:
    """Start ``command`` and SIGKILL it once ``marker`` exists (the next step is then under way)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert process.poll() is None, f"the run ended before {marker} was written"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
