"""How a command ends when a verb refuses its input or stops part-way: one line on stderr naming
what is wrong, and an exit code (``errors.py`` lists them). No traceback: the line is the message.

    ConfigError          -> 2, "PROGRAM: config error: MESSAGE"  (a key or value of the config)
    InputError           -> 2, "PROGRAM: MESSAGE"                (a file, folder or option that cannot be used)
    RunStopped           -> its exit_code (4 to 8, 130, 143), "PROGRAM: stopped: MESSAGE"  (a fault part-way)
    SIGINT, SIGTERM      -> 130, 143, "PROGRAM: stopped: interrupted by SIGNAL before ..."  (outside a fit's
                            loop; inside it ``run/faults.py`` names the step and checkpoint: ``run/interrupts.py``)
    NotImplementedError  -> 3, "PROGRAM: not available yet: MESSAGE"

Every command that composes a config or runs a verb ends through here: ``atlas-lightning``
(``cli.py``, PROGRAM ``atlas-lightning fit``, ...) and the benchmarks that run ``fit``
(``bench/step.py``, ``bench/learning.py``, ``bench/step_suite.py``, PROGRAM their
``python -m ...`` name), so a bad override reads the same from each; ``bench/projection.py``
too, for a step report it cannot read. A process that dies in native code (a CUDA fault raised
in a tensor's destructor aborts it, and no Python handler runs) prints every thread's Python
frames first (``faulthandler``), so that its log says where it was. Each message is masked as
the run's files are (``config.redacted_text``): a launcher tees stderr into logs, and a value
named in a refusal may be a URL with its password.
"""

from __future__ import annotations

import faulthandler
import sys
from typing import Callable, Optional

from atlas_lightning.config import ConfigError, redacted_text
from atlas_lightning.errors import InputError, RunStopped
from atlas_lightning.run import interrupts

#: the exceptions a command answers with one line and an exit code; anything else is a bug (a traceback)
ANSWERED = (ConfigError, InputError, RunStopped, NotImplementedError)


def exit_code_and_line(program: str, err: BaseException) -> tuple[int, str]:
    """The exit code and the stderr line for ``err`` (one of ``ANSWERED``), raised under ``program``."""
    message = " ".join(redacted_text(str(err)).split())  # one line, whatever line breaks a message holds
    if isinstance(err, ConfigError):  # before InputError: a ConfigError is one
        return 2, f"{program}: config error: {message}"
    if isinstance(err, InputError):  # a question file, adapter, checkpoint folder or option that cannot be used
        return 2, f"{program}: {message}"
    if isinstance(err, RunStopped):  # a fault part-way; the last complete checkpoint resumes (run/faults.py)
        return err.exit_code, f"{program}: stopped: {message}"
    if isinstance(err, NotImplementedError):
        return 3, f"{program}: not available yet: {message}"
    raise TypeError(f"exit_code_and_line: {type(err).__name__} is not one of {[e.__name__ for e in ANSWERED]}")


def report(program: str, err: BaseException) -> int:
    """Print ``err``'s line (``exit_code_and_line``) on stderr; its exit code."""
    code, line = exit_code_and_line(program, err)
    print(line, file=sys.stderr)
    return code


def exit_code(program: str, action: Callable[[], Optional[int]]) -> int:
    """``action()``'s exit code (None: 0), or, when it raises one of ``ANSWERED`` or is ended by
    SIGINT or SIGTERM, the code ``report`` prints the line for. Other exceptions propagate (a bug
    keeps its traceback)."""
    if not faulthandler.is_enabled():  # a native abort's only trace (module doc)
        faulthandler.enable(all_threads=True)
    try:
        with interrupts.terminable():  # SIGTERM as a clean stop, as SIGINT is
            return int(action() or 0)
    except ANSWERED as err:
        return report(program, err)
    except (KeyboardInterrupt, interrupts.Terminated) as err:  # before (or after) any fit's loop
        received = interrupts.signal_of(err)
        return report(program, RunStopped(f"interrupted by {interrupts.NAMES[received]} while the command started "
                                          f"or ended: no RL step was under way", cause=interrupts.CAUSES[received]))
