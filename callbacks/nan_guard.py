"""``NaNGuardCallback``: what happens when a step's entropy, log-probs, losses or gradient norms
are not finite (the report's separate6-2 layout: NaN entropy after a wrong weight merge).

The module has already refused to step the optimizers for such a step and says so with
``finite == False`` and a ``nonfinite`` diagnostic. This callback then, on every rank:

1. gathers every rank's diagnostic and records (collective) and, on rank 0, writes
   ``artifacts/<name>/nonfinite/step_N.json`` (step, phase, what was non-finite, counts,
   trajectories involved, how many optimizer steps of step N each role had already applied and
   where the update stopped (role, epoch, mini-batch), the step's metrics with non-finite values
   as ``"nan"``/``"inf"``, each rank's own diagnostic, the policy and the last good checkpoint
   that verifies against its ``checkpoint.json``) and
   ``artifacts/<name>/nonfinite/step_N/`` (the offending trajectories' records, their tensors
   and a manifest; every trajectory of the step when the diagnostic names none, e.g. a
   gradient norm);
2. acts by ``policy``:

   - ``stop``: raises ``NonFiniteError`` naming the step, what was non-finite and the latest
     complete ``checkpoints/<name>/global_step_M/`` (M < N) to resume from. Lightning runs
     checkpoint callbacks (``Checkpoint`` subclasses) after all others, so nothing of step N is
     checkpointed;
   - ``rollback``: calls ``pl_module.restore_checkpoint(step_dir)`` with that checkpoint (all
     ranks: it is collective; the module must be ``Checkpointable``, ``base.py``), then
     ``pl_module.sync_weights(M, log_step=N)`` (the engines serve the restored actor, version
     M, before the next rollout), then ``on_rl_weights_restored(trainer, pl_module, step,
     step_dir)`` on every ``RLCallback``, logs ``nan_guard/rollbacks`` (the run's count) at step
     N and lets training go on with the next batch (the data cursor is not rewound).
     Without a checkpoint, or after ``max_rollbacks`` rollbacks, it stops as ``stop`` does.

A checkpoint still being written in the background (the step checkpoint's, of an earlier step)
is finished first (``wait_for_checkpoints``), so the guard names and restores the newest one.

Every rank must see the same ``finite`` (the module decides it across ranks: the callbacks'
collectives depend on it). Rank 0 alone picks the checkpoint and the action (other nodes may
not share its file system) and broadcasts them; a failure there is raised on every rank.

Merging the ranks' diagnostics: ``what`` is the union; each name's ``count`` is the sum over
ranks and its ``trajectories`` the union (each rank is taken to report its own trajectories).

``NonFiniteError`` (``errors.py``) is also what the weight sync raises for an engine whose
probe log-probs are not finite (``rollout/sync.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L

from atlas_lightning.errors import NonFiniteError
from atlas_lightning.store.records import FILE_VERSION, utc_now
from atlas_lightning.store.checkpoints import checkpoint_step, latest_verified
from atlas_lightning.distributed import on_rank_zero
from atlas_lightning.store.files import atomic_write_json, json_safe
from atlas_lightning.store.step_folder import gather_step, write_step_folder
from atlas_lightning.callbacks.base import Checkpointable, rl_callbacks
from atlas_lightning.callbacks.checkpoint import wait_for_checkpoints
from atlas_lightning.ppo.step_output import read_step_output

log = logging.getLogger(__name__)

POLICIES = ("stop", "rollback")


def merge_diagnostics(diagnostics: Sequence[Optional[Mapping[str, Any]]]) -> dict:
    """One diagnostic from every rank's ``nonfinite`` dict (see the module docstring)."""
    what: list[str] = []
    where: dict[str, dict] = {}
    phases: list[str] = []
    for diag in diagnostics:
        if not diag:
            continue
        for name in diag.get("what", []):
            if name not in what:
                what.append(str(name))
        phase = diag.get("phase")
        if phase and phase not in phases:
            phases.append(str(phase))
        for name, info in (diag.get("where") or {}).items():
            entry = where.setdefault(str(name), {"count": 0, "trajectories": []})
            entry["count"] += int((info or {}).get("count", 0))
            for trajectory in (info or {}).get("trajectories", []):
                if trajectory not in entry["trajectories"]:
                    entry["trajectories"].append(str(trajectory))
    for name in where:
        if name not in what:
            what.append(name)
    # every rank took the same optimizer steps (the module agrees on non-finite values collectively)
    applied: dict[str, int] = {}
    stopped_at = None
    for diag in diagnostics:
        for role, count in ((diag or {}).get("optimizer_steps_applied") or {}).items():
            applied[str(role)] = max(applied.get(str(role), 0), int(count))
        stopped_at = stopped_at or (diag or {}).get("stopped_at")
    return {"what": what, "where": where, "phase": "+".join(phases) or "unknown",
            "optimizer_steps_applied": applied, "stopped_at": stopped_at}


def describe_applied(step: int, merged: Mapping[str, Any]) -> str:
    """What of step ``step`` had already changed the weights when the non-finite value came."""
    applied = {role: n for role, n in (merged.get("optimizer_steps_applied") or {}).items() if n}
    stopped = merged.get("stopped_at")
    where = ""
    if stopped:
        where = (f"; the non-finite value came in the {stopped['role']} update, epoch {stopped['epoch'] + 1} of "
                 f"{stopped['epochs']}, mini-batch {stopped['mini_batch'] + 1} of {stopped['mini_batches_per_epoch']}, "
                 f"whose optimizer step was not taken")
    if not applied:
        return f"no optimizer step of step {step} was applied{where}"
    counts = ", ".join(f"{role}: {n}" for role, n in applied.items())
    total = sum(applied.values())
    return (f"{total} optimizer step{'s' if total != 1 else ''} of step {step} had been applied before it "
            f"({counts}){where}")


def offending_records(records: Sequence[Any], merged: Mapping[str, Any]) -> list:
    """The records the diagnostic names (as ``uid/session_id`` or ``uid``); all if it names none."""
    named = {t for info in merged["where"].values() for t in info["trajectories"]}
    if not named:
        return list(records)
    return [r for r in records if f"{r.uid}/{r.session_id}" in named or r.uid in named]


class NaNGuardCallback(L.Callback):
    """Stops (``policy="stop"``) or rolls back (``policy="rollback"``) on a non-finite step; see
    the module docstring. ``max_rollbacks``: rollbacks allowed in a run before it stops.
    ``artifacts``, ``checkpoints``: the run's ``paths.artifacts`` (where the diagnostic goes) and
    ``paths.checkpoints`` (where the last good checkpoint is looked for); ``run_id`` names the
    run in the records' manifest."""

    def __init__(self, artifacts: str | Path, checkpoints: str | Path, run_id: str, policy: str = "stop",
                 max_rollbacks: int = 3) -> None:
        if policy not in POLICIES:
            raise ValueError(f"NaNGuardCallback: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not isinstance(max_rollbacks, int) or isinstance(max_rollbacks, bool) or max_rollbacks < 0:
            raise ValueError(f"NaNGuardCallback: max_rollbacks must be an int >= 0, got {max_rollbacks!r}")
        self.artifacts = Path(artifacts)
        self.checkpoints = Path(checkpoints)
        self.run_id = run_id
        self.policy = policy
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        #: ``{"step", "what", "action", "checkpoint"}`` of every non-finite step met (checkpointed).
        self.events: list[dict] = []

    # -- a step ---------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        out = read_step_output(outputs, "NaNGuardCallback.on_train_batch_end")
        if out.finite:
            return
        # a checkpoint still being written (the previous step's) is the latest good one once complete
        wait_for_checkpoints(trainer, log_step=out.step)
        gathered = gather_step(out.step, out.records, out.tensors, extra=dict(out.nonfinite or {}))

        def decide_and_write() -> tuple:
            # Rank 0 alone looks at the checkpoints (other nodes may not share the file system)
            # and its decision is every rank's.
            checkpoint, refusals = latest_verified(self.checkpoints, before_step=out.step)
            for reason in refusals:
                log.warning("NaN guard at step %d: skipped a checkpoint that does not verify: %s", out.step, reason)
            rollback = self.policy == "rollback" and checkpoint is not None and self.rollbacks < self.max_rollbacks
            action = "rollback" if rollback else "stop"
            merged, diagnostic = self._write_diagnostic(self.artifacts / "nonfinite", out, gathered, checkpoint,
                                                        action, self.run_id)
            return merged, diagnostic, checkpoint, action

        merged, diagnostic, checkpoint, action = on_rank_zero(decide_and_write, f"the NaN guard at step {out.step}")
        self.events.append({"step": out.step, "what": merged["what"], "action": action,
                            "checkpoint": None if checkpoint is None else str(checkpoint)})
        if action == "rollback":
            self._rollback(trainer, pl_module, out.step, merged, checkpoint)
        else:
            raise self._stop_error(out.step, merged, checkpoint, diagnostic)

    def _write_diagnostic(self, folder: Path, out: Any, gathered: tuple, checkpoint: Optional[Path], action: str,
                          run_id: str) -> tuple[dict, Path]:
        records, tensors, diagnostics = gathered
        merged = merge_diagnostics(diagnostics)
        chosen = offending_records(records, merged)
        index = {id(r): i for i, r in enumerate(records)}
        chosen_tensors = {name: [arrays[index[id(r)]] for r in chosen] for name, arrays in tensors.items()}
        write_step_folder(folder, out.step, chosen, chosen_tensors,
                          manifest_extra={"partition": "nonfinite", "run_id": run_id})
        report = {
            "file_version": FILE_VERSION,
            "written_at": utc_now(),
            "step": out.step,
            "phase": merged["phase"],
            "what": merged["what"],
            "where": merged["where"],
            "counts": {name: info["count"] for name, info in merged["where"].items()},
            "trajectories": [f"{r.uid}/{r.session_id}" for r in chosen],
            "trajectories_in_step": len(records),
            "records_folder": f"step_{out.step}",
            "metrics": json_safe(dict(out.metrics)),
            "by_rank": json_safe(list(diagnostics)),
            "policy": self.policy,
            "action": action,
            "rollbacks_before": self.rollbacks,
            "last_good_checkpoint": None if checkpoint is None else str(checkpoint),
            # by role; the weights in memory moved by these steps (none of it is checkpointed)
            "optimizer_steps_applied": merged["optimizer_steps_applied"],
            "stopped_at": merged["stopped_at"],
            "summary": describe_applied(out.step, merged),
        }
        path = atomic_write_json(folder / f"step_{out.step}.json", report)
        return merged, path

    def _stop_error(self, step: int, merged: dict, checkpoint: Optional[Path],
                    diagnostic: Optional[Path]) -> NonFiniteError:
        counts = ", ".join(f"{name}: {info['count']}" for name, info in merged["where"].items())
        found = ", ".join(merged["what"]) or "an unnamed quantity"
        if checkpoint is None:
            resume = "there is no complete checkpoint to resume from"
        else:
            resume = f"the last good checkpoint is {checkpoint} (resume with trainer.resume={checkpoint})"
        why = ""
        if self.policy == "rollback":
            why = (" (rollback impossible: no checkpoint)" if checkpoint is None
                   else f" (rollback refused: {self.rollbacks} rollbacks already, max_rollbacks={self.max_rollbacks})")
        message = (
            f"step {step}: non-finite {found} in phase {merged['phase']}" + (f" ({counts})" if counts else "")
            + f"; {describe_applied(step, merged)}; nothing of step {step} is checkpointed; {resume}{why}; "
            f"diagnostic: {diagnostic}"
        )
        return NonFiniteError(message, step=step, what=merged["what"], last_good_checkpoint=checkpoint,
                              diagnostic=diagnostic)

    def _rollback(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, merged: dict,
                  checkpoint: Path) -> None:
        if not isinstance(pl_module, Checkpointable):
            raise NonFiniteError(
                f"step {step}: policy rollback needs pl_module.restore_checkpoint(step_dir) and "
                f"pl_module.sync_weights(version, log_step) (Checkpointable), "
                f"which {type(pl_module).__name__} lacks; the last good checkpoint is {checkpoint}",
                step=step, what=merged["what"], last_good_checkpoint=checkpoint)
        log.warning("step %d: non-finite %s; rolling back to %s", step, ", ".join(merged["what"]), checkpoint)
        pl_module.restore_checkpoint(checkpoint)
        # the engines still serve the discarded weights: the restored ones before the next rollout
        pl_module.sync_weights(checkpoint_step(checkpoint), log_step=step)
        for callback in rl_callbacks(trainer):
            callback.on_rl_weights_restored(trainer, pl_module, step, checkpoint)
        self.rollbacks += 1
        pl_module.log_metrics({"nan_guard/rollbacks": float(self.rollbacks)}, step=step)

    # -- resumable state ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.events = [dict(e) for e in state_dict.get("events", [])]
