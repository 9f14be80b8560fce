"""Weight sync: after every update the actor's weights reach the engines, verified (README, "The separate layout").

Order of work, all ranks together (FSDP gathers are collective):

0. wake: a colocated engine that slept through the update (sleep mode) takes its memory back
   (``timing_s/wake``; ``timing_s/update_weights`` is the rest of the sync, and
   ``memory/peak_allocated_gib/update_weights`` its peak on CUDA);
1. export, from ``pl_module.model`` through the model-level functions of ``models/``: the actor
   adapter as a PEFT folder under ``outputs/<name>/.engine_adapters/syncK`` (hidden: never
   published) (``rollout.weight_sync: lora``), rank 0 writes; or the adapter merged into the
   base and sent in buckets of at most ``rollout.bucket_mb`` (``merged``): streamed to
   ``Engine.load_weights``, or packed to ``Engine.load_weight_packs`` for an engine that
   ``takes_weight_packs`` (a server, through vLLM's weight-transfer API,
   ``rollout/engines/weight_transfer.py``);
2. load: each engine serves version ``K`` (a new LoRA id, never a reused one);
3. verify, exactly (``rollout/digest.py``: a fingerprint per tensor over dtype, shape and
   bytes, computed on the tensor's device):
   with LoRA, the exported folder against what the trainer sent (a tensor dropped, altered or
   swapped between layers is named with the folder, before any engine reads it), then what
   the engine holds against what was sent: the in-process engine reads back the factors its
   worker holds, in the dtype it holds them and with the scaling folded in as vLLM does it; a
   server reports its folder (LoRA) or the digest of each bucket its workers received (merged,
   gloo). Then the trainer's and the engine's log-probs of a probe sequence are compared
   (``rollout/logprob_gap``) against a bound set from the noise measured at this process's
   first sync (``rollout/logprob_gap_bound``: ``rollout.logprob_gap_factor`` times that gap,
   no tighter than a few float32 roundings, never above ``rollout.max_logprob_gap``): it catches an engine that
   serves something other than what it reports. A mismatch raises ``WeightSyncError`` naming
   the tensors, a non-finite engine log-prob the NaN guard's ``NonFiniteError``: no rollout
   ever runs on weights that are not the trained ones.

The weights version served is the number of updates applied (0 before training; after a NaN
guard rollback to step M, M again: ``on_rl_weights_restored``, ``base.py``); it is published to the datamodule (``weights_version``)
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

from atlas_lightning import distributed as dist_utils
from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.config import run_dirs
from atlas_lightning.ppo.step_output import read_step_output
from atlas_lightning.rollout.digest import WeightDigest, bucket_digest, dtype_named, lora_digest, tensor_digest
from atlas_lightning.rollout.engine import AdapterVersion

#: float32's relative resolution (2**-23): the finest gap two float32 log-probs can show.
FLOAT32_EPS = 2.0 ** -23
#: A clean engine differs from the trainer by a few roundings of the largest probe log-prob
#: (a log-softmax over the vocabulary; seen: 3-5 float32 ulps on the tiny model, gaps 3.8e-6 to
#: 5.7e-6 at |log-prob| 10.7): the noise floor, so that a lucky first sync cannot set the bound
#: below what later clean syncs show.
NOISE_ULPS = 4


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


def export_actor_adapter(model, folder: Path) -> dict:
    """Write ``model``'s actor adapter to ``folder`` (PEFT layout) for the engines and return what
    was sent: ``{PEFT module name: (A, B, scaling)}``, full tensors on every rank (digested by
    ``rollout.digest.lora_digest``), the scaling from the adapter's own config. Collective; rank
    0 writes."""
    from atlas_lightning.models.adapters import save_adapter
    from atlas_lightning.models.weights import adapter_state
    from atlas_lightning.rollout.digest import lora_modules

    state = adapter_state(model, "actor")
    save_adapter(model, "actor", folder)
    config = model.peft_model.peft_config["actor"]
    scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    return lora_modules(state, scaling)


class WeightSyncCallback(RLCallback):
    def __init__(self, keep_versions: int = 2) -> None:
        if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 1:
            # the newest exported adapter is the one the engine serves: it must stay
            raise ValueError(f"WeightSyncCallback: keep_versions must be an int >= 1, got {keep_versions!r}")
        self.keep_versions = keep_versions
        self.version: Optional[int] = None
        self.sync_id = 0
        self.last_gap: Optional[float] = None
        self.last_bound: Optional[float] = None
        #: The probe gap of this process's first sync: the engine's numerical noise (not saved:
        #: a resumed process measures its own engine).
        self.noise_gap: Optional[float] = None

    # -- hooks ----------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        self.sync(trainer, pl_module, version=pl_module.rl_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is not None and not read_step_output(outputs, "WeightSyncCallback.on_train_batch_end").finite:
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
            sent_tensors = None  # merged buckets: how many tensors they held
            if cfg.rollout.weight_sync == "lora":
                folder = run_dirs(cfg)["outputs"] / ".engine_adapters" / f"sync{self.sync_id}"
                sent = export_actor_adapter(pl_module.model, folder)
                dist_utils.barrier()
                self._check_folder(folder, sent, version)
                report = engine.set_adapter(AdapterVersion(str(folder), version=self.sync_id))
                self._prune(folder.parent)
            elif engine.takes_weight_packs:
                sent, sent_tensors, report = self._send_packs(pl_module.model, engine, cfg.rollout.bucket_mb * 2**20,
                                                              version)
            else:
                from atlas_lightning.models.weights import merged_weight_buckets

                named: list[tuple[str, str]] = []
                finished = [False]

                def stream():  # one reload for the whole sync (vllm_engine._reload_weights), bucket by bucket
                    for bucket in merged_weight_buckets(pl_module.model, "actor", cfg.rollout.bucket_mb * 2**20):
                        for name, tensor in bucket:
                            named.append((name, tensor_digest(tensor)))
                            yield name, tensor
                    finished[0] = True

                report = engine.load_weights(stream())
                if not finished[0]:  # the engine's own digest would match what it did read
                    raise WeightSyncError(f"weight sync v{version}: the engine stopped reading the merged "
                                          f"weights after {len(named)} tensors")
                sent = WeightDigest(dict(named))
            self._check_held(sent, report, version, sent_tensors=sent_tensors)
            gap = self._probe(pl_module, dm, engine, version)
            dm.weights_version = version  # published under the lock: the next rollout samples it
        self.version = version
        self.last_gap = gap
        metrics = {"rollout/logprob_gap": gap, "rollout/logprob_gap_bound": self.last_bound,
                   "timing_s/update_weights": time.monotonic() - started, "timing_s/wake": started - woken,
                   "rollout/sync_tensor_count": float(report.tensor_count)}
        metrics.update(_peak_metrics(int(getattr(dm, "engine_allocated_bytes", 0) or 0)))
        pl_module.log_metrics(metrics, step=version if log_step is None else log_step)
        return metrics

    @staticmethod
    def _send_packs(model, engine, bucket_bytes: int, version: int):
        """The actor merged into ``model``'s base, in packed buckets, through the engine's
        ``load_weight_packs`` (a server's weight transfer): (the digest of each bucket sent, how
        many tensors they held, what the engine reports per bucket). A backend that reports
        nothing back (``engine.reads_back`` False: nccl) is not digested."""
        from atlas_lightning.models.weights import merged_weight_packs

        entries: dict[str, str] = {}
        digest = engine.reads_back
        count = [0]

        def packs():
            for buffer, views in merged_weight_packs(model, "actor", bucket_bytes):
                if digest:
                    entries[f"bucket{len(entries)}"] = bucket_digest(views)
                count[0] += len(views)
                yield buffer, views

        report = engine.load_weight_packs(packs(), version=version)
        return WeightDigest(entries), count[0], report

    @staticmethod
    def _check_folder(folder: Path, sent: dict, version: int) -> None:
        """The exported folder holds exactly what was sent (before any engine reads it): a
        tensor dropped, altered or moved is named with the folder, never left to the engine."""
        from atlas_lightning.rollout.engine import EngineError
        from atlas_lightning.rollout.engines.server_engine import adapter_folder_digest

        try:
            written = adapter_folder_digest(folder)
        except EngineError as err:
            raise WeightSyncError(f"weight sync v{version}: {err}") from None
        expected = lora_digest(sent)
        if written.total != expected.total:
            raise WeightSyncError(f"weight sync v{version}: the exported adapter {folder} does not hold what the "
                                  f"trainer sent: {'; '.join(expected.differences(written))}")

    @staticmethod
    def _check_held(sent, report, version: int, sent_tensors: Optional[int] = None) -> None:
        """What the engine reports holding against what was sent, exactly (``rollout.digest``):
        ``sent`` is the adapter's ``{module: (A, B, scaling)}`` (digested in the form the
        engine holds it) or the digest of the merged tensors or buckets sent (``sent_tensors``:
        how many tensors the buckets held)."""
        form = report.form or {}
        if form.get("kind") in ("buckets", "unverified") and report.tensor_count != sent_tensors:
            raise WeightSyncError(f"weight sync v{version}: the engine took {report.tensor_count} tensors "
                                  f"({report.held}), the trainer sent {sent_tensors}")
        if form.get("kind") == "unverified":  # nothing came back (nccl): the probe is the check
            return
        if report.digest is None:
            raise WeightSyncError(f"weight sync v{version}: the engine reported no digest of what it holds")
        if form.get("kind") == "lora":
            dtype = form.get("dtype")
            if isinstance(dtype, list):
                raise WeightSyncError(f"weight sync v{version}: the engine holds the adapter in several dtypes {dtype}")
            expected = lora_digest(sent, dtype=dtype_named(dtype), scale_b=bool(form.get("scale_b")))
        else:
            expected = sent
        if form.get("kind") != "buckets" and report.tensor_count != len(expected):
            raise WeightSyncError(f"weight sync v{version}: the engine holds {report.tensor_count} tensors "
                                  f"({report.held}), the trainer sent {len(expected)}: "
                                  f"{'; '.join(expected.differences(report.digest))}")
        if report.digest.total != expected.total:
            raise WeightSyncError(f"weight sync v{version}: what the engine holds ({report.held}) is not what the "
                                  f"trainer sent: {'; '.join(expected.differences(report.digest))}")

    def _probe(self, pl_module, dm, engine, version: int) -> float:
        """Max |trainer - engine| log-prob over a fixed probe sequence (a validation prompt),
        against a bound set from the measured noise: the gap of this process's first sync
        (weights verified by digest, so only numerics differ) times ``rollout.logprob_gap_factor``,
        never below ``NOISE_ULPS`` float32 roundings of the probe's largest log-prob nor above
        ``rollout.max_logprob_gap``.
        The first sync itself is held to ``rollout.max_logprob_gap``. Non-finite engine log-probs
        raise the NaN guard's ``NonFiniteError``."""
        from atlas_lightning.callbacks.nan_guard import check_probe_logprobs
        from atlas_lightning.models.probe import probe_logprobs

        cfg = pl_module.cfg
        probe = dm.probe_token_ids()
        engine_lp = engine.prompt_logprobs(probe)
        check_probe_logprobs(engine_lp, version)
        trainer_lp = probe_logprobs(pl_module.model, probe, pl_module.device)
        if len(engine_lp) != len(trainer_lp):
            raise WeightSyncError(f"weight sync: probe lengths differ ({len(engine_lp)} vs {len(trainer_lp)})")
        gap = max(abs(a - b) for a, b in zip(engine_lp, trainer_lp))
        gap, scale = dist_utils.all_reduce_max([gap, max(1.0, max(abs(x) for x in trainer_lp))])
        bound = self._bound(cfg.rollout, scale)
        self.last_bound = bound
        if not gap <= bound:
            why = ("rollout.max_logprob_gap" if self.noise_gap is None else
                   f"{cfg.rollout.logprob_gap_factor} x the first sync's gap {self.noise_gap:.3g}")
            raise WeightSyncError(
                f"weight sync v{version}: trainer and engine log-probs differ by {gap:.4g} on the probe sequence, "
                f"above the bound {bound:.3g} ({why}): the engine does not serve the trained weights; "
                f"refusing to roll out")
        if self.noise_gap is None:
            self.noise_gap = gap
        return gap

    def _bound(self, rollout_cfg, scale: float) -> float:
        """The probe's bound (see ``_probe``); ``scale``: the largest |log-prob| on the probe."""
        ceiling = float(rollout_cfg.max_logprob_gap)
        if self.noise_gap is None:
            return ceiling
        factor = float(rollout_cfg.logprob_gap_factor)
        floor = NOISE_ULPS * scale * FLOAT32_EPS
        return min(ceiling, factor * max(self.noise_gap, floor))

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
