"""``ValidationCallback``: the validation sets through the agent loop every ``val_every`` RL steps
(README, "Validation").

When: after the update of step ``N`` when ``N % val_every == 0`` (and at the last step,
``trainer.total_steps``, when ``val_on_last_step``, as verl does), and before the first step as
step 0 when ``val_before_train`` and the run is fresh (not resumed, step 0 not validated yet).
A step whose output is not finite is not validated (its update was skipped; the NaN guard owns it).
A SIGTERM noted before or during the step-0 validation stops the run once it is written, before
step 1 (Lightning's ``SIGTERMException``, exit 143; Lightning itself looks only at a training
batch's end). A validation is never cut short: its dump and records appear whole or not at all
(written aside, then renamed), and a periodic one is part of its step, whose checkpoint Lightning
writes after every other callback.

What, on every rank: ``trainer.datamodule.validation_rollout(N)`` (collective), with the global
RNGs (Python, numpy, torch CPU and CUDA) saved before and restored after, so validation never
shifts training's random draws; the rollout itself is greedy by default and uses its own request
seeds. Then, with every rank's records gathered on rank 0:

- metrics (``_summary.view_metrics``): ``<bench>/overall/{acc,objective,cost,cost_usd,explores}``
  and the same for every subset value (``gpqa/<value>/acc``, ...), plus ``val/reward/<field>``
  means of every reward-breakdown field, ``val/terminal/<reason>`` fractions,
  ``val/trajectories`` and ``timing_s/testing``; logged with ``pl_module.log_metrics(metrics,
  step=N)`` on every rank (rank 0 computes them and broadcasts them; the module logs on rank 0
  only; a failure on rank 0 is raised on every rank);
- ``checkpoints/<name>/global_step_N/val_dumps/N.jsonl``: verl's dump, one row a trajectory with
  ``input`` (decoded prompt), ``output`` (decoded response, tool responses included), ``gts``,
  ``score`` (training reward), ``step``, ``uid`` and every reward-breakdown key; decoded with
  ``trainer.datamodule.chat.tokenizer`` and ``skip_special_tokens=True`` as verl does;
- ``artifacts/<name>/val/step_N/``: the records (with their four per-token arrays), tensors.npz
  and manifest (``_step_dump``).

Overlapped (``overlap``, ``callbacks.validation.overlap``; off by default): a periodic validation
of step ``N`` below ``total_steps`` is deferred (``datamodule.carry_validation(N)``) and rides with
step ``N + 1``'s training rollout: the same engine and weights version (step ``N``'s update was
synced before that rollout), its requests in a lane of their own in the same agent loop run
(continuous batching; its sampling, seeds, max tokens and records as alone). At that batch's start
(``on_train_batch_start``, before step ``N + 1`` logs anything) it is gathered, written and logged
under step ``N`` as above, with ``timing_s/testing`` its marginal cost (the seconds the shared run
went on after the training trajectories were done, plus gathering and writing) and
``timing_s/testing_overlapped`` its seconds under the training trajectories (what overlapping
saved). Tokens, rewards and metrics are a validation alone's; log-probs (its and the training
rollout's) move within 1e-5, as vLLM's do in another batch's company
(``tests/rollout/test_validation_rides.py``). Step 0 and the last step run alone (no rollout
follows); so does everything in the separate layout, whose producer samples ahead on older
weights (``datamodule.carries_validation``). A deferred step is ``pending`` in ``state_dict``, so
the checkpoint of step ``N`` resumes it (it rides with the resumed run's first rollout); a stop
before the ride validates it alone at ``on_train_end``.

Other callbacks hear of it: every ``RLCallback`` (``base.py``) gets ``on_rl_validation_end(trainer,
pl_module, step, metrics, rows)`` on every rank (``rows``: the per-trajectory rows of
``_summary.trajectory_row`` on rank 0, None elsewhere); the figures callback draws from it.

Ordering: the engines serve the step-N weights when this runs, whatever the callbacks' order:
the weight sync is the PPO step's last phase (``ppo/module.py``), which Lightning finishes
before any callback's ``on_train_batch_end``, and the starting weights are synced in the
module's ``on_fit_start``, before any ``on_train_start``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from atlas_lightning.reward import reward_means
from atlas_lightning.distributed import all_reduce_max, on_rank_zero
from atlas_lightning.store.files import atomic_write_jsonl
from atlas_lightning.store.step_folder import gather_step, write_step_folder
from atlas_lightning.callbacks.base import rl_callbacks
from atlas_lightning.ppo.step_output import read_step_output
from atlas_lightning.rollout.rng import preserved_rng
from atlas_lightning.reward.summary import terminal_counts, trajectory_row, view_metrics

log = logging.getLogger(__name__)

#: Keys of a dump row besides the reward breakdown's (verl's ``_dump_generations`` plus ``uid``).
DUMP_KEYS = ("input", "output", "gts", "score", "step", "uid")


def dump_rows(records: list, tokenizer: Any, step: int) -> list[dict]:
    """verl's validation dump rows (see the module docstring), one a record, in record order."""
    rows = []
    for record in records:
        name = f"trajectory {record.uid}/{record.session_id}"
        if record.prompt_ids is None or record.response_ids is None:
            raise ValueError(f"validation step {step}: {name} has no prompt_ids/response_ids to decode")
        clash = sorted(set(DUMP_KEYS) & set(record.reward))
        if clash:
            raise ValueError(
                f"validation step {step}: {name}'s reward breakdown has keys {clash} that the dump reserves")
        row = {
            "input": tokenizer.decode([int(t) for t in record.prompt_ids], skip_special_tokens=True),
            "output": tokenizer.decode([int(t) for t in record.response_ids], skip_special_tokens=True),
            "gts": record.ground_truth,
            "score": float(record.reward_score),
            "step": int(step),
            "uid": record.uid,
        }
        row.update(record.reward)
        rows.append(row)
    return rows


def validation_metrics(records: list, seconds: Optional[float] = None) -> tuple[dict[str, float], list[dict]]:
    """``(metrics, rows)`` of a validation's records (see the module docstring)."""
    rows = [trajectory_row(record) for record in records]
    metrics = view_metrics(rows)
    metrics.update(reward_means([record.reward for record in records], prefix="val/reward/"))
    if rows:
        metrics["val/trajectories"] = float(len(rows))
        metrics.update({f"val/terminal/{reason}": n / len(rows) for reason, n in terminal_counts(rows).items()})
    if seconds is not None:
        metrics["timing_s/testing"] = float(seconds)
    return metrics, rows


class ValidationCallback(L.Callback):
    """Validation every ``val_every`` RL steps (0: only before training and at the last step,
    ``total_steps``), before the first step when ``val_before_train``; see the module docstring.
    Writes under ``artifacts`` and ``checkpoints`` (the run's ``paths.artifacts`` and
    ``paths.checkpoints``); ``run_id`` names the run in the step manifests. ``overlap``: a
    periodic validation rides with the next step's training rollout (module docstring,
    "Overlapped")."""

    def __init__(self, artifacts: str | Path, checkpoints: str | Path, run_id: str, val_every: int = 5,
                 val_before_train: bool = True, val_on_last_step: bool = True,
                 total_steps: Optional[int] = None, overlap: bool = False) -> None:
        if not isinstance(val_every, int) or isinstance(val_every, bool) or val_every < 0:
            raise ValueError(
                f"ValidationCallback: val_every must be an int >= 0 (0: never periodically), got {val_every!r}")
        self.artifacts = Path(artifacts)
        self.checkpoints = Path(checkpoints)
        self.run_id = run_id
        self.total_steps = total_steps
        self.val_every = val_every
        self.val_before_train = bool(val_before_train)
        self.val_on_last_step = bool(val_on_last_step)
        self.overlap = bool(overlap)
        #: RL steps validated so far (checkpointed: a resumed run does not redo step 0).
        self.validated: list[int] = []
        #: The step whose validation rides with the next training rollout (checkpointed: a
        #: checkpoint of that step resumes it), and whether the datamodule carries it now.
        self.pending: Optional[int] = None
        self._carried = False
        self._said_alone = False
        self._restored = False

    # -- when -------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fresh = not self._restored and getattr(trainer.datamodule, "next_step", 1) == 1
        if self.val_before_train and fresh and 0 not in self.validated:
            _stop_on_sigterm(trainer)
            self.run_validation(trainer, pl_module, 0)
            _stop_on_sigterm(trainer)  # no step is under way: Lightning itself would look only after step 1
        if self.pending is not None and _carries(trainer.datamodule):  # resumed from a checkpoint that deferred it
            trainer.datamodule.carry_validation(self.pending)
            self._carried = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        out = read_step_output(outputs, "ValidationCallback.on_train_batch_end")
        if not (out.finite and self.should_validate(out.step, self.total_steps)):
            return
        if self._rides(trainer, out.step):
            trainer.datamodule.carry_validation(out.step)
            self.pending, self._carried = out.step, True
        else:
            self.run_validation(trainer, pl_module, out.step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The validation deferred at the previous step rode with this batch's rollout: logged
        now, at its own step, before anything of this step is."""
        self._finish_pending(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Training stopped before a deferred validation's ride (a stop before the last step):
        it runs alone, on the weights it was deferred with."""
        self._finish_pending(trainer, pl_module)

    def should_validate(self, step: int, total_steps: Optional[int] = None) -> bool:
        """After step ``step``'s update: is it a validation step?"""
        periodic = self.val_every > 0 and step % self.val_every == 0
        last = self.val_on_last_step and total_steps is not None and step == int(total_steps)
        return periodic or last

    def _rides(self, trainer: L.Trainer, step: int) -> bool:
        """Whether step ``step``'s validation rides with the next training rollout: ``overlap``,
        a next step to come, and a datamodule that carries it (not the separate layout)."""
        if not self.overlap or self.total_steps is None or step >= int(self.total_steps):
            return False
        if _carries(trainer.datamodule):
            return True
        if not self._said_alone:
            log.info("validation runs alone: callbacks.validation.overlap needs the synchronous layout, where "
                     "the next training rollout samples the weights just validated")
            self._said_alone = True
        return False

    # -- what -------------------------------------------------------------------------------

    def run_validation(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> dict[str, float]:
        """Validate as RL step ``step`` on every rank (collective), alone on the engine; returns
        the metrics."""
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "validation_rollout"):
            raise ValueError("ValidationCallback: trainer.datamodule must be a RolloutDataModule (validation_rollout)")
        started = time.monotonic()
        with preserved_rng():
            batch = datamodule.validation_rollout(step)
        return self._record(trainer, pl_module, step, batch, started)

    def _finish_pending(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Record the deferred validation: the batch that rode with the last training rollout
        (``timing_s/testing``: the seconds the rollout ran on after its training trajectories,
        plus recording it; ``timing_s/testing_overlapped``: its seconds under them), or, not
        carried, a rollout alone now."""
        step, self.pending = self.pending, None
        if step is None:
            return
        carried, self._carried = self._carried, False
        started = time.monotonic()
        batch = trainer.datamodule.take_validation(step) if carried else None
        if batch is None:
            self.run_validation(trainer, pl_module, step)
            return
        extra = {"timing_s/testing_overlapped": float(batch.timing["overlapped"])}
        self._record(trainer, pl_module, step, batch, started - batch.timing["tail"], extra)

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, batch: Any, started: float,
                extra: Optional[dict] = None) -> dict[str, float]:
        """Gather, summarise, write and log validation ``batch`` of ``step`` (collective);
        ``timing_s/testing`` counts from ``started``. Returns the metrics."""
        datamodule = trainer.datamodule
        gathered = gather_step(step, batch.records)
        seconds = time.monotonic() - started
        rows: Optional[list] = None

        def summarize_and_write() -> dict:
            nonlocal rows
            records = gathered[0]
            metrics, rows = validation_metrics(records, seconds)
            metrics.update(extra or {})
            tokenizer = getattr(getattr(datamodule, "chat", None), "tokenizer", None)
            if tokenizer is None:
                raise ValueError("ValidationCallback: trainer.datamodule.chat.tokenizer is needed to decode the dump")
            atomic_write_jsonl(dump_path(self.checkpoints, step), dump_rows(records, tokenizer, step))
            write_step_folder(self.artifacts / "val", step, records,
                              manifest_extra={"partition": "val", "run_id": self.run_id,
                                              "weights_version": getattr(batch, "weights_version", None)})
            log.info("validation step %d: %s", step, ", ".join(
                f"{k}={v:.4g}" for k, v in metrics.items() if k.endswith("/overall/acc")))
            return metrics

        metrics = on_rank_zero(summarize_and_write, f"validation step {step}")
        pl_module.log_metrics(metrics, step=step)
        self.validated.append(step)
        for callback in rl_callbacks(trainer):
            callback.on_rl_validation_end(trainer, pl_module, step, metrics, rows)
        return metrics

    # -- resumable state ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        state: dict = {"validated": list(self.validated)}
        if self.pending is not None:
            state["pending"] = self.pending
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.validated = [int(s) for s in state_dict.get("validated", [])]
        pending = state_dict.get("pending")
        self.pending = None if pending is None else int(pending)
        self._restored = True


def _stop_on_sigterm(trainer: L.Trainer) -> None:
    """Lightning's ``SIGTERMException`` (a stop with exit 143, ``run/interrupts.py``) on every rank
    when any rank's trainer has noted a SIGTERM (``trainer.received_sigterm``). Collective."""
    if all_reduce_max([float(bool(getattr(trainer, "received_sigterm", False)))])[0] > 0:
        raise SIGTERMException()


def _carries(datamodule: Any) -> bool:
    """Whether ``datamodule`` can carry a validation with its next training rollout."""
    return bool(getattr(datamodule, "carries_validation", False))


def dump_path(checkpoints: Path, step: int) -> Path:
    """``checkpoints/<name>/global_step_N/val_dumps/N.jsonl`` of a run (``checkpoints``: its
    ``checkpoints/<name>``)."""
    return Path(checkpoints) / f"global_step_{step}" / "val_dumps" / f"{step}.jsonl"
