"""A fault on one rank of an FSDP2 fit stops every rank (``run/stop_notice.py``): two gloo ranks
on CPU, out of memory in the actor update of step 2 on rank 1 alone, then on rank 0 alone (the
rank that hosts the process group's store). Both ranks exit with the out-of-memory code (5),
print one stop line and no traceback, the other rank naming the rank that stopped; within a
bounded time of each other (not the group's 30-minute timeout)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atlas_lightning.errors import STOP_EXIT_CODES

WORKER = Path(__file__).with_name("rank_fault_worker.py")
#: Seconds the other rank may take after the rank that stopped (a step's phase, the notice).
BOUND_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("faulty", [1, pytest.param(0, marks=pytest.mark.e2e)])
def test_out_of_memory_on_one_rank_stops_both_with_the_same_code(tiny_model_dir, tmp_path, faulty):
    port, started = _free_port(), time.monotonic()
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        ranks.append(subprocess.Popen([sys.executable, str(WORKER), str(tiny_model_dir), str(tmp_path), "out_of_memory",
                                       str(faulty)], env=env, stderr=subprocess.PIPE, text=True))
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 600
    while len(ended) < 2 and time.monotonic() < deadline:
        for rank, process in enumerate(ranks):
            if rank not in ended and process.poll() is not None:
                ended[rank] = time.monotonic()
        time.sleep(0.2)
    for process in ranks:
        if process.poll() is None:
            process.kill()
    errors = [process.stderr.read() for process in ranks]
    assert len(ended) == 2, f"a rank still ran 600 s after the start: {errors[0][-3000:]}\n{errors[1][-3000:]}"
    assert abs(ended[0] - ended[1]) < BOUND_S
    for rank, (process, stderr) in enumerate(zip(ranks, errors)):
        assert process.returncode == STOP_EXIT_CODES["out_of_memory"], f"rank {rank}: {stderr[-4000:]}"
        assert "Traceback" not in stderr, f"rank {rank}: {stderr[-4000:]}"
        stop = stderr.strip().splitlines()[-1]
        print(f"\nrank {rank} (fault on rank {faulty}): exit {process.returncode} after "
              f"{ended[rank] - started:.0f} s: {stop}")
        assert stop.startswith("atlas-lightning fit: stopped: "), stop
        assert "out of memory after RL step 1" in stop and "in phase update_actor of RL step 2" in stop, stop
        if rank != faulty:
            assert f"rank {faulty} stopped, so this rank {rank} did" in stop, stop
