"""Python children that die with the process that started them.

A child started in its own session (so that its starter can signal its whole group) outlives a
starter that is SIGKILLed, which can run nothing on its way out: a ``vllm serve`` server, or a
``fit`` under the step suite, then keeps its card, and the next command on that card runs out of
memory (a profiled step killed by the call's cap left its ``fit`` holding 63 GiB: the
twenty-ninth session in atlas_lightning/bench/card/README.md, "One H200 session's commands").

``dying_with_parent`` prefixes a Python command with a ``python -c`` prologue that asks the kernel
to signal the child when its parent dies (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``),
exits at once if the parent is already gone, then ``exec``s the command with the same
interpreter. Linux only; elsewhere the command is returned as it was.

The kernel sends the signal when the THREAD that started the child ends: start such children
from a thread that lives as long as they should (the main one).

Who calls it: ``rollout/engines/server_process.py`` (the server: SIGTERM, so it can shut down),
``bench/step_suite.py`` (each stage's ``fit``: SIGKILL, as its own cap does).
"""

from __future__ import annotations

import os
import signal
import sys

#: The prologue: ``argv[1]`` the parent's pid, ``argv[2]`` the signal, the rest the command's
#: arguments after the interpreter.
PROLOGUE = (
    "import ctypes, os, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2])); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[3:])"
)


def dying_with_parent(command: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """``command`` (``[sys.executable, ...]``) to be signalled with ``sig`` when this process
    dies, however it dies (module doc); unchanged off Linux or for another program."""
    if not sys.platform.startswith("linux") or not command or command[0] != sys.executable:
        return list(command)
    return [command[0], "-c", PROLOGUE, str(os.getpid()), str(int(sig)), *command[1:]]
