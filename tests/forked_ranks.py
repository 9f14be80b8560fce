"""Run a worker script at W ranks forked from one process that has imported it once.

    python tests/forked_ranks.py W worker.py ARG...

Stands in for ``python -m torch.distributed.run --standalone --nproc_per_node W worker.py ARG...``
in the multi-process tests whose subject is the workers' arithmetic, not the launcher: every
rank runs ``worker.py`` as ``__main__`` with the same arguments and the variables torchrun sets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``: what ``init_process_group("env://")`` reads and what
Lightning's ``TorchElasticEnvironment`` detects); the first rank to fail ends the others, and
the exit status is that rank's (0 when all succeed). The launcher that users run is tested
elsewhere (``tests/scale/test_preflight_launchers.py``, the e2e tests).

Why: a rank of these tests spends most of its CPU importing torch, transformers and peft
(~5.5 CPU-s each; ``python -X importtime -c 'import peft'``), and the suite starts about 35 of
them on two cores. Here the worker's module-level imports run once, in this process (the
script is executed under another name, so its ``__main__`` block does not run), and the ranks
are forked from it. That is safe because nothing here runs a torch operation before the fork:
no OpenMP pool, process group or engine exists yet.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import runpy
import signal
import socket
import sys
import traceback

_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_rank(rank: int, world: int, port: int, script: str, args: list[str]) -> None:
    """The child: die with the launcher, set the rendezvous variables, run the script; never returns."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    world, script, args = int(argv[0]), os.path.abspath(argv[1]), argv[2:]
    sys.path.insert(0, os.path.dirname(script))  # as when Python runs the script itself
    spec = importlib.util.spec_from_file_location("_forked_ranks_preload", script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # its imports, once
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, world, port, script, args)
        children[pid] = rank
    status = 0
    while children:
        pid, wait_status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code and not status:
            status = code if code > 0 else 128 - code  # killed by a signal: as a shell reports it
            print(f"forked_ranks: rank {rank} of {world} exited with {code}; ending the others", file=sys.stderr)
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
