"""SIGINT and SIGTERM as clean stops (``run/interrupts.py``, ``run/faults.py``): each way a signal
ends a run (Python's ``KeyboardInterrupt``, Lightning's ``SystemExit`` after one, its
``SIGTERMException``, SIGTERM outside Lightning's loop) becomes ``RunStopped`` naming the signal,
the last RL step and the checkpoint to resume from, exit 130 or 143; the CLI's ``exit_code`` answers
a signal outside any fit the same way. Real signals inside real fits: ``tests/e2e/test_faults.py``."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from atlas_lightning.errors import STOP_EXIT_CODES, RunStopped
from atlas_lightning.run import interrupts
from atlas_lightning.run.faults import stops_cleanly


def _signal_self(received: int) -> None:
    """Send ``received`` to this process and wait until its handler has run (it raises): the
    signal may reach another of the process's threads first, so a fixed count of bytecodes
    cannot be relied on to see it handled."""
    os.kill(os.getpid(), received)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs in the main thread as soon as the signal is seen


def _lightnings_exit_after_ctrl_c() -> None:
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        sys.exit(1)  # what Lightning's _call_and_handle_interrupt does


@pytest.mark.parametrize("ending, received", [
    (KeyboardInterrupt, "SIGINT"), (_lightnings_exit_after_ctrl_c, "SIGINT"),
    (SIGTERMException, "SIGTERM"), (interrupts.Terminated, "SIGTERM")])
def test_each_way_a_signal_ends_a_fit_is_a_stop_naming_it(tmp_path, ending, received):
    with pytest.raises(RunStopped) as stopped, stops_cleanly(tmp_path, last_step=lambda: 3):
        if isinstance(ending, type):
            raise ending()
        ending()
    stop = stopped.value
    assert stop.cause == interrupts.CAUSES[received]
    assert stop.exit_code == {"SIGINT": 130, "SIGTERM": 143}[received] == STOP_EXIT_CODES[stop.cause]
    assert str(stop).startswith(f"interrupted by {interrupts.NAMES[received]} after RL step 3")
    assert "no complete checkpoint" in str(stop)


def test_another_system_exit_passes(tmp_path):
    with pytest.raises(SystemExit), stops_cleanly(tmp_path, last_step=lambda: 3):
        sys.exit(0)


def test_sigterm_outside_lightnings_loop_raises_terminated_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(interrupts.Terminated), interrupts.terminable():
        _signal_self(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


_SIGNALLED_COMMAND = """
import signal, sys
from atlas_lightning.run.exit_codes import exit_code
from tests.run.test_interrupts import _signal_self

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell starts a command
sys.exit(exit_code("atlas-lightning fit", lambda: _signal_self({number})))
"""


@pytest.mark.parametrize("received, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_any_fit_is_answered_with_its_exit_code(received, code):
    """In a process of its own, started as a shell starts a command: a test worker's signal state
    is whatever the tests before it left, and a child inherits an ignored SIGINT (seen in some
    pytest-xdist workers, whose Python handler read unchanged: something native ignores it there)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _SIGNALLED_COMMAND.format(number=int(received))],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == code, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("atlas-lightning fit: stopped: interrupted by SIG") and "no RL step was under way" in line
