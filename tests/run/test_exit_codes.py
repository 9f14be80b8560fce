"""The one mapping from a refusal or a stop to a command's line and exit code (``run/exit_codes.py``),
which ``atlas-lightning`` and the benchmarks that run ``fit`` share."""

from __future__ import annotations

import pytest

from atlas_lightning.config import ConfigError
from atlas_lightning.errors import STOP_EXIT_CODES, InputError, RunStopped
from atlas_lightning.run.exit_codes import exit_code, exit_code_and_line, report


@pytest.mark.parametrize("err, code, line", [
    (ConfigError("trainer.max_step: not a key"), 2, "prog: config error: trainer.max_step: not a key"),
    (InputError("--base /x: no such folder"), 2, "prog: --base /x: no such folder"),
    (NotImplementedError("sweeps"), 3, "prog: not available yet: sweeps"),
])
def test_each_refusal_has_its_code_and_line(err, code, line):
    assert exit_code_and_line("prog", err) == (code, line)


@pytest.mark.parametrize("cause", sorted(STOP_EXIT_CODES))
def test_a_stop_part_way_exits_with_its_cause_code(cause):
    err = RunStopped(f"{cause} at RL step 3", cause=cause)
    assert exit_code_and_line("prog", err) == (STOP_EXIT_CODES[cause], f"prog: stopped: {cause} at RL step 3")


def test_a_credential_in_the_message_is_masked(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")
    err = InputError("data.root=https://alice:hunter2pass@example.org/data: no such folder; "
                     "key wandb-secret-0123456789")
    code, line = exit_code_and_line("prog", err)
    assert code == 2 and "hunter2pass" not in line and "wandb-secret-0123456789" not in line
    assert line.startswith("prog: data.root=https://alice:") and "example.org/data: no such folder" in line


def _refuse_key():
    raise ConfigError("a.b: bad")


def test_exit_code_prints_one_line_and_lets_other_errors_through(capsys):
    assert exit_code("prog", lambda: None) == 0 and exit_code("prog", lambda: 4) == 4
    assert exit_code("prog", _refuse_key) == 2
    assert capsys.readouterr().err == "prog: config error: a.b: bad\n"
    assert report("prog", RunStopped("oom", cause="out_of_memory")) == STOP_EXIT_CODES["out_of_memory"]
    assert capsys.readouterr().err == "prog: stopped: oom\n"
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        exit_code("prog", lambda: 1 / 0)
    with pytest.raises(TypeError):
        exit_code_and_line("prog", ValueError("not a refusal"))


def test_a_native_abort_prints_the_python_frames_it_happened_in():
    """A CUDA fault in a tensor's destructor aborts the process in native code, past every Python
    handler (the hybrid's graph fault did); the command still says where it was: every thread's
    frames, the aborting function's name among them."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os
        from atlas_lightning.run.exit_codes import exit_code

        def the_engines_request():
            os.abort()

        exit_code("prog", the_engines_request)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Fatal Python error: Aborted" in done.stderr
    assert "the_engines_request" in done.stderr
