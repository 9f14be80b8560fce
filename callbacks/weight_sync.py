"""Weight sync: after every update the actor's weights reach the engines, verified (SPEC 7).

Order of work, all ranks together (FSDP gathers are collective):

1. export: the actor adapter as a PEFT folder under ``outputs/<name>/engine_adapters/vK``
   (``rollout.weight_sync: lora``), rank 0 writes; or the adapter merged into the base and
   sent in buckets of at most ``rollout.bucket_mb`` (``merged``);
2. load: each engine serves version ``K`` (a new LoRA id, never a reused one);
3. verify: the engine reports the tensor count and checksum of what it holds, compared with
   what was sent; then the trainer's and the engine's log-probs of a probe sequence are
   compared, logged as ``rollout/logprob_gap``. A mismatch, a gap over
   ``rollout.max_logprob_gap`` or a non-finite engine log-prob raises ``WeightSyncError``:
   no rollout ever runs on weights that are not the trained ones.

Version ``K`` = the number of updates applied (0 before training). It runs first among the
callbacks (``fit`` puts it there) so that validation after step N samples the step-N weights.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Optional

import lightning as L

from atlas_lightning import distributed as dist_utils
from atlas_lightning.config import run_dirs
from atlas_lightning.rollout.engine import AdapterVersion


class WeightSyncError(RuntimeError):
    """The engines do not hold the weights the trainer sent."""


class WeightSyncCallback(L.Callback):
    def __init__(self, keep_versions: int = 2) -> None:
        self.keep_versions = keep_versions
        self.version: Optional[int] = None
        self.last_gap: Optional[float] = None

    # -- hooks ----------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        self.sync(trainer, pl_module, version=pl_module.rl_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is not None and not outputs.get("finite", True):
            return  # the NaN guard decides; never ship non-finite weights
        self.sync(trainer, pl_module, version=batch.step)

    # -- the sync -------------------------------------------------------------------------

    def sync(self, trainer, pl_module, version: int) -> dict:
        cfg = pl_module.cfg
        dm = trainer.datamodule
        engine = dm.engine
        started = time.monotonic()
        if cfg.rollout.weight_sync == "lora":
            folder = run_dirs(cfg)["outputs"] / "engine_adapters" / f"v{version}"
            expected = pl_module.export_actor_adapter(folder)
            dist_utils.barrier()
            report = engine.set_adapter(AdapterVersion(str(folder), version=version))
            self._prune(folder.parent, version)
        else:
            expected = (0, 0.0)
            report = None
            for bucket in pl_module.merged_weight_buckets(cfg.rollout.bucket_mb * 2**20):
                held = engine.load_weights(iter(bucket))
                expected = (expected[0] + len(bucket), expected[1] + sum(float(t.double().sum()) for _, t in bucket))
                report = held if report is None else type(held)(report.tensor_count + held.tensor_count,
                                                                report.checksum + held.checksum)
        self._check_held(expected, report, version)
        gap = self._probe(trainer, pl_module, dm, engine)
        dm.weights_version = version
        self.version = version
        self.last_gap = gap
        metrics = {"rollout/logprob_gap": gap, "timing_s/update_weights": time.monotonic() - started,
                   "rollout/sync_tensor_count": float(report.tensor_count)}
        pl_module.log_metrics(metrics, step=version)
        return metrics

    @staticmethod
    def _check_held(expected: tuple[int, float], report, version: int) -> None:
        count, checksum = expected
        if report.tensor_count != count:
            raise WeightSyncError(f"weight sync v{version}: the engine holds {report.tensor_count} tensors, "
                                  f"the trainer sent {count}")
        if not math.isclose(report.checksum, checksum, rel_tol=1e-6, abs_tol=1e-6):
            raise WeightSyncError(f"weight sync v{version}: engine checksum {report.checksum!r} differs from the "
                                  f"trainer's {checksum!r}")

    @staticmethod
    def _probe(trainer, pl_module, dm, engine) -> float:
        """Max |trainer - engine| log-prob over a fixed probe sequence (a validation prompt)."""
        cfg = pl_module.cfg
        probe = dm.probe_token_ids()
        engine_lp = engine.prompt_logprobs(probe)
        if not all(math.isfinite(x) for x in engine_lp):
            raise WeightSyncError("weight sync: the engine's probe log-probs are not finite (NaN/inf)")
        trainer_lp = pl_module.probe_logprobs(probe)
        if len(engine_lp) != len(trainer_lp):
            raise WeightSyncError(f"weight sync: probe lengths differ ({len(engine_lp)} vs {len(trainer_lp)})")
        gap = max(abs(a - b) for a, b in zip(engine_lp, trainer_lp))
        gap = dist_utils.all_reduce_max([gap])[0]
        if not gap <= cfg.rollout.max_logprob_gap:
            raise WeightSyncError(
                f"weight sync: trainer and engine log-probs differ by {gap:.4g} on the probe sequence "
                f"(rollout.max_logprob_gap={cfg.rollout.max_logprob_gap}); refusing to roll out")
        return gap

    def _prune(self, parent: Path, version: int) -> None:
        if not dist_utils.is_rank_zero():
            return
        for old in parent.glob("v*"):
            try:
                if int(old.name[1:]) <= version - self.keep_versions:
                    shutil.rmtree(old, ignore_errors=True)
            except ValueError:
                continue

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.version = state.get("version")
