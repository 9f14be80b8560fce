"""SIGINT and SIGTERM as clean stops (``run/interrupts.py``, ``run/faults.py``): each way a signal
ends a run (Python's ``KeyboardInterrupt``, Lightning's ``SystemExit`` after one, its
``SIGTERMException``, SIGTERM outside Lightning's loop) becomes ``RunStopped`` naming the signal,
the last RL step and the checkpoint to resume from, exit 130 or 143; the CLI's ``exit_code`` answers
a signal outside any fit the same way; a SIGTERM whose ``Terminated`` Python drops (raised inside a
weakref callback, swallowed by an ``except``) is raised again, and a second one does not break the
stop under way. Real signals inside real fits: ``tests/e2e/test_faults.py``."""

from __future__ import annotations

import os
import signal
import sys
import time
import weakref
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
    _wait(10.0)


def _wait(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs in the main thread as soon as the signal is seen


def _sigterm_in_a_weakref_callback() -> None:
    """SIGTERM handled inside a weakref callback, as importlib's module-lock callbacks run during
    the start-up's imports: Python cannot raise out of it, so the handler's raise is dropped."""
    class Owner:
        pass

    owner = Owner()
    ref = weakref.ref(owner, lambda _: signal.raise_signal(signal.SIGTERM))  # the handler runs before this returns
    del owner  # the callback runs here
    assert ref() is None


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


#: The commands below import no test module: it imports torch, seconds a start on two busy cores.
_SIGNALLED_COMMAND = """
import os, signal, sys, time
from atlas_lightning.run.exit_codes import exit_code

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell starts a command
sys.exit(exit_code("atlas-lightning fit", lambda: (os.kill(os.getpid(), {number}), time.sleep(10))))
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


def test_a_sigterm_dropped_in_a_weakref_callback_is_raised_again_and_prints_nothing(capsys):
    went_on = False
    with pytest.raises(interrupts.Terminated), interrupts.terminable():
        _sigterm_in_a_weakref_callback()
        went_on = True  # the raise was dropped: the body goes on
        _wait(5.0)
    assert went_on
    assert "Terminated" not in capsys.readouterr().err  # no "Exception ignored in ..." report


def test_a_sigterm_dropped_by_an_except_clause_is_raised_again():
    with pytest.raises(interrupts.Terminated), interrupts.terminable():
        try:
            signal.raise_signal(signal.SIGTERM)
            _wait(5.0)
        except BaseException:
            pass
        _wait(5.0)


def test_a_body_that_returns_with_a_sigterm_dropped_ends_in_terminated():
    with pytest.raises(interrupts.Terminated), interrupts.terminable():
        _sigterm_in_a_weakref_callback()  # the last thing the body does: no time to raise it again inside


def test_a_dropped_sigterm_goes_to_lightnings_handler_once_that_is_in_place():
    """Lightning's handler, installed after the drop, calls ours after its own (``_HandlersCompose``):
    the signal sent again is noted there, its loop stops at the step's end, and the body's normal end
    owes nothing."""
    noted = []
    with interrupts.terminable():
        try:
            signal.raise_signal(signal.SIGTERM)
        except BaseException:  # dropped; meanwhile Lightning puts its handler in place
            ours = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, lambda number, frame: (noted.append(number), ours(number, frame)))
        deadline = time.monotonic() + 5.0
        while not noted and time.monotonic() < deadline:
            time.sleep(0.01)
    assert noted == [signal.SIGTERM]


def test_a_second_sigterm_does_not_break_the_stop_under_way():
    """A scheduler may send SIGTERM twice: the second, while the first's stop runs its cleanup
    (Lightning's ``on_exception`` finishing a checkpoint write), must not cut that cleanup short."""
    cleaned = False
    with pytest.raises(interrupts.Terminated), interrupts.terminable():
        try:
            signal.raise_signal(signal.SIGTERM)
            _wait(5.0)
        except interrupts.Terminated:
            signal.raise_signal(signal.SIGTERM)
            _wait(0.2)
            cleaned = True
            raise
    assert cleaned


_DROPPED_COMMAND = """
import signal, sys, time, weakref
from atlas_lightning.run.exit_codes import exit_code

class Owner:
    pass

def fit():
    owner = Owner()
    ref = weakref.ref(owner, lambda _: signal.raise_signal(signal.SIGTERM))  # as a start-up import meets it
    del owner
    time.sleep(60)  # the rest of the run, had the signal been lost

sys.exit(exit_code("atlas-lightning fit", fit))
"""


def test_a_command_whose_sigterm_was_dropped_still_stops_with_143_and_its_one_line():
    import subprocess

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _DROPPED_COMMAND], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 143, done.stderr
    assert time.monotonic() - started < 45  # not after the minute the lost signal would have let it run
    assert done.stderr.strip().splitlines() == [
        "atlas-lightning fit: stopped: interrupted by SIGTERM while the command started or ended: "
        "no RL step was under way"]
