"""The batch benchmark (``bench/NOTES.md``): one actor update over a whole batch of trajectories, with its
optimizer step, ours against the baseline, in bounded memory.

The batch is ``workload.sample_batch`` (32 trajectories of the length mix by default). One
update is what ``PPOModule`` does for an actor mini-batch: every token-budget micro-batch
forward + backward (policy loss, token-mean over the batch's loss tokens), gradient clipping at
1.0, one AdamW step (fp32 moments of the actor's LoRA), gradients zeroed.

* Ours: ``ActorCritic`` with ``model.checkpoint_layers=auto``'s plans taken as ``fit`` takes them
  (``update_bench.Bench._fit_plan``: the card's free memory, at most ``--batch-cap-gib``; the
  largest of ``--batch-budgets`` whose plan fits), the micro-batches cut as ``PPOModule`` cuts an
  update's and each run under its own size's plan (``OursRunner``). The plan is checked on the
  card before timing: one micro-step on the largest micro-batch and one optimizer step; if that
  peak is over the cap, every layer checkpointed at the same budget is tried instead.
* Baseline: transformers + peft as in ``update.BaselineRunner`` (padded micro-batches of a fixed
  number of sequences, full logits, every layer checkpointed), the same loss and step.

Both are warmed up by one micro-step and one optimizer step (Adam's moments allocated), then
one whole update is timed; its peak includes the moments. Useful FLOPs are ``flops.py``'s for
the actor over every sequence of the batch.

Who calls it: ``update_bench.py`` (section ``batch``).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from atlas_lightning.ppo import optimizer_state

from . import measure
from .update import TEMPERATURE, BaselineRunner, OursRunner, _losses, _pack
from .workload import PPOInputs


def _actor_parameters(runner) -> list[torch.nn.Parameter]:
    if isinstance(runner, OursRunner):
        return runner.model.actor_parameters()
    return [p for n, p in runner.peft_model.named_parameters() if "lora_" in n and ".actor." in n]


def _micro_step(runner, inputs: PPOInputs, indices, total: float) -> None:
    packed = _pack(inputs, indices, runner.device)
    rows = torch.as_tensor(indices, device=runner.device)
    if isinstance(runner, OursRunner):
        runner.use_recompute_for(inputs, indices)  # this micro-batch's plan, as PPOModule's update
        out, _ = runner.model.actor_forward(packed, temperature=TEMPERATURE, compute_entropy=False)
        _losses("actor", inputs, rows, packed, out, total).backward()
        return
    with runner.kernels():  # the backward's replays too
        _losses("actor", inputs, rows, packed, runner.per_token("actor", packed), total).backward()


class ActorUpdate:
    """One actor update for a runner as ``PPOModule._update`` makes it: ``epochs`` passes over
    ``mini_batches`` (each a list of micro-batches of trajectory indices; its loss normalised by its
    own loss tokens, then clipping and one AdamW step). The sampled batch is one mini-batch, one
    epoch. ``warm_up`` then ``__call__``."""

    def __init__(self, runner, inputs: PPOInputs, mini_batches: list[list[list[int]]], epochs: int = 1) -> None:
        self.runner, self.inputs, self.mini_batches, self.epochs = runner, inputs, mini_batches, epochs
        #: one epoch's micro-batches, in the order they run
        self.micro_batches = [micro for mini in mini_batches for micro in mini]
        self.params = _actor_parameters(runner)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6)
        optimizer_state.allocate(self.optimizer)  # its moments made first, as PPOModule makes them
        self.totals = [float(inputs.response_mask[[i for micro in mini for i in micro]].sum()) for mini in mini_batches]
        self.total = max(self.totals)
        tokens = [sum(int(inputs.sequences[i].numel()) for i in mb) for mb in self.micro_batches]
        self.largest = self.micro_batches[max(range(len(tokens)), key=tokens.__getitem__)]

    @property
    def tokens(self) -> int:
        """Tokens the update computes: every sequence, once an epoch."""
        return self.epochs * sum(int(self.inputs.sequences[i].numel()) for micro in self.micro_batches for i in micro)

    def _step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def warm_up(self) -> float:
        """One micro-step on the largest micro-batch and one optimizer step; the peak, GiB."""
        measure.reset_peak(self.runner.device)
        _micro_step(self.runner, self.inputs, self.largest, self.total)
        self._step()
        measure.sync(self.runner.device)
        return measure.peak_gib(self.runner.device)

    def __call__(self) -> None:
        #: the running peak (GiB) after each micro-step: which micro-batch set the update's peak
        self.running_peak_gib = []
        cuda = self.runner.device.type == "cuda"
        #: CUDA events around each micro-step (no sync in the loop): ``micro_step_s`` after it
        self.events = [torch.cuda.Event(enable_timing=True)] if cuda else []
        if cuda:
            self.events[0].record()
        for _ in range(self.epochs):
            for mini, total in zip(self.mini_batches, self.totals):
                for indices in mini:
                    _micro_step(self.runner, self.inputs, indices, total)
                    if cuda:  # the allocator's host-side count: no sync
                        self.running_peak_gib.append(round(measure.peak_gib(self.runner.device), 2))
                        self.events.append(torch.cuda.Event(enable_timing=True))
                        self.events[-1].record()
                self._step()

    def micro_step_s(self) -> list[float]:
        """Seconds of each micro-step of the last ``__call__`` (after a sync)."""
        return [round(a.elapsed_time(b) / 1e3, 3) for a, b in zip(self.events, self.events[1:])]


def timed_update(update: ActorUpdate, flops: float, peak_tflops) -> dict:
    device = update.runner.device
    measure.reset_peak(device)
    seconds = measure.timed(device, update)
    tokens = update.tokens
    entry = {"seconds": seconds, "tokens_per_s": tokens / seconds, "useful_tflops": flops / seconds / 1e12,
             "peak_gib": measure.peak_gib(device), "epochs": update.epochs,
             "mini_batches": len(update.mini_batches), "micro_batches": len(update.micro_batches),
             "micro_batch_tokens": [sum(int(update.inputs.sequences[i].numel()) for i in mb)
                                    for mb in update.micro_batches],
             "micro_batch_sequences": [len(mb) for mb in update.micro_batches],
             "running_peak_gib": getattr(update, "running_peak_gib", []),
             "micro_step_s": update.micro_step_s() if device.type == "cuda" else []}
    if peak_tflops:
        entry["useful_mfu"] = entry["useful_tflops"] / peak_tflops
    return entry


def run_with_fallbacks(attempts: list[tuple[str, Callable[[], tuple]]], cap_gib, log,
                       tried: Optional[list] = None) -> tuple:
    """Try each ``(label, build)`` in turn; ``build()`` returns ``(runner, update, info)``. The
    first whose warm-up peak is within ``cap_gib`` (None: no cap) is returned with the list of
    what was tried (``tried``, if given, is that list: a later ``build`` may read it); the
    others are freed."""
    tried = [] if tried is None else tried
    for label, build in attempts:
        runner = update = None
        try:
            runner, update, info = build()
            started = time.perf_counter()
            peak = update.warm_up()
            tried.append({"attempt": label, "warm_up_peak_gib": peak, "warm_up_s": time.perf_counter() - started} | info)
            log(f"batch {label}: warm-up peak {peak} GiB")
            if cap_gib is None or peak is None or peak <= cap_gib:
                return runner, update, tried
        except Exception as err:  # an OOM in one attempt must leave room for the next
            tried.append({"attempt": label, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            log(f"batch {label}: {tried[-1]['error']}")
        runner = update = None
        measure.free_memory(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return None, None, tried


__all__ = ["ActorUpdate", "BaselineRunner", "OursRunner", "run_with_fallbacks", "timed_update"]
