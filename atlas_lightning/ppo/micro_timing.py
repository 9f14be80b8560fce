"""Where an update's time goes by micro-batch fill: how much of it is lost to micro-batches that
are short (a mini-batch's last, a rank's share of few trajectories) or padded.

Each micro-step of a role's update is timed (CUDA events on a card, so nothing waits: they are
read once, after the role's last micro-step; the clock on the CPU) with the real tokens it
carried. The throughput of the full micro-batches (at least ``FULL_FILL`` of the token budget;
the best one where none is full) is what the update would run at if every micro-batch were full;
the time beyond ``tokens / that throughput`` of each micro-batch is what shortness cost. Tokens
per second stands in for MFU here: at one budget the FLOPs per token differ only through the
attention's length term.

Metrics, per role (the mean over ranks): ``perf/<role>_micro_batches`` (micro-steps a rank ran,
epochs included), ``perf/<role>_micro_fill`` (their mean share of the budget),
``perf/<role>_short_time_share`` (the share of the update's micro-step time lost below the
full micro-batches' throughput) and ``perf/<role>_micro_step_fixed_s``: a micro-step's fixed
cost, the intercept of ``seconds = fixed + per_work x work`` fitted over the role's micro-steps
(``fixed_cost``), where ``work`` is what the step says a micro-step carried (its tokens, or its
tokens weighted by the passes its recompute plan runs: ``ppo/micro_batches.py``, which takes
``fixed / per_work`` as its ``MICRO_STEP_TOKENS`` once measured). Empty where fewer than
``FIT_STEPS`` micro-steps or too narrow a spread of work make no fit; and
``perf/<role>_micro_tokens_max``, the real tokens of the largest micro-batch the update ran, and
``perf/<role>_micro_steps_s``, the micro-steps' seconds together (the update phase's seconds less
these: the optimizer steps, the gradient norms and the host's work between micro-steps).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

#: A micro-batch this full (of the token budget) counts as full.
FULL_FILL = 0.9
#: The fewest micro-steps, and the least ratio of their largest work to their smallest, for a fit.
FIT_STEPS, FIT_SPREAD = 3, 1.2


class MicroTimer:
    """Times the micro-steps of one role's update on ``device`` against a ``budget`` of tokens."""

    def __init__(self, device: torch.device | str, budget: int) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.budget = max(int(budget), 1)
        self._steps: list[tuple[int, object, object]] = []  # tokens, start, end
        self._work: list[float] = []

    @contextmanager
    def step(self, tokens: int, work: float | None = None) -> Iterator[None]:
        """Times the micro-step run inside, which carried ``tokens`` real tokens and ``work``
        (None: the tokens) for ``fixed_cost``."""
        self._work.append(float(tokens if work is None else work))
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._steps.append((int(tokens), start, end))

    def seconds(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of each micro-step timed so far (on a card: waits for the last one)."""
        if self.cuda and self._steps:
            self._steps[-1][2].synchronize()
            return [(n, start.elapsed_time(end) / 1e3) for n, start, end in self._steps]
        return [(n, end - start) for n, start, end in self._steps]

    def fixed_cost(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per unit of work)`` of the micro-steps timed so far, by least
        squares (module doc); None where no fit can be made."""
        points = [(w, s) for w, (_, s) in zip(self._work, self.seconds()) if s > 0 and w > 0]
        if len(points) < FIT_STEPS or max(w for w, _ in points) < FIT_SPREAD * min(w for w, _ in points):
            return None
        mean_w = sum(w for w, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        slope = (sum((w - mean_w) * (s - mean_s) for w, s in points)
                 / sum((w - mean_w) ** 2 for w, _ in points))
        if slope <= 0:
            return None
        return max(mean_s - slope * mean_w, 0.0), slope

    def metrics(self, role: str) -> dict[str, list[float]]:
        """This rank's figures of the module doc, as lists for ``metrics.mean_over_ranks``."""
        steps = [(n, s) for n, s in self.seconds() if s > 0]
        names = [f"perf/{role}_micro_batches", f"perf/{role}_micro_fill", f"perf/{role}_short_time_share",
                 f"perf/{role}_micro_step_fixed_s", f"perf/{role}_micro_tokens_max", f"perf/{role}_micro_steps_s"]
        if not steps:
            return {name: [] for name in names}
        fit = self.fixed_cost()
        full = [(n, s) for n, s in steps if n >= FULL_FILL * self.budget]
        rate = (sum(n for n, _ in full) / sum(s for _, s in full)) if full else max(n / s for n, s in steps)
        lost = sum(max(0.0, s - n / rate) for n, s in steps)
        total = sum(s for _, s in steps)
        return {names[0]: [float(len(steps))], names[1]: [sum(n for n, _ in steps) / len(steps) / self.budget],
                names[2]: [lost / total], names[3]: [fit[0]] if fit else [],
                names[4]: [float(max(n for n, _ in steps))], names[5]: [total]}
