"""The weight sync: the actor's weights reach the engines, verified (README, "The separate layout").

``WeightSync.sync(model, serving, version)`` is the last phase of an RL step (``update_weights``,
run by ``PPOModule``: ``ppo/module.py`` says when), on every rank together (FSDP gathers are
collective). ``model`` is the trainer's ``ActorCritic``; ``serving`` is what serves the rollouts,
the ``RolloutDataModule``: its ``engine``, ``engine_lock``, ``asynchronous``,
``probe_token_ids()``, ``engine_allocated_bytes`` and the ``weights_version`` it publishes.

Order of work:

0. wake: a colocated engine that slept through the update (sleep mode) takes its memory back
   (``timing_s/wake``; ``timing_s/update_weights`` is the rest of the sync, and
   ``memory/peak_allocated_gib/update_weights`` its peak on CUDA);
1. export, from ``model`` through the model-level functions of ``models/``: with ``kind="lora"``
   the actor adapter as a PEFT folder ``adapter_folder/syncK``, in the model's dtype, the one
   the engines hold it in (rank 0 writes; the newest ``keep_versions`` are kept); with
   ``kind="merged"`` the adapter merged into the base, in buckets of at most ``bucket_mb`` MiB,
   offered to the engine as ``MergedWeights`` (``rollout/engine.py``). How merged weights
   arrive is the engine's (``Engine.load_merged``): an in-process engine reads them as a stream
   of named tensors, the separate layout's shared server as packed buckets through vLLM's
   weight-transfer API; the sync digests whichever it read;
2. load: each engine serves version ``K`` (a LoRA id never used before: ``sync_id``);
3. verify, exactly (``rollout/digest.py``: a fingerprint per tensor over dtype, shape and
   bytes, computed on the tensor's device): with LoRA, the exported folder against what the
   trainer sent (a tensor dropped, altered or swapped between layers is named with the folder,
   before any engine reads it), then what the engine holds against what was sent: the
   in-process engine reads back the factors its worker holds, in the dtype it holds them and
   with the scaling folded in as vLLM does it; a server reports its folder (LoRA) or the digest
   of each bucket its workers received (merged, gloo). Then the trainer's and the engine's
   log-probs of a probe sequence are compared (``rollout/logprob_gap``) against a bound set
   from the noise measured at this process's first sync (``rollout/logprob_gap_bound``:
   ``logprob_gap_factor`` times that gap, no tighter than a few float32 roundings, never above
   ``max_logprob_gap``): it catches an engine that serves something other than what it
   reports. A mismatch raises ``WeightSyncError`` naming the tensors, a non-finite engine
   log-prob ``errors.NonFiniteError``: no rollout ever runs on weights that are not the
   trained ones;
4. prove that the engine APPLIES what it was sent, whatever it reports and whatever the learning
   rate (``rollout/sync_probe.py``): the engine's probe log-probs must move from the last
   verified state as the trainer's do (``rollout/applied_*``). The process's first sync judges
   the move from the base the engine served before it to the actor (when measurable), then
   loads a marked actor and the actor again (sync ids K, K+1, K+2) and judges both moves: an
   engine that ignores the adapter stops the run before any training
   (``sync_probe.StartingCheckError``, exit 2). Every ``marked_check_every``-th later sync
   serves the marked actor first too (ids K, K+1), so that an engine serving anything but the
   version just sent is refused at that sync whatever the learning rate (``sync_probe``, "The
   marked check"); the others are judged by the update's own movement, once it is measurable.

Where a sync's seconds go, logged with its metrics as ``sync_s/<part>`` (summed over the sync's
loads and probes): ``export`` (the adapter's tensors gathered and its folder written),
``folder_check``, ``engine_load`` (the engine reading the folder, or the merge and its stream),
``held_check``, ``engine_probe`` and ``trainer_probe``.

The weights version served is the number of updates applied (0 before training; after a NaN
guard rollback to step M, M again); it is published to ``serving``
(``weights_version``) while the sync still holds ``engine_lock``, so that a rollout records the
version it really sampled with (the asynchronous layout's producer waits on it). Every sync gets
a new engine-side id (``sync_id``, never reused: an engine caches adapters by id); ``version``
and ``sync_id`` are the resumable state (``state_dict``), kept in the module's checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from atlas_lightning import distributed as dist_utils
from atlas_lightning.errors import NonFiniteError
from atlas_lightning.rollout.digest import WeightDigest, bucket_digest, dtype_named, lora_digest, tensor_digest
from atlas_lightning.rollout.engine import AdapterVersion, EngineError
from atlas_lightning.rollout.sync_probe import (MovementCheck, Reading, WeightSyncError, mark_shift, probe_scale,
                                                rounding_floor)

log = logging.getLogger(__name__)

#: The two ways the actor reaches the engines (``rollout.weight_sync``).
KINDS = ("lora", "merged")

# ----------------------------------------------------------------------------- what is sent


def export_actor_adapter(model, folder: Path, into: Any = None, dtype: Any = None) -> dict:
    """Write ``model``'s actor adapter to ``folder`` (PEFT layout, tensors named as the base
    checkpoint names them: vLLM ignores a Qwen3.5/3.6 adapter named otherwise) for the engines
    and return what was sent: ``{PEFT module name: (A, B, scaling)}``, full tensors on every rank
    (digested by ``rollout.digest.lora_digest``, which names a module from ``layers.<i>.`` on),
    the scaling from the adapter's own config. ``into``: the host buffers the folder is written
    from (``models.adapters.HostBuffers``, kept for the run), else new host memory. ``dtype``:
    the tensors cast to it first (the engines' LoRA dtype, the model's: vLLM casts what it loads
    to it, so the folder need carry no more; peft's float32 masters beside a bf16 base are twice
    the bytes to write, read back and load), else as the trainer holds them. Collective; rank 0
    writes."""
    from atlas_lightning.models.adapters import save_adapter
    from atlas_lightning.models.weights import adapter_state
    from atlas_lightning.rollout.digest import lora_modules

    state = adapter_state(model, "actor")  # gathered once: what is written is what is digested as sent
    if dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
    save_adapter(model, "actor", folder, checkpoint_names=True, into=into, state=state)
    config = model.peft_model.peft_config["actor"]
    scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    return lora_modules(state, scaling)


class MergedActor:
    """The actor merged into ``model``'s base (``models.weights``), in buckets of at most
    ``bucket_bytes``: the ``MergedWeights`` an engine reads (``Engine.load_merged``). Records
    what was read: ``sent`` (a digest per tensor streamed, or per bucket packed when asked),
    ``tensor_count`` and ``finished`` (the engine read to the end)."""

    def __init__(self, model, bucket_bytes: int) -> None:
        self.model = model
        self.bucket_bytes = bucket_bytes
        self.sent = WeightDigest()
        self.tensor_count = 0
        self.finished = False

    def tensors(self) -> Iterator[tuple[str, Any]]:
        from atlas_lightning.models.weights import merged_weight_buckets

        # one reload for the whole sync (vllm_engine._reload_weights), bucket by bucket
        for bucket in merged_weight_buckets(self.model, "actor", self.bucket_bytes):
            for name, tensor in bucket:
                self.sent.entries[name] = tensor_digest(tensor)
                self.tensor_count += 1
                yield name, tensor
        self.finished = True

    def packs(self, digest: bool = True) -> Iterator[tuple[Any, list]]:
        from atlas_lightning.models.weights import merged_weight_packs

        for buffer, views in merged_weight_packs(self.model, "actor", self.bucket_bytes):
            if digest:
                self.sent.entries[f"bucket{len(self.sent)}"] = bucket_digest(views)
            self.tensor_count += len(views)
            yield buffer, views
        self.finished = True


# ----------------------------------------------------------------------------- the checks


def check_folder(folder: Path, sent: dict, version: int, device: Any = "cpu") -> None:
    """The exported folder holds exactly what was sent (before any engine reads it): a tensor
    dropped, altered or moved is named with the folder, never left to the engine. Read back onto
    ``device`` (the trainer's card: the digest there, not on the host's cores)."""
    from atlas_lightning.rollout.engines.adapter_folder import adapter_folder_digest

    try:
        written = adapter_folder_digest(folder, device)
    except EngineError as err:
        raise WeightSyncError(f"weight sync v{version}: {err}") from None
    expected = lora_digest(sent)
    if written.total != expected.total:
        raise WeightSyncError(f"weight sync v{version}: the exported adapter {folder} does not hold what the "
                              f"trainer sent: {'; '.join(expected.differences(written))}")


def check_held(sent, report, version: int, sent_tensors: Optional[int] = None, device: Any = None) -> None:
    """What the engine reports holding (``report``, a ``SyncReport``) against what was sent,
    exactly: ``sent`` is the adapter's ``{module: (A, B, scaling)}`` (digested in the form the
    engine holds it, on ``device``: the trainer's card) or the ``WeightDigest`` of the merged
    tensors or buckets sent (``sent_tensors``: how many tensors the buckets held).
    ``WeightSyncError`` naming what differs."""
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
        held = dict(dtype=dtype_named(dtype), scale_b=bool(form.get("scale_b")))
        expected = lora_digest(sent, **held, device=device)
        if report.digest.total != expected.total and device is not None and str(device) != "cpu":
            # vLLM makes its form on the host: the host's judges (and names what differs)
            expected = lora_digest(sent, **held)
            if report.digest.total == expected.total:
                _warn_card_held_form()
    else:
        expected = sent
    if form.get("kind") != "buckets" and report.tensor_count != len(expected):
        raise WeightSyncError(f"weight sync v{version}: the engine holds {report.tensor_count} tensors "
                              f"({report.held}), the trainer sent {len(expected)}: "
                              f"{'; '.join(expected.differences(report.digest))}")
    if report.digest.total != expected.total:
        raise WeightSyncError(f"weight sync v{version}: what the engine holds ({report.held}) is not what the "
                              f"trainer sent: {'; '.join(expected.differences(report.digest))}")


@functools.cache
def _warn_card_held_form() -> None:
    log.warning("weight sync: the adapter's held form computed on the card differs from the host's (vLLM's); "
                "each LoRA sync now computes it on the host too (slower, as exact)")


def check_probe_logprobs(logprobs: Any, step: int, where: str = "the engine's probe") -> None:
    """``NonFiniteError`` if any of ``logprobs`` (a sequence, numpy array or tensor of per-token
    log-probs) is NaN or inf; ``ValueError`` if it is empty (an empty probe proves nothing)."""
    if hasattr(logprobs, "detach"):
        logprobs = logprobs.detach().float().cpu().numpy()
    values = np.asarray(logprobs, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError(f"step {step}: {where} has no log-probs to check")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        shown = ", ".join(f"{i}: {values[i]}" for i in bad[:5])
        raise NonFiniteError(
            f"step {step}: {where} log-probs hold {bad.size} non-finite value(s) of {values.size} "
            f"(position: value {shown}{', ...' if bad.size > 5 else ''}); the engines' weights are broken "
            "(e.g. a wrong merge); refusing to roll out with them",
            step=step, what=["probe_logprobs"],
        )


# ----------------------------------------------------------------------------- the sync


class WeightSync:
    """The actor to the engines, verified (module doc). ``kind``: ``lora`` or ``merged``
    (``rollout.weight_sync``); ``bucket_mb``: the merged buckets' cap in MiB (``rollout.bucket_mb``);
    ``logprob_gap_factor`` and ``max_logprob_gap``: the probe's bound (``rollout.*``);
    ``adapter_folder``: where LoRA exports go (``outputs/<name>/.engine_adapters``: hidden, never
    published); ``keep_versions``: exported adapters kept (the engine may still read them);
    ``dtype``: the model's compute dtype (``model.dtype``), whose rounding floors the noise
    (``sync_probe.rounding_floor``); ``marked_check_every``: every how many syncs after the
    starting one the marked actor is served first (0: none; module doc, step 4)."""

    def __init__(self, *, kind: str, bucket_mb: float, logprob_gap_factor: float, max_logprob_gap: float,
                 adapter_folder: str | Path, keep_versions: int = 2, dtype: str = "float32",
                 marked_check_every: int = 1) -> None:
        if kind not in KINDS:
            raise ValueError(f"WeightSync: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 1:
            # the newest exported adapter is the one the engine serves: it must stay
            raise ValueError(f"WeightSync: keep_versions must be an int >= 1, got {keep_versions!r}")
        if isinstance(marked_check_every, bool) or not isinstance(marked_check_every, int) or marked_check_every < 0:
            raise ValueError(f"WeightSync: marked_check_every must be an int >= 0, got {marked_check_every!r}")
        self.kind = kind
        self.bucket_bytes = int(float(bucket_mb) * 2**20)
        self.logprob_gap_factor = float(logprob_gap_factor)
        self.max_logprob_gap = float(max_logprob_gap)
        self.adapter_folder = Path(adapter_folder)
        self.keep_versions = keep_versions
        self.dtype = dtype
        #: The version the engines serve (None before the first sync) and the last engine-side id.
        self.version: Optional[int] = None
        self.sync_id = 0
        self.last_gap: Optional[float] = None
        self.last_bound: Optional[float] = None
        #: The probe gap of this process's first sync: the engine's numerical noise (not saved:
        #: a resumed process measures its own engine).
        self.noise_gap: Optional[float] = None
        #: The proof that the engine applies what it is sent (``sync_probe``; not saved either:
        #: a resumed process proves its own engine with the starting check).
        self.movement = MovementCheck(kind, dtype)
        self.marked_check_every = marked_check_every
        #: The marked actor's perturbation scale, found at the starting check (``mark_shift``),
        #: and this process's syncs since it (neither saved: a resumed process starts anew).
        self.mark_scale: Optional[float] = None
        self.syncs_since_start = 0
        #: This sync's seconds by part (``sync_s/<part>``, module doc): where a sync's time goes.
        self.parts: dict[str, float] = {}
        #: The host memory LoRA exports are written from, kept for the run (``_export_buffers``).
        self._host_buffers: Any = None

    def sync(self, model, serving, version: int, device: Any = "cpu") -> dict[str, float]:
        """Serve ``model``'s actor as weights version ``version`` on ``serving.engine``, verified;
        returns the sync's metrics (module doc). ``device``: where the trainer's probe runs.
        Collective: every rank calls it."""
        self.sync_id += 1
        self.parts = {}
        engine = serving.engine
        woken = time.monotonic()
        # no rollout runs while weights move (the asynchronous layout's producer waits, or with
        # partial rollouts is interrupted: ``serving.engine_for_sync``)
        hold = getattr(serving, "engine_for_sync", None)
        with hold() if hold is not None else (getattr(serving, "engine_lock", None) or contextlib.nullcontext()):
            if getattr(serving, "asynchronous", False):
                dist_utils.barrier()  # every rank's producer is idle before the shared server changes
            engine.wake_up()  # slept through the update (colocated sleep mode); a no-op otherwise
            started = time.monotonic()
            _reset_peak()
            probe = serving.probe_token_ids()
            if self.movement.reference is None:  # this process's first sync: the starting check
                report, gap = self._prove_start(model, engine, probe, version, device)
            elif self._marked_check_due():
                report, gap = self._marked_round_trip(model, engine, probe, version, device, at_start=False)
            else:
                report = self._load(model, engine, version, device)
                reading = self._reading(model, probe, engine, version, device)
                gap = self._check_gap(reading, version)
                self.movement.served(reading)
                self.movement.check(reading)
            serving.weights_version = version  # published under the lock: the next rollout samples it
        self.version = version
        self.last_gap = gap
        metrics = {"rollout/logprob_gap": gap, "rollout/logprob_gap_bound": self.last_bound,
                   "timing_s/update_weights": time.monotonic() - started, "timing_s/wake": started - woken,
                   "rollout/sync_tensor_count": float(report.tensor_count), **self.movement.metrics(),
                   **{f"sync_s/{part}": seconds for part, seconds in self.parts.items()}}
        metrics.update(_peak_metrics(int(getattr(serving, "engine_allocated_bytes", 0) or 0)))
        return metrics

    def _load(self, model, engine, version: int, device: Any = "cpu"):
        """Export, load and check what the engine holds (steps 1-3 of the module doc, probe aside);
        ``device``: the trainer's, where the exported folder is read back and digested."""
        if self.kind == "lora":
            folder = self.adapter_folder / f"sync{self.sync_id}"
            with self._part("export"):
                sent = export_actor_adapter(model, folder, into=self._export_buffers(device),
                                            dtype=dtype_named(self.dtype))
                dist_utils.barrier()
            with self._part("folder_check"):
                check_folder(folder, sent, version, device)
            with self._part("engine_load"):
                report = engine.set_adapter(AdapterVersion(str(folder), version=self.sync_id))
            self._prune()
            with self._part("held_check"):
                check_held(sent, report, version, device=device)
            return report
        merged = MergedActor(model, self.bucket_bytes)
        with self._part("engine_load"):  # the merge and the stream, together
            report = engine.load_merged(merged, version=version)
        if not merged.finished:  # the engine's own digest would match what it did read
            raise WeightSyncError(f"weight sync v{version}: the engine stopped reading the merged weights after "
                                  f"{merged.tensor_count} tensors")
        check_held(merged.sent, report, version, sent_tensors=merged.tensor_count)
        return report

    def _reading(self, model, probe: list[int], engine, version: int, device: Any,
                 trainer: Optional[np.ndarray] = None) -> Reading:
        """The trainer's and the engine's log-probs of the probe sequence ``probe`` (the engine's
        checked finite: ``NonFiniteError``); ``trainer``: the trainer's, when already computed."""

        with self._part("engine_probe"):
            engine_lp = engine.prompt_logprobs(probe)
        check_probe_logprobs(engine_lp, version)
        with self._part("trainer_probe"):
            trainer_lp = _trainer_probe(model, probe, device) if trainer is None else trainer
        if len(engine_lp) != len(trainer_lp):
            raise WeightSyncError(f"weight sync: probe lengths differ ({len(engine_lp)} vs {len(trainer_lp)})")
        return Reading(version, trainer_lp, np.asarray(engine_lp, dtype=np.float64))

    def _check_gap(self, reading: Reading, version: int) -> float:
        """Max |trainer - engine| log-prob over the probe sequence, against a bound set from the
        measured noise: the gap of this process's first sync (weights verified by digest, so only
        numerics differ) times ``logprob_gap_factor``, never below ``NOISE_ULPS`` float32
        roundings of the probe's largest log-prob nor one rounding of it in the compute dtype
        (``sync_probe.rounding_floor``, per token) nor
        above ``max_logprob_gap``. The first sync itself is held to ``max_logprob_gap``."""
        gap = float(np.max(np.abs(reading.engine - reading.trainer)))
        gap, scale = dist_utils.all_reduce_max([gap, probe_scale(reading.trainer)])
        bound = self._bound(scale)
        self.last_bound = bound
        if not gap <= bound:
            why = ("rollout.max_logprob_gap" if self.noise_gap is None else
                   f"{self.logprob_gap_factor} x the first sync's gap {self.noise_gap:.3g}")
            raise WeightSyncError(
                f"weight sync v{version}: trainer and engine log-probs differ by {gap:.4g} on the probe sequence, "
                f"above the bound {bound:.3g} ({why}): the engine does not serve the trained weights; "
                f"refusing to roll out")
        if self.noise_gap is None:
            self.noise_gap = gap
        return gap

    def _prove_start(self, model, engine, probe: list[int], version: int, device: Any):
        """The starting check (``sync_probe`` module doc): from the base the engine serves before
        any load (when it is the trainer's base) to the actor (judged when that move is
        measurable: a starting adapter the engine ignores), to the marked actor and back to the
        actor, each load verified as any sync's. Returns the last load's report and probe gap."""
        from atlas_lightning.models.probe import marked_actor

        base = self._base_reading(model, probe, engine, version, device)
        self._load(model, engine, version, device)
        actor = self._reading(model, probe, engine, version, device)
        if base is not None:
            self.movement.start(base)
            what = "the actor adapter" if self.kind == "lora" else "the merged actor"
            self.movement.check(actor, f"{what} against the base", at_start=True, may_wait=True)
        self._check_gap(actor, version)
        if self.movement.reference is not actor:  # the move from the base did not decide: start here
            self.movement.start(actor)

        def marked_probe(shift: float) -> np.ndarray:
            with marked_actor(model, shift):
                return _trainer_probe(model, probe, device)

        self.mark_scale = mark_shift(marked_probe, actor.trainer, self.movement.noise)
        self.sync_id += 1
        return self._marked_round_trip(model, engine, probe, version, device, at_start=True, actor=actor.trainer)

    def _export_buffers(self, device: Any):
        """Host buffers for the LoRA exports, made at the first and kept (pinned where the trainer
        is on a card): fresh pageable memory, faulted in page by page, copied at about 0.8 GB/s
        on an H100, and a sync exports the adapter once, or twice with the marked check. Each
        export is written to its folder before the next overwrites them."""
        if self._host_buffers is None:
            from atlas_lightning.models.adapters import HostBuffers

            self._host_buffers = HostBuffers(pinned=str(device).startswith("cuda"))
        return self._host_buffers

    @contextlib.contextmanager
    def _part(self, name: str):
        """Add the block's seconds to this sync's part ``name`` (``parts``)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.monotonic() - started

    def _marked_check_due(self) -> bool:
        """Count this sync (one after the starting one) and say whether it serves the marked actor
        first: every ``marked_check_every``-th one does."""
        self.syncs_since_start += 1
        return self.marked_check_every > 0 and self.syncs_since_start % self.marked_check_every == 0

    def _marked_round_trip(self, model, engine, probe: list[int], version: int, device: Any, *, at_start: bool,
                           actor: Optional[np.ndarray] = None):
        """Serve the marked actor (scale ``mark_scale``, sync id ``sync_id``), then the actor (the
        next id), each load verified as any sync's, and judge both moves as known ones
        (``MovementCheck.check``'s ``loaded``). ``actor``: the trainer's probe of the actor, when
        already computed. Returns the actor load's report and probe gap."""
        from atlas_lightning.models.probe import marked_actor

        if actor is None:
            with self._part("trainer_probe"):
                actor = _trainer_probe(model, probe, device)
        with marked_actor(model, self.mark_scale):
            self._load(model, engine, version, device)
            marked = self._reading(model, probe, engine, version, device)
        self.movement.check(marked, f"the marked adapter (a seeded random lora_B perturbation of scale "
                                    f"{self.mark_scale:.3g})", at_start=at_start)
        self.sync_id += 1
        report = self._load(model, engine, version, device)
        again = self._reading(model, probe, engine, version, device, trainer=actor)
        self.movement.served(again)
        self.movement.check(again, "the actor served again after the marked adapter", at_start=at_start)
        return report, self._check_gap(again, version)

    def _base_reading(self, model, probe: list[int], engine, version: int, device: Any) -> Optional[Reading]:
        """The trainer's base (adapters off) and what the engine serves before this process's
        first load, when the two agree within ``max_logprob_gap`` (both read ``model.path``);
        None when the engine serves something else (a server attached with other weights) or
        nothing (a merged engine that dropped its weights in its sleep). Collective."""
        from atlas_lightning.models.probe import probe_logprobs

        try:
            engine_lp = engine.prompt_logprobs(probe)
        except EngineError:  # asleep without its weights: nothing to compare before the first load
            engine_lp = []
        trainer_lp = probe_logprobs(model, probe, device, base=True)  # every rank: an FSDP2 forward
        agree = len(engine_lp) == len(trainer_lp) and bool(np.all(np.isfinite(engine_lp)))
        reading = Reading(version, np.asarray(trainer_lp, dtype=np.float64), np.asarray(engine_lp, dtype=np.float64))
        gap = float(np.max(np.abs(reading.engine - reading.trainer))) if agree else math.inf
        return reading if dist_utils.all_reduce_max([gap])[0] <= self.max_logprob_gap else None

    def _bound(self, scale: float) -> float:
        """The probe's bound (see ``_check_gap``); ``scale``: the largest |log-prob| on the probe."""
        if self.noise_gap is None:
            return self.max_logprob_gap
        return min(self.max_logprob_gap, self.logprob_gap_factor * max(self.noise_gap, rounding_floor(scale, dtype=self.dtype)))

    def _prune(self) -> None:
        """Keep the newest ``keep_versions`` exported adapters (the engine may still read them)."""
        if not dist_utils.is_rank_zero():
            return
        for old in self.adapter_folder.glob("sync*"):
            try:
                if int(old.name[4:]) <= self.sync_id - self.keep_versions:
                    shutil.rmtree(old, ignore_errors=True)
            except ValueError:
                continue

    # -- resumable state ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": self.version, "sync_id": self.sync_id}

    def load_state_dict(self, state: dict) -> None:
        """``state`` as ``state_dict`` wrote it; an absent key reads as a fresh sync's."""
        self.version = state.get("version")
        self.sync_id = int(state.get("sync_id", 0))


def _trainer_probe(model, probe: list[int], device: Any) -> np.ndarray:
    """The trainer's per-token log-probs of ``probe`` (``models.probe.probe_logprobs``), float64."""
    from atlas_lightning.models.probe import probe_logprobs

    return np.asarray(probe_logprobs(model, probe, device), dtype=np.float64)


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
