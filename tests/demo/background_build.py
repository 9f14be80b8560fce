"""The tiny orchestrator's build as the test suite runs it beside the other tests.

    python tests/demo/background_build.py OUT

Builds what ``atlas-lightning data tiny-orchestrator --seed 0 --out OUT`` builds
(``build_tiny_orchestrator(OUT, seed=0)``), at the lowest CPU priority, with a torch thread
count that follows the machine (``IdleCorePacer``): a second thread while the rest of the
machine leaves a core idle, one thread otherwise. Started by ``tests/demo/conftest.py``.

Why: on CI's two cores the build (~13 CPU minutes) and the rest of the suite (~11) are each
nearly as long as the whole run may be. The other tests often wait (on engines, servers and
child processes) and leave a core idle, which a one-thread build cannot use; at the lowest
priority the build never holds a core a test wants for longer than one optimizer step.

The thread count does not change the bytes: the build's kernels (one-thread and two-thread
GEMMs, CPU flash attention, element-wise ops) reduce in the same order whatever the thread
count, so any schedule of one and two threads gives the same ``model.safetensors`` (sha256
``1dbf870b...`` with torch 2.13.0+cpu and transformers 5.19, the model the README's learning
figures were measured on; checked by building it this way).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path


class IdleCorePacer:
    """``on_step`` hook of ``train_on_demos``: after each optimizer step, measures what the rest
    of the machine used since the last step (``/proc/stat``'s busy time less this process's CPU
    time, in cores) and sets torch's thread count to ``most`` when that is under ``threshold``
    cores, else to one. Keeps the seconds spent at each count (``seconds``) for the log."""

    def __init__(self, most: int = 2, threshold: float = 0.5) -> None:
        import torch

        self._torch = torch
        self.most, self.threshold = most, threshold
        self._ticks_per_second = os.sysconf("SC_CLK_TCK")
        self.seconds: dict[int, float] = {}
        torch.set_num_threads(1)
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        """(wall s, the machine's busy CPU-s, this process's CPU-s), all since some origin."""
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        return time.monotonic(), busy / self._ticks_per_second, time.process_time()

    def __call__(self, step: int, loss: float) -> None:
        now = self._sample()
        wall = now[0] - self._last[0]
        if wall < 0.2:  # too short to tell (ticks are 10 ms)
            return
        others = ((now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        threads = self._torch.get_num_threads()
        self.seconds[threads] = self.seconds.get(threads, 0.0) + wall
        if threads == 1 and others < self.threshold:
            self._torch.set_num_threads(self.most)
        elif threads > 1 and others > self.threshold:
            self._torch.set_num_threads(1)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/demo/background_build.py OUT", file=sys.stderr)
        return 2
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from atlas_lightning.demo.tiny_orchestrator import build_tiny_orchestrator

    pacer = IdleCorePacer(most=min(2, os.cpu_count() or 1))
    summary = build_tiny_orchestrator(Path(argv[0]), seed=0, on_step=pacer)
    shares = ", ".join(f"{seconds:.0f} s at {threads} thread(s)" for threads, seconds in sorted(pacer.seconds.items()))
    print(f"built in {summary['seconds']['total']:.0f} s; training: {shares}; "
          f"model.safetensors {summary['files']['model.safetensors']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
