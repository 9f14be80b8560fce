"""Weight sync: after every update the actor's weights reach the engines, verified (SPEC 7).

Order of work, all ranks together (FSDP gathers are collective):

0. wake: a colocated engine that slept through the update (sleep mode) takes its memory back
   (``timing_s/wake``; ``timing_s/update_weights`` is the rest of the sync, and
   ``memory/peak_allocated_gib/update_weights`` its peak on CUDA);
1. export: the actor adapter as a PEFT folder under ``outputs/<name>/.engine_adapters/syncK``
   (hidden: never published)
   (``rollout.weight_sync: lora``), rank 0 writes; or the adapter merged into the base and
   sent in buckets of at most ``rollout.bucket_mb`` (``merged``; to a server through vLLM's
   weight-transfer API, ``rollout/weight_transfer.py``);
2. load: each engine serves version ``K`` (a new LoRA id, never a reused one);
3. verify: the engine reports the tensor count and checksum of what it holds, compared with
   what was sent; then the trainer's and the engine's log-probs of a probe sequence are
   compared, logged as ``rollout/logprob_gap``. A mismatch, a gap over
   ``rollout.max_logprob_gap`` raises ``WeightSyncError``, a non-finite engine log-prob the NaN
   guard's ``NonFiniteError``:
   no rollout ever runs on weights that are not the trained ones.

The weights version served is the number of updates applied (0 before training; after a NaN
guard rollback to step M, M again); it is published to the datamodule (``weights_version``)
while the sync still holds ``engine_lock``, so that a rollout records the version it really
sampled with (the asynchronous layout's producer waits on it). Every sync also gets a new engine-side id (``sync_id``,
never reused) so that no engine serves a stale adapter. It runs first among the callbacks
(``fit`` puts it there) so that validation after step N samples the step-N weights.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from pathlib import Path
from typing import Optional

import lightning as L

from atlas_lightning import distributed as dist_utils
from atlas_lightning.config import run_dirs
from atlas_lightning.rollout.engine import AdapterVersion


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_metrics(engine_bytes: int = 0) -> dict[str, float]:
    """The sync's peak of PyTorch's allocated memory less the engine's own allocation
    (``RolloutDataModule.engine_allocated_bytes``): the trainer's side (GiB, the maximum over
    ranks; CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    peak = dist_utils.all_reduce_max([(torch.cuda.max_memory_allocated() - engine_bytes) / 2**30])[0]
    return {"memory/peak_allocated_gib/update_weights": peak}


class WeightSyncError(RuntimeError):
    """The engines do not hold the weights the trainer sent."""


class WeightSyncCallback(L.Callback):
    def __init__(self, keep_versions: int = 2) -> None:
        self.keep_versions = keep_versions
        self.version: Optional[int] = None
        self.sync_id = 0
        self.last_gap: Optional[float] = None

    # -- hooks ----------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        self.sync(trainer, pl_module, version=pl_module.rl_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is not None and not outputs.get("finite", True):
            return  # the NaN guard decides; never ship non-finite weights
        self.sync(trainer, pl_module, version=batch.step)

    def on_rl_weights_restored(self, trainer, pl_module, step: int, checkpoint) -> None:
        """The NaN guard rolled the trainer back: serve the restored weights before the next rollout."""
        restored = int(Path(checkpoint).name.rsplit("_", 1)[1])
        self.sync(trainer, pl_module, version=restored, log_step=step)

    # -- the sync -------------------------------------------------------------------------

    def sync(self, trainer, pl_module, version: int, log_step: Optional[int] = None) -> dict:
        cfg = pl_module.cfg
        self.sync_id += 1
        dm = trainer.datamodule
        engine = dm.engine
        woken = time.monotonic()
        # no rollout runs while weights move (the asynchronous layout's producer waits)
        with getattr(dm, "engine_lock", None) or contextlib.nullcontext():
            if getattr(dm, "asynchronous", False):
                dist_utils.barrier()  # every rank's producer is idle before the shared server changes
            engine.wake_up()  # slept through the update (colocated sleep mode); a no-op otherwise
            started = time.monotonic()
            _reset_peak()
            if cfg.rollout.weight_sync == "lora":
                folder = run_dirs(cfg)["outputs"] / ".engine_adapters" / f"sync{self.sync_id}"
                expected = pl_module.export_actor_adapter(folder)
                dist_utils.barrier()
                report = engine.set_adapter(AdapterVersion(str(folder), version=self.sync_id))
                self._prune(folder.parent)
            elif getattr(engine, "takes_weight_packs", False):
                expected, report = self._send_packs(pl_module, engine, cfg.rollout.bucket_mb * 2**20, version)
            else:
                sent = {"count": 0, "sum": 0.0, "finished": False}

                def stream():  # one reload for the whole sync (vllm_engine._reload_weights), bucket by bucket
                    for bucket in pl_module.merged_weight_buckets(cfg.rollout.bucket_mb * 2**20):
                        for name, tensor in bucket:
                            sent["count"] += 1
                            sent["sum"] += float(tensor.double().sum())
                            yield name, tensor
                    sent["finished"] = True

                report = engine.load_weights(stream())
                if not sent["finished"]:  # the engine's own count would match what it did read
                    raise WeightSyncError(f"weight sync v{version}: the engine stopped reading the merged "
                                          f"weights after {sent['count']} tensors")
                expected = (sent["count"], sent["sum"])
            self._check_held(expected, report, version)
            gap = self._probe(pl_module, dm, engine, version)
            dm.weights_version = version  # published under the lock: the next rollout samples it
        self.version = version
        self.last_gap = gap
        metrics = {"rollout/logprob_gap": gap, "timing_s/update_weights": time.monotonic() - started,
                   "timing_s/wake": started - woken, "rollout/sync_tensor_count": float(report.tensor_count)}
        metrics.update(_peak_metrics(int(getattr(dm, "engine_allocated_bytes", 0) or 0)))
        pl_module.log_metrics(metrics, step=version if log_step is None else log_step)
        return metrics

    @staticmethod
    def _send_packs(pl_module, engine, bucket_bytes: int, version: int):
        """Merged weights in packed buckets through the engine's weight-transfer path (a
        server's): (what was sent, what the engine reports), both as ``tensor_checksum``."""
        from atlas_lightning.rollout.engine import tensor_checksum

        sent = [0, 0.0]

        def packs():
            for buffer, views in pl_module.merged_weight_packs(bucket_bytes):
                count, checksum = tensor_checksum(t for _, t in views)
                sent[0], sent[1] = sent[0] + count, sent[1] + checksum
                yield buffer, views

        report = engine.load_weight_packs(packs(), version=version)
        return (sent[0], sent[1]), report

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
    def _probe(pl_module, dm, engine, version: int) -> float:
        """Max |trainer - engine| log-prob over a fixed probe sequence (a validation prompt).
        Non-finite engine log-probs raise the NaN guard's ``NonFiniteError``."""
        from atlas_lightning.callbacks.nan_guard import check_probe_logprobs

        cfg = pl_module.cfg
        probe = dm.probe_token_ids()
        engine_lp = engine.prompt_logprobs(probe)
        check_probe_logprobs(engine_lp, version)
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

    def _prune(self, parent: Path) -> None:
        """Keep the newest ``keep_versions`` exported adapters (the engine may still read them)."""
        if not dist_utils.is_rank_zero():
            return
        for old in parent.glob("sync*"):
            try:
                if int(old.name[4:]) <= self.sync_id - self.keep_versions:
                    shutil.rmtree(old, ignore_errors=True)
            except ValueError:
                continue

    def state_dict(self) -> dict:
        return {"version": self.version, "sync_id": self.sync_id}

    def load_state_dict(self, state: dict) -> None:
        self.version = state.get("version")
        self.sync_id = int(state.get("sync_id", 0))
