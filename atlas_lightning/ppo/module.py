"""``PPOModule``: one RL step of PPO with verl's semantics, under Lightning's manual optimization.

Per RL step (one ``RolloutBatch`` of this rank's trajectories; README, "PPO"):

1. ``old_log_prob``: actor log-probs and entropy of every response token (no grad);
   ``values``: the critic's values; ``ref``: base log-probs (adapter off) when a KL is on.
   Forward-only passes pack sequences up to ``algorithm.forward_max_token_len_per_gpu``.
2. ``adv``: token rewards (minus ``kl_coef * KL`` when the KL is in the reward), GAE over
   response tokens skipping tool tokens, returns = advantages + values, advantages whitened
   over the whole batch on all ranks.
3. ``update_critic`` then ``update_actor`` (verl's order): ``ppo_epochs`` x mini-batches
   (``train_batch_size / ppo_mini_batch_size`` of them; mini-batch ``j`` is the ``j``-th
   contiguous chunk of every rank's trajectories, as verl splits each data-parallel shard)
   x micro-batches packed to ``algorithm.ppo_max_token_len_per_gpu`` tokens, the same number
   on every rank (FSDP collectives); losses normalised by the mini-batch's token count on all
   ranks (verl's ``token-mean`` with ``dp_size``), gradient clipping, one optimizer step per
   mini-batch. A non-finite gradient norm skips that optimizer step and is counted. The actor's
   loss is verl's vanilla one, or with ``algorithm.off_policy_loss=decoupled`` AReaL's
   decoupled one, the engine's log-probs (the records' ``response_logprobs``) standing for the
   behaviour policy (``algorithms/ppo.py``).
4. ``update_weights``: the updated actor reaches the engines, verified (``rollout/sync.py``,
   ``sync_weights``), at the end of the step and only when the step is finite. Lightning runs
   ``training_step`` to its end before any callback's ``on_train_batch_end`` (validation of
   step N runs there) and before it fetches the next batch (whose rollout samples these
   weights): the order is Lightning's, whatever the callbacks' order. The starting weights are
   synced in ``on_fit_start`` (``on_train_start`` for a resumed FSDP2 run: see there).

Non-finite values (entropy, log-probs, values, losses, gradient norms) are checked before
any optimizer step that depends on them; when one is found, the step's remaining optimizer
steps are not taken and the step output says ``finite: False`` with a diagnostic (the
NaN guard callback decides what happens next; checkpoints skip such steps).

Steps are RL steps: ``rl_step`` is the batch's 1-based step and is what every metric,
folder and file is named by. Lightning's ``trainer.global_step`` counts optimizer steps and
is never shown to users.

Output: a ``StepOutput`` (``ppo/step_output.py``), read by every callback. Its metrics are
computed by ``ppo/metrics.py``.

Measuring a phase (``phase_hook``): the step enters ``phase_hook(name, rl_step)`` (a context
manager) around each of its phases, in order ``old_log_prob``, ``values``, ``ref`` (when a KL is
on), ``adv``, ``update_critic``, ``update_actor`` (the updates only when they run), on every
rank; ``timing_s/<name>`` includes the hook. ``sync_weights`` enters ``phase_hook("update_weights",
version)`` around every weight sync (its seconds are the sync's own ``timing_s/update_weights``
and ``timing_s/wake``). The hook must not change what a phase computes: memory-check mode
(``run/memory_check.py``) measures each phase's peak memory through it.

Besides the step, the module holds its checkpoint contract: what Lightning's checkpoint keeps
(``on_save_checkpoint``: the RL step, skipped optimizer steps, the weight sync's version and
engine-side id, and every rank's random generator states, ``ppo/rng_state.py``), the adapters
as PEFT folders (``save_adapters``; ``snapshot_adapters`` for a checkpoint written in the
background), the rollback
(``restore_checkpoint``) and ``sync_weights``, which the step checkpoint and the NaN guard call.

What is sharded: with ``ModelParallelStrategy`` every decoder layer, the value head and the
root are FSDP2 units over the data-parallel mesh (``models/sharding.py``). What is saved:
the two adapters as PEFT folders and, in Lightning's checkpoint, only trainable tensors
(LoRA factors, value head) and optimizer states, never the frozen base.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig

from atlas_lightning import distributed as dist_utils
from atlas_lightning.algorithms import ppo
from atlas_lightning.algorithms.functional import masked_mean, masked_whiten
from atlas_lightning.algorithms.kl import apply_kl_penalty, kl_penalty
from atlas_lightning.ppo import micro_batches
from atlas_lightning.ppo.micro_batches import (MICRO_STEP_TOKENS, apply_tiers, layout_tokens, measured_step_tokens,
                                              replayed_share, work)
from atlas_lightning.models.packing import PackedBatch, pack_sequences
from atlas_lightning.ppo import optimizer_state, rng_state
from atlas_lightning.ppo.micro_timing import MicroTimer
from atlas_lightning.ppo.metrics import (BEHAVIOUR_METRICS, ROLE_METRICS, cost_metrics, data_metrics,
                                         mean_over_ranks, memory_metrics, per_trajectory, timed)
from atlas_lightning.ppo.step_output import StepOutput
from atlas_lightning.rollout.batch import RolloutBatch
from atlas_lightning.rollout.engines import trainer_allocator
from atlas_lightning.rollout.sync import WeightSync

#: ``phase_hook(name, rl_step)``: a context manager the step enters around each phase.
PhaseHook = Callable[[str, int], ContextManager[Any]]
#: ``checkpoint_layers_for(device, random_base)``: the recompute policy of each decoder layer that
#: ``model.checkpoint_layers=auto`` takes on ``device`` (``model.layer_recompute``'s values; None:
#: every layer checkpointed whole), for the base of ``model.path`` or of ``random_base``.
CheckpointLayersFor = Callable[[torch.device, Any], Optional[Sequence[str]]]


@dataclass
class StepTensors:
    """What the updates of one step read, for this rank's ``bs`` trajectories.

    ``seqs``: each trajectory's prompt + response token ids (CPU int64); ``prompts``: each
    prompt's length. The rest are ``(bs, width)`` tensors on the module's device, ``width``
    being the batch's longest response, zero past a trajectory's response: ``mask`` (1 on
    generated tokens), ``old_log_prob`` (actor, before the update), ``values`` (critic),
    ``returns``, ``advantages`` (whitened when ``algorithm.norm_adv``), ``ref_log_prob``
    (the base's; None when no KL is on) and ``rollout_log_prob`` (the engine's behaviour
    log-probs; None unless ``algorithm.off_policy_loss=decoupled``). ``response_tokens``: each
    trajectory's count of ``mask``, on the host (the updates' loss divisors need no wait on the card)."""

    seqs: list[torch.Tensor]
    prompts: list[int]
    mask: torch.Tensor
    old_log_prob: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor
    ref_log_prob: Optional[torch.Tensor]
    rollout_log_prob: Optional[torch.Tensor] = None
    response_tokens: Sequence[int] = ()

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


class PPOModule(L.LightningModule):
    """One RL step of PPO (module doc). ``phase_hook``: see "Measuring a phase" there."""

    def __init__(self, cfg: DictConfig, phase_hook: Optional[PhaseHook] = None,
                 resume_from: Optional[Path] = None,
                 checkpoint_layers_for: Optional[CheckpointLayersFor] = None) -> None:
        """``phase_hook``: see "Measuring a phase" in the module doc. ``resume_from``: the verified
        ``global_step_N`` folder Lightning will resume from (``run.facts.check_inputs``); its
        adapters are checked against the built model before Lightning loads the state
        (``_check_resume``). ``checkpoint_layers_for``: resolves ``model.checkpoint_layers=auto``
        for the training device as the model is about to be built (``run/recompute.py``); None
        leaves ``auto`` unresolved: every layer checkpointed (``models/actor_critic.py``)."""
        super().__init__()
        self.cfg = cfg
        self.checkpoint_layers_for = checkpoint_layers_for
        #: ``(tokens, replayed share)`` of auto's per-size plans (``configure_model``; empty: none).
        self.recompute_shares: list[tuple[int, float]] = []
        #: A micro-step's fixed cost in tokens of work, for the update's packer: the default until
        #: an update has measured its own (``micro_timing.MicroTimer.fixed_cost``).
        self.micro_step_tokens = float(MICRO_STEP_TOKENS)
        self.resume_from = Path(resume_from) if resume_from else None
        self.automatic_optimization = False
        # Checkpoints hold trainable tensors only; the frozen base comes from model.path.
        self.strict_loading = False
        self.model = None
        self.rl_step = 0
        #: The last RL step whose update and weight sync completed (what a fault's stop names).
        self.finished_step = 0
        self.skipped_optimizer_steps = {"actor": 0, "critic": 0}
        self.phase_hook = phase_hook
        #: Optimizer steps taken in the current RL step, by role (a non-finite step reports them).
        self.steps_applied = {"critic": 0, "actor": 0}
        #: The step's last phase: the actor to the engines (``sync_weights``). Not a submodule.
        self.weight_sync = weight_sync_of(cfg)
        #: A resumed run's generator states (``ppo/rng_state.py``), until ``on_train_start`` sets them.
        self._rng_to_restore: Optional[dict] = None

    # -- model and optimizers -------------------------------------------------------------

    #: A transformers config whose random weights replace ``model.path``'s (the device memory
    #: check's shapes); None: the folder's weights. Either way the one builder builds the model.
    random_base = None

    def configure_model(self) -> None:
        """Build the model on the card this rank trains on (``models/build.py``: placement, and
        why), then shard it. Under ``ModelParallelStrategy`` this hook runs with no device
        context: built as is, it would land on the host and every ``auto`` kernel would resolve
        as on a CPU; the strategy's ``root_device`` is the card (the CPU in CPU runs). A
        colocated engine that sleeps for updates sleeps through the build too (``plan``'s
        ``model_build`` phase sizes it); ``model.checkpoint_layers=auto`` is resolved then, the
        engine asleep (``_model_config``). One training rank runs the model unsharded, as the
        update benchmark measures it; several shard it with FSDP2 (``models/sharding.py``)."""
        if self.model is not None:
            return
        from atlas_lightning.models.build import build_actor_critic

        actor, critic = self._starting_adapters()
        device = self._trainer.strategy.root_device if self._trainer is not None else None
        datamodule = getattr(self._trainer, "datamodule", None)
        if device is not None and device.type == "cuda" and getattr(datamodule, "sleeps_for_update", False):
            # each rank reads the whole base onto its card before sharding: a colocated engine (built in
            # the data module's setup) gives way as in an update; the first weight sync wakes it
            datamodule.engine.sleep()
        self.model = build_actor_critic(self._model_config(device), seed=self.cfg.seed, actor_adapter=actor,
                                        critic_adapter=critic, device=device, random_base=self.random_base)
        # auto's plans of smaller micro-batches (run/recompute.py): each update micro-batch picks its own
        self.recompute_shares = apply_tiers(self.model, getattr(self.checkpoint_layers_for, "tiers", None) or [])
        if self.resume_from is not None:
            self._check_resume(self.resume_from)
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None and mesh["data_parallel"].size() > 1:
            from atlas_lightning.models.sharding import shard

            # one rank has nothing to share: FSDP2 would still copy each layer's weights into
            # gathered buffers, in the forward and again in the backward, every micro-step
            shard(self.model, mesh["data_parallel"])

    def _model_config(self, device: Optional[torch.device]) -> Any:
        """``cfg.model``, with ``checkpoint_layers=auto`` resolved for ``device`` by
        ``checkpoint_layers_for`` where there is one (a copy: the run's config keeps ``auto``, as
        written and saved). Collective where the resolver is (every rank takes one plan)."""
        model = self.cfg.model
        if model.checkpoint_layers != "auto" or self.checkpoint_layers_for is None or device is None:
            return model
        from omegaconf import OmegaConf

        resolved = OmegaConf.to_container(model, resolve=True)
        plan = self.checkpoint_layers_for(device, self.random_base)
        if plan is not None:  # the policies auto chose for the card, as model.layer_recompute says them
            resolved["checkpoint_layers"], resolved["layer_recompute"] = None, list(plan)
        return OmegaConf.create(resolved)

    def _check_resume(self, step_dir: Path) -> None:
        """The checkpoint's two adapters against this model (base identity and fingerprint, LoRA
        settings, adapted modules, shapes, finite weights, roles): Lightning's own load keeps
        matching tensors only (``strict_loading=False``) and would drop the rest in silence."""
        from atlas_lightning.config import ConfigError
        from atlas_lightning.models.adapters import AdapterError, check_adapter_fits, read_adapter_folder

        for role in ("actor", "critic"):
            try:
                data = read_adapter_folder(step_dir / role / "lora_adapter", role)
                check_adapter_fits(self.model, role, data)
            except (AdapterError, FileNotFoundError) as err:
                raise ConfigError(f"trainer.resume={step_dir}: cannot resume this run's model from it: {err}") from None

    def _starting_adapters(self) -> tuple[Optional[str], Optional[str]]:
        """(actor, critic) PEFT folders to start from: ``model.actor_adapter`` /
        ``critic_adapter``, else those of ``trainer.init_from`` (another run's ``global_step_N``;
        the critic only with ``trainer.init_critic``); each brings its own LoRA shape
        (``store/lora_shapes.py``, the one place this is resolved)."""
        from atlas_lightning.store.lora_shapes import starting_adapters

        folders = starting_adapters(self.cfg)
        return folders.get("actor"), folders.get("critic")

    def configure_optimizers(self):
        a = self.cfg.algorithm
        betas = tuple(a.betas)
        actor = torch.optim.AdamW(self.model.actor_parameters(), lr=a.actor_lr, betas=betas, weight_decay=a.weight_decay)
        critic = torch.optim.AdamW(self.model.critic_parameters(), lr=a.critic_lr, betas=betas, weight_decay=a.weight_decay)
        for optimizer in (actor, critic):  # the moments now, apart from any activation (optimizer_state.py)
            optimizer_state.allocate(optimizer)
        return [actor, critic]

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # tensors are built per micro-batch, on the device, as needed

    # -- checkpoint contents --------------------------------------------------------------

    def _trainable_keys(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        keep = self._trainable_keys()
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):
            for key in [k for k in state if k not in keep]:
                del state[key]
        checkpoint["atlas"] = {"rl_step": self.rl_step, "skipped_optimizer_steps": dict(self.skipped_optimizer_steps),
                               "weight_sync": self.weight_sync.state_dict()}
        checkpoint[rng_state.RNG_KEY] = rng_state.capture()  # every rank's, on rank 0 (collective)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """The state ``on_save_checkpoint`` kept; an absent key (an older checkpoint) reads as a
        fresh run's."""
        atlas = checkpoint.get("atlas", {})
        self.rl_step = self.finished_step = int(atlas.get("rl_step", 0))
        self.skipped_optimizer_steps.update(atlas.get("skipped_optimizer_steps", {}))
        self.weight_sync.load_state_dict(atlas.get("weight_sync", {}))
        # set as the first step starts (``on_train_start``): the starting weight sync comes between
        self._rng_to_restore = checkpoint.get(rng_state.RNG_KEY)
        # A checkpoint of its run's last step records the epoch's last batch: Lightning would end
        # the resumed fit at once. A resume with a larger trainer.total_steps trains on, as verl's.
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if isinstance(progress, dict) and self.rl_step < int(self.cfg.trainer.total_steps):
            progress["is_last_batch"] = False

    def save_adapters(self, step_dir: Path) -> None:
        """``step_dir/{actor,critic}/lora_adapter`` as PEFT folders. Collective; rank 0 writes."""
        from atlas_lightning.models.adapters import save_adapters

        save_adapters(self.model, step_dir)

    def snapshot_adapters(self, into: Any = None) -> Callable[[Path], None]:
        """Both adapters copied to the host now (collective under FSDP2), and the function that
        writes those copies as ``step_dir/{actor,critic}/lora_adapter`` later, from any thread
        (rank 0 writes; elsewhere it does nothing): the step checkpoint's adapters, written while
        the next step runs. ``into``: the step checkpoint's host buffers
        (``models/adapters.HostBuffers``), reused from its previous save, whose write has ended;
        None: new host tensors."""
        from functools import partial

        from atlas_lightning.models.adapters import copy_adapters, write_adapter_copies

        return partial(write_adapter_copies, copy_adapters(self.model, into=into))

    def restore_checkpoint(self, step_dir: Path) -> None:
        """Trainable tensors (LoRA factors, value head) and optimizer states from a complete
        ``global_step_M`` folder's Lightning state, in place (the NaN guard's rollback).
        Collective under FSDP2."""
        from atlas_lightning.store.checkpoints import lightning_state_path

        strategy = self.trainer.strategy
        checkpoint = strategy.load_checkpoint(lightning_state_path(step_dir))
        strategy.load_model_state_dict(checkpoint, strict=False)
        strategy.load_optimizer_state_dict(checkpoint)

    # -- the weights the engines serve ----------------------------------------------------

    def on_fit_start(self) -> None:
        """The starting weights (version ``rl_step``: 0, or the resumed step) reach the engine
        before anything samples from it. Lightning calls ``on_fit_start`` (every callback's, then
        this) after ``configure_model``, the strategy's setup and, where the strategy restores a
        checkpoint before its setup (one device), that restore; the datamodule built the engine
        before all of it, in ``setup``. Every ``on_train_start`` comes later: ``ValidationCallback``
        validates step 0 there on a fresh run, with these weights."""
        if not self._restored_after_fit_start():
            self.sync_weights(self.rl_step)

    def on_train_start(self) -> None:
        """A run resumed under a strategy that restores the checkpoint after ``on_fit_start``
        (FSDP2's ``ModelParallelStrategy``: ``restore_checkpoint_after_setup``) serves the
        restored weights here. Lightning calls every callback's ``on_train_start`` before this
        one, but none samples on a resumed run (validation before training is a fresh run's),
        and the first batch is fetched after it (the train dataloader is sized, so Lightning
        fetches nothing ahead). Then the generators the updates draw from: a resumed run's saved
        states, a fresh run's rank seed (``ppo/rng_state.py``)."""
        if self._restored_after_fit_start():
            self.sync_weights(self.rl_step)
        # last before the first batch: a resumed run draws on from where the checkpointed one was
        # after its step (its sync came before it saved; this run's starting sync, above or in
        # on_fit_start, is one the uninterrupted run never made); a fresh one from its rank's seed
        if self._rng_to_restore is not None:
            rng_state.restore(self._rng_to_restore)
            self._rng_to_restore = None
        else:
            rng_state.seed_training(self.cfg.seed, self.global_rank)

    def _restored_after_fit_start(self) -> bool:
        return self.resume_from is not None and bool(self.trainer.strategy.restore_checkpoint_after_setup)

    def sync_weights(self, version: int, log_step: Optional[int] = None) -> dict[str, float]:
        """Serve the actor as weights version ``version`` on the datamodule's engine, verified
        (``rollout/sync.py``), and log the sync's metrics at RL step ``log_step`` (default
        ``version``); returns them. Called by the step (its last phase), ``on_fit_start``, the NaN
        guard's rollback (version M, logged at the bad step) and the ``validate`` verb. A
        datamodule without an engine (memory check's synthetic steps, a test's fixed batches) has
        nothing to serve: ``{}``. Collective."""
        datamodule = self.trainer.datamodule
        if getattr(datamodule, "engine", None) is None:
            return {}
        # outside any autocast of the step's precision plugin (Lightning enters it around
        # training_step): every sync merges and probes alike, wherever it is called from
        with self._hooked("update_weights", version), torch.autocast(self.device.type, enabled=False):
            metrics = self.weight_sync.sync(self.model, datamodule, version=version, device=self.device)
        self.log_metrics(metrics, step=version if log_step is None else log_step)
        return metrics

    # -- logging --------------------------------------------------------------------------

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Send ``metrics`` to every logger at RL step ``step`` (rank 0 only)."""
        if self.trainer is None or self.trainer.global_rank != 0:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}
        for logger in self.trainer.loggers:
            logger.log_metrics(clean, step=step)

    # -- packing --------------------------------------------------------------------------

    def _sequences(self, batch: RolloutBatch) -> tuple[list[torch.Tensor], list[int]]:
        seqs, prompts = [], []
        for record in batch.records:
            ids = np.concatenate([record.prompt_ids, record.response_ids]).astype(np.int64)
            seqs.append(torch.from_numpy(ids))
            prompts.append(len(record.prompt_ids))
        return seqs, prompts

    def _pack(self, seqs, prompts, indices, width: int) -> PackedBatch:
        return pack_sequences([seqs[i] for i in indices], [prompts[i] for i in indices], response_length=width).to(self.device)

    def _rows(self, indices: list[int]) -> torch.Tensor:
        """``indices`` on the module's device, queued without waiting for the card's earlier work."""
        return torch.as_tensor(indices, dtype=torch.long).to(self.device, non_blocking=self.device.type == "cuda")

    def _dummy_pack(self) -> PackedBatch:
        """A two-token sequence for a rank with an empty micro-batch (loss weight 0)."""
        return pack_sequences([torch.tensor([0, 0])], [1], response_length=1).to(self.device)

    def _plan(self, lengths: list[int], budget: int, update: bool = False) -> list[list[int]]:
        """This rank's micro-batches of sequence indices within ``budget`` tokens as the model's
        layout counts them (``micro_batches.count`` and ``cut``), as many as the rank needing most
        (collective: every rank must run the same number of passes under FSDP2). ``update``: where
        the model has per-size recompute plans, the count of least predicted work, else the fewest."""
        layout = self.model.sequence_layout
        shares = self.recompute_shares if update else ()
        local = micro_batches.count(lengths, budget, layout, shares, step_tokens=self.micro_step_tokens)
        agreed = int(max(dist_utils.all_reduce_max([local])[0], 1))
        if not lengths:
            return [[] for _ in range(agreed)]
        return micro_batches.cut(lengths, budget, layout, agreed)

    # -- forward-only passes --------------------------------------------------------------

    @torch.no_grad()
    def _forward_all(self, seqs, prompts, width: int, mode: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(bs, width)`` per-response-token outputs of ``mode`` (actor: log-probs and
        entropy; critic: values; base: log-probs), zero where there is no token."""
        bs = len(seqs)
        main = torch.zeros(bs, width, device=self.device)
        entropy = torch.zeros(bs, width, device=self.device) if mode == "actor" else None
        temperature = self.cfg.rollout.temperature
        for indices in self._plan([len(s) for s in seqs], self.cfg.algorithm.forward_max_token_len_per_gpu):
            packed = self._pack(seqs, prompts, indices, width) if indices else self._dummy_pack()
            if mode == "actor":
                lp, ent = self.model.actor_forward(packed, temperature=temperature, compute_entropy=True)
            elif mode == "critic":
                lp, ent = self.model.critic_forward(packed), None
            else:
                lp, ent = self.model.base_forward(packed, temperature=temperature), None
            if not indices:
                continue
            rows = self._rows(indices)[packed.response_row]
            main[rows, packed.response_col] = lp.float()
            if ent is not None:
                entropy[rows, packed.response_col] = ent.float()
        if self.device.type == "cuda" and not trainer_allocator.expandable():
            # the pass's activations leave cached segments, where the step's next lasting tensors
            # (the next pass's outputs, the advantages) would be carved and then hold them whole
            # through the update and the engine's wake (``optimizer_state.py``): returned first.
            # Expandable segments (the engine asleep) release free pages, so nothing to return.
            torch.cuda.empty_cache()
        return main, entropy

    # -- the RL step ----------------------------------------------------------------------

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> StepOutput:
        self.rl_step = batch.step
        cfg = self.cfg.algorithm
        timing = dict(batch.timing)
        memory: dict[str, float] = {}  # per-phase peaks on CUDA (``metrics.timed``)
        started = time.monotonic()
        nonfinite: dict[str, Any] = {}
        self.steps_applied = {"critic": 0, "actor": 0}
        self.model.train()

        seqs, prompts = self._sequences(batch)
        host_mask = batch.padded("response_mask")
        mask = host_mask.to(self.device)
        width = mask.shape[1]
        scores = batch.padded("token_rewards").to(self.device)

        with self._phase(timing, "old_log_prob", memory):
            old_log_prob, entropy = self._forward_all(seqs, prompts, width, "actor")
        with self._phase(timing, "values", memory):
            values, _ = self._forward_all(seqs, prompts, width, "critic")
        ref_log_prob = None
        if cfg.use_kl_loss or cfg.use_kl_in_reward:
            with self._phase(timing, "ref", memory):
                ref_log_prob, _ = self._forward_all(seqs, prompts, width, "base")
        _check_finite(nonfinite, batch, mask, old_log_prob=old_log_prob, entropy=entropy, values=values,
                      ref_log_prob=ref_log_prob)
        _agree_on_nonfinite(nonfinite, "forward")

        metrics: dict[str, float] = {}
        with self._phase(timing, "adv"):
            rewards, advantages, returns = self._advantages(scores, old_log_prob, ref_log_prob, values, mask, metrics)
        data = StepTensors(seqs=seqs, prompts=prompts, mask=mask, old_log_prob=old_log_prob, values=values,
                           returns=returns, advantages=advantages, ref_log_prob=ref_log_prob,
                           rollout_log_prob=batch.padded("response_logprobs").to(self.device)
                           if _decoupled(cfg) else None,
                           response_tokens=[int(n) for n in host_mask.sum(dim=1).tolist()])

        if not nonfinite:
            with self._phase(timing, "update_critic", memory):
                metrics.update(self._update("critic", data, nonfinite))
        if not nonfinite and self.rl_step > cfg.critic_warmup:
            with self._phase(timing, "update_actor", memory):
                metrics.update(self._update("actor", data, nonfinite))
        # asynchronous: the rollout overlapped the previous update; the step waited only this long
        timing["step"] = timing.get("wait_rollout", timing.get("rollout", timing.get("gen", 0.0))) \
            + time.monotonic() - started

        metrics.update(data_metrics(batch, mask=mask, values=values, returns=returns, advantages=advantages,
                                    old_log_prob=old_log_prob, scores=scores, rewards=rewards, entropy=entropy,
                                    timing=timing))
        metrics.update(memory_metrics(memory, batch.memory))
        metrics.update(cost_metrics(timing["step"], self.cfg.layout.gpus, self.cfg.trainer.gpu_hour_usd,
                                    metrics["perf/trajectories"],
                                    metrics.get("reward/cost_total")))
        if nonfinite:
            # the diagnostic says what this step already changed: the weights moved by these steps
            nonfinite["optimizer_steps_applied"] = dict(self.steps_applied)
        output = StepOutput(
            step=batch.step,
            batch=batch,
            tensors=per_trajectory(batch, values=values, returns=returns, advantages=advantages,
                                   old_log_probs=old_log_prob, token_rewards=rewards, ref_log_probs=ref_log_prob),
            metrics=metrics,
            finite=not nonfinite,
            nonfinite=nonfinite or None,
        )
        self.log_metrics(metrics, step=batch.step)
        if output.finite:  # a non-finite step ships nothing: the NaN guard decides (module doc, 4.)
            self.sync_weights(batch.step)
            self.finished_step = batch.step
        return output

    def _advantages(self, scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: Optional[torch.Tensor],
                    values: torch.Tensor, mask: torch.Tensor, metrics: dict) -> tuple[torch.Tensor, ...]:
        """``(rewards, advantages, returns)``, each ``(bs, width)``: the token rewards ``scores``
        less ``kl_coef`` x KL when the KL is in the reward (its metrics into ``metrics``), GAE's
        returns, and the advantages whitened over every rank's tokens when ``norm_adv``."""
        cfg = self.cfg.algorithm
        rewards = scores
        if cfg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(scores, old_log_prob, ref_log_prob, mask, cfg.kl_coef,
                                                   cfg.kl_penalty)
            metrics.update(kl_metrics)
        # whiten=False: the whitening is over every rank's tokens at once, here, not per rank
        _, returns = ppo.compute_gae_advantage_return(rewards, values, mask, cfg.gamma, cfg.lam, whiten=False)
        # The advantage as the returns carry it, returns - values: the form this step has always
        # whitened. GAE's own A differs from it by float32 rounding on some tokens (returns =
        # A + values is rounded); the recorded runs and figures were made with this form.
        advantages = returns - values
        if cfg.norm_adv:
            advantages = _global_whiten(advantages, mask)
        return rewards, advantages, returns

    @contextmanager
    def _phase(self, timing: dict, name: str, memory: Optional[dict] = None):
        """Time phase ``name`` into ``timing`` (and its CUDA memory peaks into ``memory``,
        ``metrics.timed``) and run it inside ``phase_hook`` (module doc). Running out of memory
        there raises on, the phase and step noted (``run/faults.py`` names them in its stop)."""
        try:
            with timed(timing, name, memory), self._hooked(name, self.rl_step):
                yield
        except torch.OutOfMemoryError as err:
            card = ""
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                total = torch.cuda.get_device_properties(self.device).total_memory
                card = f", the card's peak {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} of " \
                       f"{total / 2**30:.1f} GiB"
            err.add_note(f"in phase {name} of RL step {self.rl_step}{card}")
            raise

    def _hooked(self, name: str, step: int) -> ContextManager[Any]:
        """``phase_hook(name, step)`` (module doc), or nothing without a hook."""
        return self.phase_hook(name, step) if self.phase_hook is not None else nullcontext()

    def _update(self, role: str, data: StepTensors, nonfinite: dict) -> dict[str, float]:
        """``ppo_epochs`` x mini-batches x micro-batches of one role; metrics averaged verl's way
        (over micro-batches, then over ranks)."""
        cfg = self.cfg.algorithm
        optimizer = self.optimizers()[0 if role == "actor" else 1]
        params = self.model.actor_parameters() if role == "actor" else self.model.critic_parameters()
        world = dist_utils.world_size()
        num_mini = cfg.train_batch_size // cfg.ppo_mini_batch_size
        chunks = _contiguous_chunks(len(data.seqs), num_mini)
        history: dict[str, list[float]] = {}
        timer = MicroTimer(self.device, cfg.ppo_max_token_len_per_gpu)
        replays: dict[str, list[float]] = {}  # per micro-batch: what its recompute plan replays (tiers only)
        applied = self.steps_applied  # optimizer steps of this RL step, by role (training_step resets it)
        # each mini-batch's loss divisor (its response tokens over all ranks) and micro-batches, the
        # same in every epoch: computed once
        totals = dist_utils.all_reduce_sum([float(sum(data.response_tokens[i] for i in chunk)) for chunk in chunks])
        cuts = [self._plan([len(data.seqs[i]) for i in chunk], cfg.ppo_max_token_len_per_gpu, update=True)
                for chunk in chunks]
        for epoch in range(cfg.ppo_epochs):
            for mini_batch, (chunk, total_tokens, cut) in enumerate(zip(chunks, totals, cuts)):
                if total_tokens == 0:
                    continue
                optimizer.zero_grad(set_to_none=True)
                pending: dict[str, list[Any]] = {}  # this mini-batch's stats, on the card until its grad norm
                for local in cut:
                    stats = self._timed_micro_step(role, data, [chunk[i] for i in local], total_tokens, world,
                                                   timer, replays)
                    for key, value in stats.items():
                        pending.setdefault(key, []).append(value)
                grad_norm = _grad_norm(params, cfg.grad_clip)
                for key, values in _on_host(pending).items():
                    history.setdefault(key, []).extend(values)
                history.setdefault(f"{role}/grad_norm", []).append(grad_norm)
                losses = [x for key, vals in history.items() if key.endswith("_loss") for x in vals]
                local_bad = [name for name, bad in ((f"{role}/loss", not all(map(math.isfinite, losses))),
                                                    (f"{role}/grad_norm", not math.isfinite(grad_norm))) if bad]
                if local_bad:
                    nonfinite.setdefault("what", []).extend(local_bad)
                if _agree_on_nonfinite(nonfinite, f"update_{role}"):
                    self.skipped_optimizer_steps[role] += 1
                    optimizer.zero_grad(set_to_none=True)
                    # where it stopped, and what of this step was already applied (the weights moved)
                    nonfinite["stopped_at"] = {"role": role, "epoch": epoch, "mini_batch": mini_batch,
                                               "mini_batches_per_epoch": len(chunks), "epochs": cfg.ppo_epochs}
                    break
                optimizer.step()
                applied[role] += 1
            if "stopped_at" in nonfinite:
                break
        # the gradients were made among the activations: freed, their segments can go back to the
        # driver before a colocated engine wakes (optimizer_state.py)
        optimizer.zero_grad(set_to_none=True)
        keys = list(ROLE_METRICS[role]) + (["actor/kl_loss"] if role == "actor" and cfg.use_kl_loss else []) \
            + (list(BEHAVIOUR_METRICS) if role == "actor" and _decoupled(cfg) else [])
        out = mean_over_ranks({key: history.get(key, []) for key in keys})
        out.update(mean_over_ranks(timer.metrics(role)))
        if self.recompute_shares:  # the packer's micro-step cost, measured (micro_batches.py)
            self.micro_step_tokens = measured_step_tokens(timer.fixed_cost(), self.micro_step_tokens)
        if replays:
            out.update(mean_over_ranks(replays))
        out[f"{role}/skipped_steps"] = float(self.skipped_optimizer_steps[role])
        out[f"{role}/lr"] = cfg.actor_lr if role == "actor" else cfg.critic_lr
        return out

    def _timed_micro_step(self, role: str, data: StepTensors, indices: list[int], total_tokens: float, world: int,
                          timer: MicroTimer, replays: dict[str, list[float]]) -> dict[str, Any]:
        """``_micro_step`` under its recompute plan (``_recompute_for``; what it replays into
        ``replays``), timed by ``timer`` with its work (``micro_batches.work``)."""
        lengths = [len(data.seqs[i]) for i in indices]
        tokens = layout_tokens(lengths, self.model.sequence_layout)  # what the layers compute: padding counts
        chosen = self._recompute_for(tokens)
        share = 0.0
        if chosen is not None:
            policies, largest = chosen
            replays.setdefault(f"perf/{role}_layers_replayed", []).append(policies.count("layer"))
            replays.setdefault(f"perf/{role}_mixers_replayed", []).append(policies.count("mixer"))
            share = replayed_share(self.recompute_shares, largest)
        with timer.step(sum(lengths), work=work(tokens, share)):
            return self._micro_step(role, data, indices, total_tokens, world)

    def _recompute_for(self, tokens: int) -> Optional[tuple[list[str], int]]:
        """``(plan, largest)``: the recompute plan (``ActorCritic.use_recompute_for``) of this
        micro-batch of ``tokens`` (as the model's layout counts them), for ``largest``, the largest
        of the ranks' micro-batches: every rank replays the same layers (FSDP2's backward gathers
        follow the replays). Collective when the model has tiers; None (nothing done) otherwise."""
        if not self.model.recompute_tiers:
            return None
        largest = int(dist_utils.all_reduce_max([float(tokens)])[0])
        return self.model.use_recompute_for(largest), largest

    def _micro_step(self, role: str, data: StepTensors, indices: list[int], total_tokens: float,
                    world: int) -> dict[str, Any]:
        """One micro-batch (trajectories ``indices``) of ``role``: forward, loss, backward.
        ``total_tokens``: the mini-batch's response tokens over all ranks (the loss divisor).
        Returns its stats, floats or 0-d tensors still on the card (``_on_host`` reads them)."""
        cfg = self.cfg.algorithm
        if not indices:  # this rank has nothing here, but the FSDP collectives need it to take part
            packed = self._dummy_pack()
            out = self.model.actor_forward(packed, temperature=self.cfg.rollout.temperature, compute_entropy=False)[0] \
                if role == "actor" else self.model.critic_forward(packed)
            self.manual_backward(out.sum() * 0.0)
            return {}
        packed = self._pack(data.seqs, data.prompts, indices, data.width)
        rows = self._rows(indices)
        m = data.mask[rows]
        local_tokens = float(sum(data.response_tokens[i] for i in indices))
        agg = dict(loss_agg_mode=cfg.loss_agg_mode, dp_size=world, batch_num_tokens=total_tokens)
        if role == "critic":
            vpreds = packed.scatter_responses(self.model.critic_forward(packed))
            vf_loss, vf_clipfrac = ppo.compute_value_loss(vpreds, data.returns[rows], data.values[rows], m,
                                                          cfg.cliprange_value, **agg)
            self.manual_backward(vf_loss)
            # tensors, read on the host once per mini-batch (``_on_host``): the next micro-batch is
            # packed while the card still runs this backward
            return {"critic/vf_loss": vf_loss.detach() * (total_tokens / max(local_tokens, 1.0) / world),
                    "critic/vf_clipfrac": vf_clipfrac.detach(),
                    "critic/vpred_mean": masked_mean(vpreds.detach(), m)}
        log_probs, entropy = self.model.actor_forward(packed, temperature=self.cfg.rollout.temperature,
                                                      compute_entropy=cfg.entropy_coeff != 0)
        log_prob = packed.scatter_responses(log_probs)
        loss_args = dict(loss_agg_mode=cfg.loss_agg_mode, config=cfg,
                         global_batch_info={"dp_size": world, "batch_num_tokens": total_tokens})
        if data.rollout_log_prob is None:
            pg_loss, stats = ppo.compute_policy_loss_vanilla(data.old_log_prob[rows], log_prob, data.advantages[rows],
                                                             m, **loss_args)
        else:  # off-policy correction: the engine's log-probs are the behaviour policy
            pg_loss, stats = ppo.compute_policy_loss_decoupled(data.old_log_prob[rows], log_prob, data.advantages[rows],
                                                               m, data.rollout_log_prob[rows], **loss_args)
        loss = pg_loss
        if cfg.entropy_coeff != 0:
            ent = packed.scatter_responses(entropy)
            entropy_loss = ppo.agg_loss(ent, m, **agg)
            loss = loss - cfg.entropy_coeff * entropy_loss
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, data.ref_log_prob[rows], cfg.kl_loss_type)
            kl_loss = ppo.agg_loss(kld, m, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.detach()
        self.manual_backward(loss)
        scale = total_tokens / max(local_tokens, 1.0) / world  # back to this micro-batch's token mean
        stats["actor/pg_loss"] = pg_loss.detach() * scale
        if "actor/kl_loss" in stats:
            stats["actor/kl_loss"] *= scale
        return stats

    def validation_step(self, batch, batch_idx):
        """Nothing: validation rollouts run in ``ValidationCallback`` (the ``validate`` verb
        drives it from ``on_validation_start``); Lightning needs the hook to exist."""
        return None


# ----------------------------------------------------------------------------- helpers


def _decoupled(cfg: DictConfig) -> bool:
    """``algorithm.off_policy_loss=decoupled``: the policy loss corrects for the behaviour policy."""
    return cfg.get("off_policy_loss", "none") == "decoupled"


def _on_host(stats: dict[str, list[Any]]) -> dict[str, list[float]]:
    """``stats``' values as floats, the tensors among them read from the card in one transfer."""
    tensors = [v for values in stats.values() for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.float().reshape(()) for t in tensors]).tolist()) if tensors else iter(())
    return {key: [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
            for key, values in stats.items()}


def _contiguous_chunks(n: int, parts: int) -> list[list[int]]:
    """``parts`` contiguous chunks of ``range(n)`` (sizes differ by at most one; may be empty)."""
    base, extra = divmod(n, parts)
    chunks, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        chunks.append(list(range(start, start + size)))
        start += size
    return chunks


def _global_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``masked_whiten`` with mean and unbiased variance over every rank's tokens."""
    if not dist_utils.is_distributed():
        return masked_whiten(values, mask)
    m = mask.to(torch.float64)
    v = values.to(torch.float64)
    count, total = dist_utils.all_reduce_sum([float(m.sum()), float((v * m).sum())])
    if count < 2:
        raise ValueError("advantage whitening needs at least two response tokens in the batch")
    mean = total / count
    sq = dist_utils.all_reduce_sum([float((((v - mean) ** 2) * m).sum())])[0]
    var = sq / count * (count / (count - 1))
    return ((values - mean) / math.sqrt(var + 1e-8)).to(values.dtype)


def _grad_norm(params, max_norm: float) -> float:
    """Clip to ``max_norm`` and return the total norm before clipping (DTensor-aware)."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _check_finite(nonfinite: dict, batch: RolloutBatch, mask: torch.Tensor, **tensors) -> None:
    """Record which of ``tensors`` hold NaN/inf on response tokens, and in which trajectories."""
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        bad = (~torch.isfinite(tensor)) & mask.bool()
        if bad.any():
            rows = bad.any(dim=1).nonzero().flatten().tolist()
            nonfinite.setdefault("what", []).append(name)
            nonfinite.setdefault("phase", "forward")
            nonfinite.setdefault("where", {})[name] = {
                "count": int(bad.sum()),
                "trajectories": [f"{batch.records[i].uid}/{batch.records[i].session_id}" for i in rows[:50]],
            }


def _agree_on_nonfinite(nonfinite: dict, phase: str) -> bool:
    """True on every rank when any rank found a non-finite value (collective): all ranks must
    then skip the same optimizer steps, or their FSDP collectives would fall out of step."""
    anywhere = dist_utils.all_reduce_max([1.0 if nonfinite else 0.0])[0] > 0
    if anywhere and not nonfinite:
        nonfinite["what"] = ["(found on another rank)"]
    if anywhere:
        nonfinite.setdefault("phase", phase)
    return anywhere


def weight_sync_of(cfg: DictConfig) -> WeightSync:
    """The run's weight sync, from ``rollout.*`` and the run's folders (the exported adapters under
    ``paths.outputs/.engine_adapters``: hidden, never published)."""
    r = cfg.rollout
    return WeightSync(kind=r.weight_sync, bucket_mb=r.bucket_mb, logprob_gap_factor=r.logprob_gap_factor,
                      max_logprob_gap=r.max_logprob_gap, adapter_folder=Path(cfg.paths.outputs) / ".engine_adapters",
                      dtype=cfg.model.dtype, marked_check_every=r.marked_check_every)
