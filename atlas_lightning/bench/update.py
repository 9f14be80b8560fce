"""The PPO update and forward-only passes, ours and the plain baseline, on the same inputs.

Ours (``OursRunner``): ``ActorCritic`` (one frozen base, ``actor``/``critic`` LoRA adapters,
fp32 value head), built by ``fit``'s own builder from ``fit``'s model config (random weights of
the benchmark's shape in place of a checkpoint), its recomputation ``model.checkpoint_layers=auto``
as ``fit`` resolves it (``fit_run_config``, ``fit_plan``: ``run/recompute.choose_for``) with the
plans of smaller micro-batches (``ActorCritic.enable_recompute_tiers``), over token-budget
micro-batches cut as ``PPOModule._plan`` cuts an update's, each micro-step exactly as
``PPOModule._timed_micro_step`` runs it (without a Lightning trainer): its plan
(``ActorCritic.use_recompute_for``), pack, ``critic_forward`` + ``ppo.compute_value_loss`` + backward, then
``actor_forward`` + ``ppo.compute_policy_loss_vanilla`` + backward, losses normalised by the
mini-batch's loss tokens. Packed layout: one ``(1, T)`` row per micro-batch (every layer kind,
the hybrid's Gated DeltaNet too: ``models/linear_attention.py``); the padded layout, on request:
``algorithms.partition.plan_padded_micro_batches`` under the same budget.

Baseline (``BaselineRunner``): the plain transformers + peft recipe: ``AutoModelForCausalLM``
shape with transformers' ``sdpa`` attention, ``get_peft_model`` with LoRA r64 all-linear
adapters ``actor`` and ``critic`` (peft's defaults: fp32 adapters, ``set_adapter`` to
switch), transformers' gradient checkpointing (non-reentrant) on every layer, right-padded
micro-batches of a fixed number of sequences (as many of the longest as fit the budget,
fewer if the full logits would not fit in memory), full-vocabulary logits ->
``log_softmax(float)`` -> gather for the actor; the decoder's last hidden state -> fp32
value head for the critic. Same PPO loss functions.

Who calls it: ``update_bench.py``, ``batch.py``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from atlas_lightning.algorithms import ppo
from atlas_lightning.models.packing import PackedBatch, pack_sequences
from atlas_lightning.ppo import micro_batches
from atlas_lightning.ppo.micro_batches import apply_tiers, layout_tokens

from .workload import PPOInputs

#: conf/algorithm/ppo.yaml's loss settings (the benchmark does not compose the run's config).
PPO_CONFIG = {
    "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean",
    "cliprange_value": 0.5,
}
TEMPERATURE = 1.0


def lora_spec(rank: int) -> dict:
    return {"rank": rank, "alpha": 2 * rank, "dropout": 0.0, "target_modules": "all-linear"}


#: The model config group ``fit`` trains the report's model with (``conf/model/``); the 8B step
#: benchmark's experiment (``h200-8b``) takes it too.
FIT_MODEL = "qwen3_6_27b"


def fit_model_config(rank: int, chunk_tokens: int, **keys: Any):
    """The model config ``fit`` runs (the schema ``config.ModelConfig`` with
    ``conf/model/<FIT_MODEL>.yaml`` over it: bf16, ``sdpa_varlen``, gradient checkpointing, fused
    LoRA, lean activations, ``auto`` kernels), with LoRA r``rank`` alpha ``2 rank`` on all
    linear layers, log-probs in chunks of ``chunk_tokens``, and ``keys``: any other ``model.*``
    key a benchmark varies (``layer_recompute``, ``elementwise_kernels``, ...)."""
    from omegaconf import OmegaConf

    from atlas_lightning.config import ModelConfig, config_dir

    group = OmegaConf.load(Path(config_dir()) / "model" / f"{FIT_MODEL}.yaml")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), group,
                           {"lora": lora_spec(rank), "logprob_chunk_tokens": chunk_tokens, **keys})


def fit_run_config(rank: int, chunk_tokens: int, budget: int, **keys: Any):
    """The run config ``fit`` would plan our path with: the schema ``config.RootConfig`` (every
    other setting at its default) with ``fit_model_config(rank, chunk_tokens, **keys)`` as
    ``model`` and ``checkpoint_layers=auto`` (no ``layer_recompute``), ``budget`` tokens as
    ``algorithm.ppo_max_token_len_per_gpu`` and ``forward_max_token_len_per_gpu``, one card."""
    from omegaconf import OmegaConf

    from atlas_lightning.config import RootConfig

    model = fit_model_config(rank, chunk_tokens, **keys, checkpoint_layers="auto", layer_recompute=None)
    return OmegaConf.merge(OmegaConf.structured(RootConfig), {
        "model": model,
        "algorithm": {"ppo_max_token_len_per_gpu": budget, "forward_max_token_len_per_gpu": budget},
        "trainer": {"devices": 1, "num_nodes": 1, "accelerator": "gpu"}})


def fit_plan(cfg, random_base, *, free: float, card: float) -> list:
    """``model.checkpoint_layers=auto``'s plans for the run ``cfg`` (``fit_run_config``) on the
    random base ``random_base`` (a transformers config) with ``free`` bytes of a ``card``-byte card:
    ``run/recompute.choose_for``, what ``fit``'s ``CheckpointLayersFor`` runs once it has measured
    the card. A list of ``RecomputeChoice``, the budget's first."""
    from atlas_lightning.run.recompute import choose_for, shape_of

    return choose_for(cfg, shape_of(cfg, random_base), free=free, card=card)


def fit_budget_plan(budgets, config_for: Callable[[int], Any], random_base, *, free: float,
                    card: float) -> tuple[int, list, list[dict]]:
    """The micro-batch budget a user's config would be planned at: the largest of ``budgets``
    whose budget plan fits (``fit_plan`` of ``config_for(budget)``), else the smallest (its plan
    every layer checkpointed, ``fits=False``). ``(budget, its plans, each budget tried)``."""
    tried, tiers, budget = [], [], 0
    for budget in sorted(budgets, reverse=True):
        tiers = fit_plan(config_for(budget), random_base, free=free, card=card)
        tried.append({"tokens": budget, "fits": tiers[0].fits, "need_gib": tiers[0].need / 2**30})
        if tiers[0].fits:
            break
    return budget, tiers, tried


def plan_record(tiers: list, **extra: Any) -> dict:
    """What the benchmark's JSON keeps of ``fit_plan``'s choice (``recompute_choice``, the batch's
    ``choice``): the budget's ``RecomputeChoice.to_dict`` (tokens, plan, counts, ``need_gib``: the
    predicted update peak, fits, room and free), its line, each micro-batch size's plan
    (``describe_tiers``; ``tier_plans``: tokens, counts, share replayed) and ``extra``."""
    from atlas_lightning.planning.recompute import describe_tiers
    from atlas_lightning.run.recompute import tier_shares

    choice = tiers[0]
    shares = tier_shares(tiers)
    return choice.to_dict() | {
        "line": choice.describe(), "tiers": describe_tiers(tiers) if shares else None,
        "tier_plans": [{"tokens": tokens, "counts": {p: plan.count(p) for p in dict.fromkeys(plan)},
                        "replayed_share": share} for tokens, plan, share in shares]} | extra


def _pack(inputs: PPOInputs, indices, device) -> PackedBatch:
    return pack_sequences(
        [inputs.sequences[i] for i in indices], [inputs.prompt_lengths[i] for i in indices], response_length=inputs.width
    ).to(device)


def _losses(role: str, inputs: PPOInputs, rows: torch.Tensor, packed: PackedBatch, per_token: torch.Tensor,
            total_tokens: float) -> torch.Tensor:
    m = inputs.response_mask[rows]
    agg = dict(loss_agg_mode=PPO_CONFIG["loss_agg_mode"], dp_size=1, batch_num_tokens=total_tokens)
    padded = packed.scatter_responses(per_token)
    if role == "critic":
        loss, _ = ppo.compute_value_loss(padded, inputs.returns[rows], inputs.values[rows], m,
                                         PPO_CONFIG["cliprange_value"], **agg)
        return loss
    loss, _ = ppo.compute_policy_loss_vanilla(
        inputs.old_log_prob[rows], padded, inputs.advantages[rows], m, loss_agg_mode=PPO_CONFIG["loss_agg_mode"],
        config=PPO_CONFIG, global_batch_info={"dp_size": 1, "batch_num_tokens": total_tokens})
    return loss


class OursRunner:
    """``ActorCritic`` micro-steps (module doc), the model built as ``fit`` builds it
    (``models.build.build_actor_critic``) from ``model_cfg`` (``fit_model_config``), with random
    weights of ``shape`` (a transformers config: ``shapes.transformers_config``) on ``device``.
    ``budget``: tokens a micro-batch may hold. ``tiers``: ``auto``'s plans of each micro-batch size
    (``(tokens, plan, share replayed)``: ``run/recompute.tier_shares``), given to the model as
    ``PPOModule.configure_model`` gives them; each update micro-step then runs under its own
    (``use_recompute_for``) and the update's micro-batches are cut as the module cuts them."""

    def __init__(self, model_cfg, shape, budget: int, *, device: torch.device, seed: int = 0,
                 tiers: Sequence[tuple[int, Sequence[str], float]] = ()) -> None:
        from atlas_lightning.models.build import build_actor_critic

        self.device = torch.device(device)
        self.model = build_actor_critic(model_cfg, seed=seed, device=self.device, random_base=shape)
        self.budget = budget
        #: a micro-step's fixed cost in tokens of work, as the update's packer takes it (``PPOModule``
        #: starts at ``MICRO_STEP_TOKENS`` and then takes its run's measured one)
        self.micro_step_tokens = float(micro_batches.MICRO_STEP_TOKENS)
        self.recompute_shares = apply_tiers(self.model, tiers)
        #: one ``(tokens, layers replayed whole, mixers replayed)`` an update micro-step under tiers
        self.replays: list[tuple[int, int, int]] = []
        # B starts at zero (a no-op adapter): give it values so the low-rank path is real work
        with torch.no_grad():
            for p in self.model.actor_parameters() + self.model.critic_parameters():
                if p.abs().max() == 0:
                    p.normal_(0.0, 1e-3)

    def micro_batches(self, inputs: PPOInputs, budget: Optional[int] = None, update: bool = False) -> list[list[int]]:
        """Token-budget micro-batches as ``PPOModule._plan`` cuts them on one card
        (``ppo/micro_batches.count`` and ``cut``); ``update``: under tiers, the count of least
        predicted work (at its starting micro-step cost)."""
        lengths = [int(s.numel()) for s in inputs.sequences]
        layout, budget = self.model.sequence_layout, budget or self.budget
        count = micro_batches.count(lengths, budget, layout, self.recompute_shares if update else (),
                                    step_tokens=self.micro_step_tokens)
        return micro_batches.cut(lengths, budget, layout, max(count, 1))

    def use_recompute_for(self, inputs: PPOInputs, indices: Sequence[int]) -> list[str]:
        """The model switched to the plan of the micro-batch ``indices`` (``ActorCritic.use_recompute_for``
        with its tokens as the model's layout counts them, as ``PPOModule._timed_micro_step`` does);
        what it replays is added to ``replays``."""
        tokens = layout_tokens([int(inputs.sequences[i].numel()) for i in indices], self.model.sequence_layout)
        plan = self.model.use_recompute_for(tokens)
        if self.model.recompute_tiers:
            self.replays.append((tokens, plan.count("layer"), plan.count("mixer")))
        return plan

    def take_replays(self) -> list[dict]:
        """Each distinct micro-step of ``replays`` since the last call (then emptied): its tokens
        and what its plan replays."""
        taken, self.replays = sorted(set(self.replays)), []
        return [{"tokens": tokens, "layers_replayed": layers, "mixers_replayed": mixers}
                for tokens, layers, mixers in taken]

    def train_pass(self, role: str, inputs: PPOInputs) -> None:
        total = float(inputs.response_mask.sum())
        for indices in self.micro_batches(inputs, update=True):
            self.use_recompute_for(inputs, indices)
            packed = _pack(inputs, indices, self.device)
            rows = torch.as_tensor(indices, device=self.device)
            if role == "critic":
                out = self.model.critic_forward(packed)
            else:
                out, _ = self.model.actor_forward(packed, temperature=TEMPERATURE, compute_entropy=False)
            _losses(role, inputs, rows, packed, out, total).backward()

    @torch.no_grad()
    def forward_pass(self, role: str, inputs: PPOInputs, budget: Optional[int] = None) -> None:
        for indices in self.micro_batches(inputs, budget):
            packed = _pack(inputs, indices, self.device)
            if role == "critic":
                self.model.critic_forward(packed)
            else:
                self.model.actor_forward(packed, temperature=TEMPERATURE, compute_entropy=True)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


class BaselineRunner:
    """Plain transformers + peft, padded (module doc)."""

    def __init__(self, base: nn.Module, rank: int, budget: int, *, logits_bytes_limit: Optional[float] = None,
                 reference_linear_attention: bool = True) -> None:
        from peft import LoraConfig, get_peft_model

        self.device = next(base.parameters()).device
        #: transformers' pure-torch Gated DeltaNet code even where flash-linear-attention imports
        #: (transformers would call fla's chunk kernel then): the baseline of runs 1-12.
        self.reference_linear_attention = reference_linear_attention
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = dict(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        self.peft_model = get_peft_model(base, LoraConfig(**config), adapter_name="actor")
        self.peft_model.add_adapter("critic", LoraConfig(**config))
        hidden = base.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32, device=self.device)
        self.vocab = base.config.vocab_size
        self.budget = budget
        self.logits_bytes_limit = logits_bytes_limit
        self.peft_model.train()
        with torch.no_grad():
            for name, p in self.peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 1e-3)

    def micro_batch_size(self, inputs: PPOInputs, budget: Optional[int] = None) -> int:
        longest = max(int(s.numel()) for s in inputs.sequences)
        size = max(1, (budget or self.budget) // longest)
        if self.logits_bytes_limit is not None:
            # bf16 logits + fp32 copy + fp32 log-softmax + its fp32 gradient: ~14 bytes an entry
            size = max(1, min(size, int(self.logits_bytes_limit // (14 * longest * self.vocab))))
        return size

    def micro_batches(self, inputs: PPOInputs, budget: Optional[int] = None) -> list[list[int]]:
        n, size = len(inputs.sequences), self.micro_batch_size(inputs, budget)
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]

    def kernels(self):
        """The context every pass (forward and backward, where checkpointing replays) runs in."""
        return reference_linear_attention(self.peft_model) if self.reference_linear_attention else nullcontext()

    def per_token(self, role: str, packed: PackedBatch) -> torch.Tensor:
        """Per-response-token log-probs (actor) or values (critic), packed order (inside ``kernels``)."""
        ids, mask, _, flat_index = packed.padded_layout()
        width = ids.shape[1]
        if role == "critic":
            self.peft_model.set_adapter("critic")
            hidden = self.peft_model.base_model.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            values = self.value_head(hidden.last_hidden_state.float()).squeeze(-1)
            return values.reshape(-1)[flat_index[packed.logit_index]]
        self.peft_model.set_adapter("actor")
        logits = self.peft_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        token_lp = log_probs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # position t scores token t + 1
        target = flat_index[packed.target_index]
        return token_lp.reshape(-1)[(target // width) * (width - 1) + target % width - 1]

    def train_pass(self, role: str, inputs: PPOInputs) -> None:
        total = float(inputs.response_mask.sum())
        with self.kernels():
            for indices in self.micro_batches(inputs):
                packed = _pack(inputs, indices, self.device)
                rows = torch.as_tensor(indices, device=self.device)
                _losses(role, inputs, rows, packed, self.per_token(role, packed), total).backward()

    @torch.no_grad()
    def forward_pass(self, role: str, inputs: PPOInputs, budget: Optional[int] = None) -> None:
        with self.kernels():
            for indices in self.micro_batches(inputs, budget):
                self.per_token(role, _pack(inputs, indices, self.device))

    def zero_grad(self) -> None:
        self.peft_model.zero_grad(set_to_none=True)
        self.value_head.zero_grad(set_to_none=True)


@contextmanager
def reference_linear_attention(model: nn.Module):
    """Inside: the Gated DeltaNet layers of ``model`` (if any) call transformers' pure-torch conv and
    delta rule (``models.linear_attention.reference_functions``), also in the backward's replays
    when they run inside. Module globals of transformers' modeling file, restored on exit."""
    import inspect

    from atlas_lightning.models.linear_attention import reference_functions

    found = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if not found:
        yield
        return
    modeling = inspect.getmodule(type(found[0]))
    conv, rule = reference_functions(found[0])
    saved = {"causal_conv1d_fn": modeling.causal_conv1d_fn, "torch_chunk_gated_delta_rule": modeling.torch_chunk_gated_delta_rule}
    modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule = conv, rule
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(modeling, name, value)


def update_fn(runner, inputs: PPOInputs, times: dict) -> Callable[[], None]:
    """One PPO update (critic pass then actor pass) recording each pass's seconds in ``times``."""
    from .measure import timed

    def step() -> None:
        runner.zero_grad()
        times.setdefault("critic", []).append(timed(runner.device, lambda: runner.train_pass("critic", inputs)))
        times.setdefault("actor", []).append(timed(runner.device, lambda: runner.train_pass("actor", inputs)))

    return step
