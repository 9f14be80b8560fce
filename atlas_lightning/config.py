"""The typed schema of every run's configuration, and its composition from ``conf/``.

Hydra composes the YAML groups under ``conf/`` (model, data, rollout, algorithm, trainer,
layout, reward, callbacks, logger, experiment); the result is merged onto the dataclasses
below, so an unknown key or a value of the wrong type fails before any work with the key's
full name (``model.lora.rnak``). Each value's rule (finite, range, choices, safe names) lives
in one table beside this schema (``constraints.py``); ``validate`` applies it, then the checks
that relate several keys.

The dataclasses are the only place a default lives: a group file under ``conf/`` holds only
what its choice changes (with the reason), an experiment file only its run's settings. Code
reads the composed config and restates no default (``planning`` included).

Who calls it: ``cli.py`` (every verb), tests (compose the real configs), launchers'
pre-flight. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from omegaconf import II, DictConfig, OmegaConf

from atlas_lightning.errors import InputError


class ConfigError(InputError):
    """A configuration that cannot run; the message names the key and what is wrong."""


# ----------------------------------------------------------------------------- groups


@dataclass
class PathsConfig:
    """Where everything goes. Every output lies under ``root`` (README, "On-disk layout"): the
    run's folders below are derived from ``root`` and ``name`` here, the one place each is
    defined; code and ``conf/callbacks/`` read these keys (``${paths.artifacts}``). Move a run
    by ``root``: ``publish`` sends ``root`` whole."""

    root: str = "."
    #: Built artefacts the embedded default needs (tiny model, sample data).
    cache: str = "${oc.env:ATLAS_LIGHTNING_CACHE,${oc.env:HOME}/.cache/atlas-lightning}"
    #: ``run.json``, the step records, the figures.
    artifacts: str = "${paths.root}/artifacts/${name}"
    #: ``global_step_N/`` (adapters, Lightning's state, ``val_dumps/``).
    checkpoints: str = "${paths.root}/checkpoints/${name}"
    #: The resolved config, ``main_ppo.log``, ``plan.json``, ``memory_check.json``.
    outputs: str = "${paths.root}/outputs/${name}"
    #: One log a launch (and the vLLM servers' logs), for every run under ``root``.
    logs: str = "${paths.root}/logs"
    #: W&B's run folders. W&B itself names the folder ``wandb`` (it is given the parent): keep the name.
    wandb: str = "${paths.root}/wandb"
    #: The W&B run export (``runs/<name>/<wandb id>/``).
    runs: str = "${paths.root}/runs/${name}"


@dataclass
class LoraConfig:
    rank: int = 64
    alpha: int = 128
    dropout: float = 0.0
    #: ``all-linear`` or an explicit list of module names.
    target_modules: Any = "all-linear"


@dataclass
class CriticLoraConfig:
    """The critic's LoRA when it starts fresh: a field left null is ``model.lora``'s (all are by
    default: the critic takes ``model.lora``; ``store.lora_shapes.fresh_lora_spec`` resolves it)."""

    rank: Optional[int] = None
    alpha: Optional[int] = None
    dropout: Optional[float] = None
    target_modules: Any = None


@dataclass
class ModelConfig:
    """The base model (frozen) and the two LoRA adapters on it. An adapter that starts from a
    PEFT folder (``actor_adapter``/``critic_adapter`` or ``trainer.init_from``) trains the LoRA
    shape that folder's ``adapter_config.json`` gives, whatever ``lora`` says
    (``store/lora_shapes.py``); ``lora`` and ``critic_lora`` shape the adapters that start fresh."""

    #: A local folder in Hugging Face layout (config.json, weights, tokenizer). Never a hub id:
    #: nothing is downloaded at run time.
    path: str = "${paths.cache}/tiny-model"
    #: The architecture ``path`` holds, by name (``planning/named_shapes.py``: ``qwen3_6_27b``,
    #: ``dense8b``, ...): ``plan`` sizes a run from it while ``path`` is not there yet.
    shape: Optional[str] = None
    dtype: str = "bfloat16"
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: The critic's LoRA when it starts fresh, e.g. ``model.critic_lora.rank=32`` or
    #: ``model.critic_lora={rank: 32, target_modules: [q_proj, v_proj]}``; a field left null is ``lora``'s.
    critic_lora: CriticLoraConfig = field(default_factory=CriticLoraConfig)
    gradient_checkpointing: bool = True
    #: Tokens a chunk when computing log-probs/entropy/values from hidden states, so that
    #: full-vocabulary logits never exist for a whole micro-batch.
    logprob_chunk_tokens: int = 4096
    #: The lm_head's output dtype, in the trainer and in every engine alike (vLLM's
    #: ``head_dtype``): ``model`` (logits in ``dtype``, rounded before the log-softmax, as verl
    #: computes them: the report's numerics) or ``float32`` (the bf16 product accumulated into
    #: float32 logits, never rounded: the trainer and the engine then no longer round logits of
    #: 20-40 to a grid of 0.125-0.25, which MiniMax-M1 and NeMo-RL found the largest part of
    #: their gap on trained models; ``models/logprobs.py``).
    head_dtype: str = "model"
    attn_implementation: str = "sdpa"
    #: ``packed`` (sequences concatenated, no padding; every layer kind sees the sequence
    #: boundaries), ``padded`` (right-padded rows) or ``auto`` (packed).
    sequence_layout: str = "auto"
    #: Gated DeltaNet (linear-attention) kernels of hybrid models (Qwen3.5/3.6): ``fla``
    #: (flash-linear-attention's Triton kernels, varlen over packed rows; CUDA only), ``torch``
    #: (transformers' reference code, run per sequence inside packed rows) or ``auto`` (``fla``
    #: where it imports and the model is on a GPU). The model and ``plan`` both report the choice.
    linear_attention_kernel: str = "auto"
    #: The decoder layers' memory-bound kernels (RMSNorms, the SwiGLU product, Qwen3's rotary):
    #: ``liger`` (liger-kernel's fused Triton kernels, extra ``liger``; CUDA only), ``torch``
    #: (PyTorch's ops) or ``auto`` (``liger`` where liger-kernel and Triton import and the model is
    #: on a GPU). Equal within bf16 rounding (``models/fused_kernels.py``); the model reports the choice.
    elementwise_kernels: str = "auto"
    #: ``attn_implementation=sdpa_varlen``: each sequence's attention length padded up to a
    #: multiple of this (exact by causality; 0: exact lengths). cuDNN's attention builds an
    #: execution graph per new length (~0.1 s on an H200); null: 1024 on CUDA, 0 elsewhere.
    attention_length_bucket: Optional[int] = None
    #: With gradient checkpointing, one recompute policy a decoder layer, finer than
    #: ``checkpoint_layers`` (which it overrides): ``layer`` (the whole layer), ``mixer`` (the
    #: attention or Gated DeltaNet alone), ``mlp`` (the MLP's gate and up projections) or ``none``
    #: (``models/recompute.py``); None: ``checkpoint_layers`` decides.
    layer_recompute: Optional[list[str]] = None
    #: Run each LoRA-wrapped linear as one fused autograd function in the compute dtype
    #: (``models/fused_lora.py``); False uses peft's own adapter path.
    fused_lora: bool = True
    #: With gradient checkpointing, checkpoint only the first k decoder layers (None: all), or
    #: ``auto``: one ``layer_recompute`` policy a layer, the least replayed work whose update at
    #: ``algorithm.ppo_max_token_len_per_gpu`` fits the card the model is built on, from the plan's
    #: prediction and the memory free there (``planning/recompute.py``; every layer on CPU).
    #: Recomputation never changes the numbers, only time and memory. ``fit`` logs the choice,
    #: ``plan`` prints it for ``plan.card_gib``.
    checkpoint_layers: Any = None
    #: Norms saving bf16 inputs, and MLP tails replayed in the layers kept out of checkpointing
    #: (``models/lean_activations.py``): about half a layer's saved activations.
    lean_activations: bool = True
    #: Starting adapters (PEFT folders), e.g. ``.../global_step_29/actor/lora_adapter``.
    actor_adapter: Optional[str] = None
    critic_adapter: Optional[str] = None


@dataclass
class DataConfig:
    """Question parquets (README, "Question data"): ``<root>/<benchmark>/<split>.parquet``."""

    root: str = "${paths.cache}/sample-data"
    benchmarks: list[str] = field(default_factory=lambda: ["gpqa", "lcb"])
    train_split: str = "train"
    val_split: str = "val_full"
    #: Our column name -> the file's column name, for files named differently.
    columns: dict[str, str] = field(default_factory=dict)
    #: Columns whose values split validation metrics (``gpqa/<value>/acc``).
    subset_columns: list[str] = field(default_factory=lambda: ["subset"])
    #: Cap on validation questions per benchmark (None: all of ``val_full``).
    val_max_questions: Optional[int] = None
    #: A GPQA row whose ``ground_truth`` contradicts a candidate's ``is_correct``: ``refuse`` (the
    #: loader names file, row and candidate) or ``keep`` (loaded as it is; README, "Question data").
    label_conflicts: str = "refuse"
    #: A question id in both the training split and the validation questions scored: ``refuse``
    #: (the loader names both files and rows) or ``allow`` (validation then scores questions the
    #: run trains on, as the files say; README, "Question data").
    split_overlap: str = "refuse"
    shuffle: bool = True
    seed: int = 0


@dataclass
class LoopLimits:
    """The ``rollout`` keys the agent loop obeys (``rollout/agent_loop.py``), defined here once:
    ``RolloutConfig`` extends it, so the keys are ``rollout.max_response_length`` and so on, and
    the loop takes this slice (``LoopLimits.of(cfg.rollout)``) rather than a copy of it."""

    #: Response tokens a trajectory (generated + tool responses).
    max_response_length: int = 8192
    #: Tokens one assistant turn may generate.
    max_tokens_per_turn: int = 2048
    max_model_len: int = 16384
    #: Requests in flight at one engine (vLLM's ``max_num_seqs``, up to 1,024). In the separate
    #: layout the training ranks share the one server: each keeps ``max_in_flight // ranks``
    #: (``rollout/engines/args.py``). The engine's tensor parallelism is ``layout.engine_tp``.
    max_in_flight: int = 640
    #: Seconds a request may take before it is resubmitted (with the same seed).
    request_timeout_s: float = 600.0
    #: Resubmissions of a request, and engine failures in a row, before the rollout fails.
    max_retries: int = 2

    @classmethod
    def of(cls, rollout: Any) -> "LoopLimits":
        """The loop's keys of ``rollout`` (``RolloutConfig`` or the composed ``cfg.rollout``)."""
        return cls(**{f.name: getattr(rollout, f.name) for f in fields(cls)})


@dataclass
class RolloutConfig(LoopLimits):
    """The engines and the agent loop (the loop's limits: ``LoopLimits``)."""

    #: ``vllm`` (in-process vllm.LLM), ``vllm-server`` (OpenAI-compatible server we start),
    #: ``hf`` (transformers reference engine, tests only), or the path of a class or factory
    #: of your own (``my_pkg.MyEngine``; ``rollout/factory.py`` says how it is called).
    engine: str = "vllm"
    n: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: Validation decoding (greedy by default).
    val_temperature: float = 0.0
    val_n: int = 1
    max_prompt_length: int = 2048
    max_turns: int = 9
    max_explores: int = 8
    gpu_memory_utilization: float = 0.6
    enable_sleep_mode: bool = True
    #: ``lora``: the adapter goes to the engines; ``merged``: merged into the base, in buckets.
    weight_sync: str = "lora"
    bucket_mb: int = 512
    #: Merged weights to a server (separate layout): the backend of vLLM's weight-transfer API,
    #: ``nccl`` (vLLM's own, GPUs) or ``gloo`` (``rollout/engines/gloo_transfer.py``, CPU); None: by device.
    weight_transfer: Optional[str] = None
    #: CPU engine's KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``).
    cpu_kvcache_gib: int = 1
    enforce_eager: bool = False
    #: vLLM's Gated DeltaNet prefill kernel for hybrid models (Qwen3.5/3.6; its engine argument
    #: ``gdn_prefill_backend``): ``triton`` (vLLM's Triton/FLA kernels), ``flashinfer``, ``cutedsl``
    #: (Blackwell), or ``auto``: ``triton`` on GPUs, nothing passed on CPU (vLLM's CPU kernel);
    #: ``rollout/engines/args.py`` says why. Attention-only models ignore it.
    gdn_prefill_backend: str = "auto"
    #: The dtype a hybrid's engine keeps each sequence's Gated DeltaNet state in between steps
    #: (vLLM's ``mamba_ssm_cache_dtype``): ``float32`` (the trainer's, which carries the state in
    #: float32 through a sequence), ``bfloat16``, ``float16``, or ``auto``: the checkpoint's own
    #: ``mamba_ssm_dtype`` (Qwen3.5/3.6 checkpoints say float32), else the model's dtype. GPU
    #: engines only (``rollout/engines/args.py`` says why); attention-only models ignore it.
    mamba_ssm_cache_dtype: str = "float32"
    #: Ceiling on the gap between trainer and engine log-probs on the probe (nats/token). The
    #: bound actually applied is ``logprob_gap_factor`` times the gap measured at the run's first
    #: sync (the engine's numerical noise, weights verified by digest), never above this ceiling.
    max_logprob_gap: float = 0.05
    logprob_gap_factor: float = 4.0
    #: Every this many weight syncs after the starting one, the sync serves the MARKED actor (the
    #: starting check's perturbation of every lora_B) just before the actor and proves that the
    #: engine moved to each: an engine serving anything but the version just sent is refused at
    #: that sync, whatever the learning rate (``rollout/sync_probe.py``, "The marked check"). One
    #: more load and probe per checked sync. 0: the starting check only; later syncs are then
    #: judged by the update's own movement, which at lr 1e-6 in bf16 decides nothing for many steps.
    marked_check_every: int = 1
    #: ``vllm-server`` only: attach to this running server (``http://host:port``) instead of
    #: starting one. It must serve ``model.path`` with the engine arguments ``VLLMServer`` uses,
    #: LoRA enabled and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; one engine only.
    server_url: Optional[str] = None
    #: ``vllm-server`` only: seconds a started server may take to answer ``/health``.
    server_start_timeout_s: float = 600.0


@dataclass
class AlgorithmConfig:
    """PPO with verl's semantics (README, "PPO")."""

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_coef: float = 0.001
    cliprange_value: float = 0.5
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    train_batch_size: int = 32
    ppo_mini_batch_size: int = 8
    ppo_epochs: int = 2
    #: Per-card token budget of a backward micro-batch (packed sequences).
    ppo_max_token_len_per_gpu: int = 49152
    #: Per-card token budget of forward-only passes (old/base log-probs, values).
    forward_max_token_len_per_gpu: int = 98304
    critic_warmup: int = 0
    #: Off-policy correction of the policy loss (``algorithms/ppo.py``): ``none`` (the trainer's
    #: old log-probs stand for the behaviour policy, as verl; synchronous runs need nothing else)
    #: or ``decoupled`` (AReaL's decoupled PPO loss: trust region around the trainer's old
    #: log-probs, each token weighted by old / the engine's log-prob, capped).
    off_policy_loss: str = "none"
    #: ``decoupled`` only: the cap on the behaviour importance weight, and what a weight above
    #: it becomes: ``truncate`` (the cap, verl's TIS) or ``mask`` (0, AReaL's filter).
    behav_imp_weight_cap: float = 5.0
    behav_imp_weight_mode: str = "truncate"


@dataclass
class RewardConfig:
    """The reward scorer (``reward/scorer.py``): ``_target_`` is its class or factory path, built
    with the other keys; lambda and the no-submit shaping are typed here, a scorer's own keys
    are added beside them (``+reward.my_key=...``)."""

    _target_: str = "atlas_lightning.reward.CostReward"
    #: lambda: reward points per dollar of each revealed candidate (``reward/breakdown.py``).
    cost_per_usd: float = 0.1
    #: Added to ``terminal_reward`` when the episode ends without a submit (default 0).
    no_submit_reward: float = 0.0


@dataclass
class TrainerConfig:
    total_steps: int = 40
    val_every: int = 5
    val_before_train: bool = True
    save_every: int = 5
    #: Dollars a card-hour, for the step's card cost beside its explores' (``cost/gpu_usd``;
    #: ``ppo/metrics.cost_metrics``): an on-demand H100/H200-class price; set your own.
    gpu_hour_usd: float = 2.5
    accelerator: str = "auto"
    #: Training processes on this node: the layout's training cards.
    devices: int = II("layout.train_gpus")
    num_nodes: int = 1
    #: Lightning's precision: ``32-true`` (or ``32``) only; the base's dtype is ``model.dtype`` (constraints.py).
    precision: str = "32-true"
    #: ``None``: fresh; a checkpoint folder; or ``auto`` (the run's latest complete step).
    resume: Optional[str] = None
    #: Start from another run's step: ``<root>/checkpoints/<name>/global_step_N`` (adapters only).
    init_from: Optional[str] = None
    init_critic: bool = True
    #: Memory-check mode (README, "Scale"): synthetic steps at the full token budget.
    memory_check: bool = False
    memory_check_steps: int = 2
    #: Memory-check mode: also build the engine and measure a burst of generation (colocated
    #: layouts with vLLM installed); false measures the update phases only.
    memory_check_generation: bool = True


@dataclass
class LayoutConfig:
    """Cards and engines (README, "The separate layout")."""

    #: ``colocated`` (engines sleep on the training cards) or ``separate``.
    mode: str = "colocated"
    gpus: int = 1
    train_gpus: int = 1
    serve_gpus: int = 0
    #: Tensor parallelism of each engine (vLLM's ``tensor_parallel_size``): colocated, the training
    #: cards form ``gpus / engine_tp`` engines; separate, the one server spans ``serve_gpus``.
    engine_tp: int = 1
    #: Bound on how many updates a rollout may lag behind (separate mode).
    max_staleness: int = 1
    #: What keeps a trajectory within ``max_staleness`` (separate mode, ``rollout/prefetch.py``):
    #: ``wait`` (the producer waits for new weights before sampling further ahead; nothing is
    #: dropped) or ``drop`` (it samples ahead without waiting, a bounded number of steps, and a
    #: trajectory over the bound is dropped at hand-over, counted in the step's metrics).
    staleness_policy: str = "wait"
    #: Partial rollouts (separate mode, ``rollout/interruption.py``): a weight sync interrupts the
    #: training rollout in flight, which keeps its tokens and continues under the new weights by
    #: re-prefill; false: a sync waits for the rollout, which is sampled with one version.
    partial_rollouts: bool = False
    #: Separate mode only: the server runs on the training cards instead of cards of its own,
    #: taking ``rollout.gpu_memory_utilization`` of each and leaving the trainer the rest
    #: (``layout=separate_one_card``: partial rollouts measured on one card); ``shared_card_refusals``.
    share_cards: bool = False


@dataclass
class LoggerConfig:
    project: str = "atlas-lightning"
    entity: Optional[str] = None
    #: ``auto``: online when W&B has a key (``WANDB_API_KEY`` or ``wandb login``'s) and
    #: ``WANDB_MODE`` does not say otherwise, else offline; ``online``, ``offline``; ``disabled`` turns W&B off.
    mode: str = "auto"
    tags: list[str] = field(default_factory=list)


@dataclass
class HubConfig:
    repo_id: Optional[str] = None
    repo_type: str = "dataset"
    private: bool = True
    endpoint: Optional[str] = None
    publish_checkpoints: bool = False
    #: The "Question." paragraph of the published README (``publish``; None: no such paragraph).
    description: Optional[str] = None


@dataclass
class PlanConfig:
    """What ``atlas-lightning plan`` (and pre-flight) assume about the machine."""

    #: Memory of one card in GiB (80: the report's A100 80GB); ``--card-gib`` overrides it.
    card_gib: float = 80.0


@dataclass
class RootConfig:
    name: str = "default"
    seed: int = 0
    paths: PathsConfig = field(default_factory=PathsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    #: name -> ``{_target_: class.path, ...kwargs}``; a user's own callbacks by class path.
    callbacks: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- checks

#: The package's engines by short name -> their factories; any other engine by its own path.
ENGINE_ALIASES = {
    "vllm": "atlas_lightning.rollout.factory.vllm_engine",
    "vllm-server": "atlas_lightning.rollout.factory.server_engine",
    "hf": "atlas_lightning.rollout.factory.hf_engine",
}


def validate(cfg: DictConfig) -> None:
    """Every value against its rule (``constraints.CONSTRAINTS``: finiteness, ranges, choices,
    safe names), the pieces chosen by path (engine, reward scorer), then the cross-field checks;
    raises ``ConfigError`` naming the key."""
    from atlas_lightning.constraints import check_values

    check_values(cfg, ConfigError)
    if cfg.rollout.engine not in ENGINE_ALIASES:
        _check_target("rollout.engine", cfg.rollout.engine, f"one of {', '.join(ENGINE_ALIASES)}",
                      called_as=ENGINE_CALL)
    _check_target("reward._target_", cfg.reward._target_)
    if cfg.rollout.engine == "hf" and (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0):  # it refuses each request
        raise ConfigError(f"rollout.engine=hf (the transformers reference engine) samples with neither top_p nor top_k: "
                          f"rollout.top_p={cfg.rollout.top_p} rollout.top_k={cfg.rollout.top_k}; use rollout.engine=vllm "
                          f"or rollout.top_p=1.0 rollout.top_k=-1")
    _check_gap_resolvable(cfg)
    if cfg.algorithm.train_batch_size % cfg.algorithm.ppo_mini_batch_size:
        raise ConfigError(
            f"algorithm.ppo_mini_batch_size={cfg.algorithm.ppo_mini_batch_size} must divide "
            f"algorithm.train_batch_size={cfg.algorithm.train_batch_size}"
        )
    if cfg.rollout.max_tokens_per_turn > cfg.rollout.max_response_length:
        raise ConfigError("rollout.max_tokens_per_turn must not exceed rollout.max_response_length")
    if cfg.rollout.max_prompt_length + cfg.rollout.max_response_length > cfg.rollout.max_model_len:
        raise ConfigError(
            f"rollout.max_prompt_length + rollout.max_response_length "
            f"({cfg.rollout.max_prompt_length} + {cfg.rollout.max_response_length}) exceeds "
            f"rollout.max_model_len={cfg.rollout.max_model_len}"
        )
    _validate_layout(cfg)
    _validate_shares(cfg)
    if cfg.rollout.weight_transfer is not None and not (cfg.layout.mode == "separate"
                                                         and cfg.rollout.weight_sync == "merged"):
        raise ConfigError(f"rollout.weight_transfer={cfg.rollout.weight_transfer} carries merged weights to the "
                          f"separate layout's server (layout.mode=separate rollout.weight_sync=merged); here "
                          f"(layout.mode={cfg.layout.mode}, rollout.weight_sync={cfg.rollout.weight_sync}) it would "
                          f"do nothing: leave it null")
    if cfg.hub.publish_checkpoints and not cfg.hub.repo_id:
        raise ConfigError("hub.publish_checkpoints=true needs hub.repo_id=<owner>/<name>")
    for name, spec in (cfg.callbacks or {}).items():
        retired = name == "weight_sync" or str((spec or {}).get("_target_", "")).endswith(".WeightSyncCallback")
        if spec is not None and retired:  # a config saved before the sync became the step's last phase
            raise ConfigError(f"callbacks.{name}: the weight sync is no longer a callback but a stage of the PPO "
                              f"step, run in every fit (ppo/module.py); remove callbacks.{name} from the config")
        if spec is not None and "_target_" not in spec:
            raise ConfigError(f"callbacks.{name} needs a _target_ (a class path)")
        if spec is not None:
            _check_target(f"callbacks.{name}._target_", spec._target_)


#: The relative resolution (machine epsilon) of each ``model.dtype``.
DTYPE_EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
#: The largest per-token probe gap a clean engine shows, in roundings (eps) of ``model.dtype``: with
#: the same weights on both sides, bf16 gaps of 0.06-0.11 (vLLM on CPU and on the H200) and up to
#: 0.077 (the hf engine, once the adapter acts), fp32 ones up to 1.9e-6: 10-16 eps in both dtypes.
CLEAN_GAP_ROUNDINGS = 16


def _check_gap_resolvable(cfg: DictConfig) -> None:
    """``rollout.max_logprob_gap`` (the weight sync's ceiling on the probe gap, nats a token) must
    admit what ``model.dtype``'s rounding alone makes a clean engine show (``CLEAN_GAP_ROUNDINGS``
    eps of the dtype: 0.125 in bf16). Below it, every engine that applies the weights it was sent
    is refused at some sync, after the run wrote its files: in bf16 the trainer's own probe cannot
    move by less than about 0.15 (over 299 tokens; a lora_B shift of 1e-6 already moves it that
    much, and 3e-7 not at all), so the starting check's mark, aimed from a float32-sized gap, is
    out of reach, and once the adapter acts the gap reaches 0.03-0.08 a token. The measured numbers
    decide, not the device: the GPU configs' bf16 runs set 1.0 (``conf/rollout/vllm_gpu.yaml`` says why)."""
    dtype, ceiling = cfg.model.dtype, cfg.rollout.max_logprob_gap
    floor = CLEAN_GAP_ROUNDINGS * DTYPE_EPS.get(dtype, 0.0)
    if ceiling < floor:
        raise ConfigError(
            f"model.dtype={dtype} with rollout.max_logprob_gap={ceiling}: {dtype} rounding alone makes a clean "
            f"engine's probe log-probs differ from the trainer's by up to {floor:.3g} a token ({CLEAN_GAP_ROUNDINGS} "
            f"x its eps), so the weight sync would refuse every engine; use model.dtype=float32 (CPU runs) or set "
            f"rollout.max_logprob_gap to {floor:.3g} or more (the GPU configs' bf16 runs use 1.0)")


#: How ``rollout/factory.build_engine`` calls an engine of the user's (a class or factory): a
#: positional config and these keywords.
ENGINE_CALL = ("cfg", "rank", "local_rank", "world_size")


def _check_target(key: str, path: Any, alternative: str = "", called_as: tuple[str, ...] = ()) -> None:
    """``path`` must be a dotted ``package.module.Name`` (or ``module.Class.method``) that
    resolves to an object: its module imports and has that attribute, so that a misspelt name
    is refused here, before anything is written, like a missing module; ``alternative``: what
    else the key may hold, for the message. ``called_as``: the call its user makes (a positional
    argument, then keywords: ``ENGINE_CALL``), which the object's signature must take (one
    Python cannot read is let through). Building the object is left to its user."""
    import importlib
    import importlib.util

    parts = str(path).split(".") if isinstance(path, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        what = f"neither {alternative} nor" if alternative else "not"
        raise ConfigError(f"{key}={path!r} is {what} a class or factory path (package.module.Name)")
    for cut in range(len(parts) - 1, max(len(parts) - 3, 0), -1):  # module.Name or module.Class.method
        module_name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except (ImportError, ValueError):
            continue
        try:
            target: Any = importlib.import_module(module_name)
        except Exception as err:  # the user's module fails to import: say so, with its error
            raise ConfigError(f"{key}={path!r}: importing {module_name} failed: {type(err).__name__}: {err}") from None
        for depth, attribute in enumerate(parts[cut:], start=cut):
            if not hasattr(target, attribute):
                raise ConfigError(f"{key}={path!r}: {'.'.join(parts[:depth])} has no {attribute!r}")
            target = getattr(target, attribute)
        if not callable(target):
            raise ConfigError(f"{key}={path!r} names a {type(target).__name__}, not a class or factory")
        if called_as:
            _check_call(key, path, target, called_as)
        return
    raise ConfigError(f"{key}={path!r}: no module {'.'.join(parts[:-1])} can be found (is its package installed "
                      f"or on PYTHONPATH?)")


def _check_call(key: str, path: Any, target: Any, called_as: tuple[str, ...]) -> None:
    """``target`` takes ``called_as[0]`` positionally and the rest as keywords, or ``ConfigError``."""
    import inspect

    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a readable signature: its call will tell
        return
    try:
        signature.bind(None, **{name: 0 for name in called_as[1:]})
    except TypeError as err:
        call = f"{called_as[0]}, " + ", ".join(f"{name}=" for name in called_as[1:])
        raise ConfigError(f"{key}={path!r} cannot be called as {path}({call}): {err}") from None


def _validate_layout(cfg: DictConfig) -> None:
    """Cards, training processes and engines must agree (memory is ``plan``'s business)."""
    layout, trainer = cfg.layout, cfg.trainer
    processes = trainer.devices * trainer.num_nodes
    tp = layout.engine_tp
    if layout.mode == "colocated":
        if layout.train_gpus != layout.gpus:
            raise ConfigError(f"layout.train_gpus={layout.train_gpus} must equal layout.gpus={layout.gpus} "
                              f"in a colocated layout")
        if processes != layout.gpus:
            raise ConfigError(f"layout.gpus={layout.gpus} but trainer.devices x trainer.num_nodes = {processes}: "
                              f"a colocated layout trains on every card")
        if layout.gpus % tp:
            raise ConfigError(f"layout.engine_tp={tp} does not divide layout.gpus={layout.gpus}")
        _validate_colocated(cfg)
    else:
        problems = shared_card_refusals(cfg) if layout.share_cards else []
        if problems:
            raise ConfigError(problems[0])
        if not layout.share_cards and layout.train_gpus + layout.serve_gpus != layout.gpus:
            raise ConfigError(f"layout.train_gpus ({layout.train_gpus}) + layout.serve_gpus ({layout.serve_gpus}) "
                              f"must equal layout.gpus ({layout.gpus}) in a separate layout")
        if processes != layout.train_gpus:
            raise ConfigError(f"trainer.devices x trainer.num_nodes = {processes} but layout.train_gpus={layout.train_gpus}")
        if layout.serve_gpus <= 0:
            raise ConfigError(f"layout.mode=separate with layout.serve_gpus={layout.serve_gpus}: a separate layout "
                              f"serves on cards of its own (e.g. layout=separate_cpu, or layout.gpus=2 "
                              f"layout.train_gpus=1 layout.serve_gpus=1); one card: layout.mode=colocated, or "
                              f"layout=separate_one_card (the server shares it)")
        if layout.serve_gpus % tp:
            raise ConfigError(f"layout.engine_tp={tp} does not divide layout.serve_gpus={layout.serve_gpus}")


def shared_card_refusals(cfg: Any) -> list[str]:
    """Why a separate layout with ``layout.share_cards=true`` cannot run (empty: it can). The
    server then runs on the training cards, all of them, on one machine: ``layout.gpus``,
    ``train_gpus`` and ``serve_gpus`` equal (``engine_tp`` dividing them, as in any separate
    layout), ``trainer.num_nodes=1``. Merged weights only by ``rollout.weight_transfer=gloo``,
    which stages each bucket through host memory on both sides (``rollout/engines/gloo_transfer.py``)."""
    layout, rollout = cfg.layout, cfg.rollout
    out = []
    if not layout.gpus == layout.train_gpus == layout.serve_gpus:
        out.append(f"layout.share_cards=true runs the server on the training cards: layout.gpus ({layout.gpus}), "
                   f"layout.train_gpus ({layout.train_gpus}) and layout.serve_gpus ({layout.serve_gpus}) must be "
                   f"equal (layout=separate_one_card: 1, 1, 1)")
    if int(cfg.trainer.num_nodes) != 1:
        out.append(f"layout.share_cards=true with trainer.num_nodes={cfg.trainer.num_nodes}: the server shares the "
                   f"cards of one machine; set trainer.num_nodes=1")
    if rollout.weight_sync == "merged" and rollout.weight_transfer != "gloo":
        out.append(f"rollout.weight_sync=merged with layout.share_cards=true and rollout.weight_transfer="
                   f"{rollout.weight_transfer}: NCCL (the GPU default) refuses two ranks on one card, and vLLM's "
                   f"ipc backend, the one for a shared card, is not wired here; set rollout.weight_sync=lora, or "
                   f"rollout.weight_transfer=gloo (each bucket through host memory)")
    return out


def _validate_shares(cfg: DictConfig) -> None:
    """Every training process gets one trajectory of a step at least (``RolloutDataModule``:
    engine ``g`` samples the ``g``-th share of the questions, ``rollout.n`` each, and the ranks of
    its TP group split its trajectories; in the separate layout each rank is a client of its
    own): a rank left without any fails in its update, the others waiting on it. (Validation
    takes a rank without a trajectory.)"""
    processes = cfg.trainer.devices * cfg.trainer.num_nodes
    tp = 1 if cfg.layout.mode == "separate" else cfg.layout.engine_tp
    engines = processes // tp
    questions, samples = cfg.algorithm.train_batch_size, cfg.rollout.n
    if (questions // engines) * samples < tp:
        raise ConfigError(f"algorithm.train_batch_size={questions} with rollout.n={samples}: the {processes} training "
                          f"processes ({engines} engine(s) of {tp}) would leave one without a trajectory (each engine "
                          f"samples its share of the questions, its processes split its trajectories); at least "
                          f"algorithm.train_batch_size={engines * -(-tp // samples)}, or fewer cards (layout.gpus, "
                          f"trainer.devices)")


def _validate_colocated(cfg: DictConfig) -> None:
    """Keys of the separate layout set in a colocated one, where they would do nothing, and the
    server engine's settings a colocated layout cannot run (``rollout/factory.server_engine``)."""
    layout, rollout = cfg.layout, cfg.rollout
    if layout.share_cards:
        raise ConfigError("layout.share_cards=true puts the separate layout's server on the training cards; a "
                          "colocated layout's engines are there already: set layout.share_cards=false or "
                          "layout.mode=separate")
    if layout.serve_gpus:
        raise ConfigError(f"layout.serve_gpus={layout.serve_gpus}: a colocated layout serves from its training cards; "
                          f"set layout.serve_gpus=0, or layout.mode=separate for cards that only serve")
    if layout.partial_rollouts:
        raise ConfigError("layout.partial_rollouts=true interrupts the separate layout's server requests at a weight "
                          "sync; a colocated layout never samples during an update: set layout.partial_rollouts=false "
                          "or layout.mode=separate")
    if layout.staleness_policy != "wait":
        raise ConfigError(f"layout.staleness_policy={layout.staleness_policy}: a colocated layout samples each rollout "
                          f"on the weights just trained, nothing is ever stale: set layout.staleness_policy=wait "
                          f"or layout.mode=separate")
    if rollout.engine == "vllm-server" and rollout.weight_sync != "lora":
        raise ConfigError(f"rollout.weight_sync={rollout.weight_sync} with rollout.engine=vllm-server in a colocated "
                          f"layout: merged weights reach a server in the separate layout (layout.mode=separate); "
                          f"here use rollout.weight_sync=lora")
    if rollout.server_url and (rollout.engine != "vllm-server" or layout.gpus // layout.engine_tp > 1):
        raise ConfigError(f"rollout.server_url={rollout.server_url}: attaching to a running server is the vllm-server "
                          f"engine's, for one engine (rollout.engine={rollout.engine}, "
                          f"{layout.gpus // layout.engine_tp} engine(s) here: each swaps its own adapter)")
    if rollout.engine == "vllm-server" and layout.engine_tp > 1 and layout.gpus > 1:
        raise ConfigError(f"rollout.engine=vllm-server with layout.engine_tp={layout.engine_tp} over {layout.gpus} "
                          f"training processes: a server on cards of its own is the separate layout "
                          f"(layout.mode=separate); use layout.engine_tp=1 or rollout.engine=vllm")


# ----------------------------------------------------------------------------- composition


#: The schema's name in hydra's config store (``config.yaml`` lists it first among its defaults).
SCHEMA_NAME = "atlas_schema"


def config_dir() -> str:
    """The packaged ``conf/`` folder (works from a clone and from an installed wheel)."""
    return str(resources.files("atlas_lightning.conf"))


@functools.cache
def _schema() -> DictConfig:
    """The typed schema, made once a process (a quarter of a compose's time; the tests compose
    hundreds of times): stored in hydra's config store, where ``config.yaml``'s first default
    names it, so hydra composes onto it and every schema key can be overridden
    (``plan.card_gib=139``) although no group file states it; and returned for ``compose`` to
    merge onto. ``OmegaConf.merge`` copies its first argument: nothing writes this one."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RootConfig)
    schema = OmegaConf.structured(RootConfig)
    OmegaConf.set_struct(schema.reward, False)  # a scorer's own keys beside the typed ones
    return schema


def compose(overrides: list[str] | None = None, user_config_dir: str | None = None) -> DictConfig:
    """Compose ``config.yaml`` with ``overrides`` (hydra syntax), type-check and validate it.

    ``user_config_dir`` adds a user's own config folder to the search path: its groups
    (e.g. ``experiment/mine.yaml``) sit beside the packaged ones.
    Raises ``ConfigError`` naming the key on any unknown key or invalid value.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException
    from yaml import YAMLError

    overrides = list(overrides or [])
    _check_overrides(overrides)
    if user_config_dir:
        path = Path(user_config_dir).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"--config-dir {user_config_dir}: no such folder")
        # quoted in hydra's grammar: a folder name with parentheses, brackets, quotes or letters
        # beyond ASCII is no bare value there. In a quoted value hydra reads a backslash as itself
        # unless it comes before a quote or ends the value: only those are doubled.
        escaped = re.sub(r"(\\+)(?='|$)", r"\1\1", f"file://{path}").replace("'", "\\'")
        overrides.append(f"hydra.searchpath=['{escaped}']")
    schema = _schema()  # in hydra's config store too: config.yaml's first default
    GlobalHydra.instance().clear()
    cfg = None
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="atlas-lightning"):
            raw = hydra_compose(config_name="config", overrides=overrides)
        # merged as plain data: a key outside the schema (``+model.typo=1``, which hydra's ``+``
        # adds even to a typed node) fails here, naming it
        cfg = OmegaConf.merge(schema, OmegaConf.to_container(raw))
        if cfg.paths.root == ".":
            cfg.paths.root = os.getcwd()
        OmegaConf.resolve(cfg)
        _expand_home(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        where = _unresolved_key(cfg) if isinstance(err, InterpolationResolutionError) and cfg is not None else None
        raise ConfigError(f"{where}: {_explain(err)}" if where else _explain(err)) from None
    except YAMLError as err:  # a config file (packaged or --config-dir) that is not YAML; names file and line
        raise ConfigError("a config file is not valid YAML: " + " ".join(str(err).split())) from None
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


#: The keys that name a file or folder (``paths.*`` besides): a leading ``~`` in them is the home
#: folder, as a shell would read it (a quoted override, a YAML file), never a folder named ``~``.
PATH_KEYS = ("model.path", "model.actor_adapter", "model.critic_adapter", "data.root", "trainer.resume",
             "trainer.init_from")


def _expand_home(cfg: DictConfig) -> None:
    """``~`` and ``~user`` at the start of each of ``PATH_KEYS`` and ``paths.*`` expanded."""
    for key in (*PATH_KEYS, *(f"paths.{name}" for name in cfg.paths)):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and value.startswith("~"):
            OmegaConf.update(cfg, key, os.path.expanduser(value))


def _check_overrides(overrides: list[str]) -> None:
    """Each override parses in hydra's grammar, and names no key that cannot work here, before
    anything is composed: a parse error is named with its override and key (hydra's parser
    message names neither); a ``hydra.*`` key is refused (hydra's own run settings are not
    used: outputs go under ``paths.root``); a key in verl's spelling is answered with ours
    (``verl_keys.py``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from atlas_lightning.verl_keys import ours_for

    parser = OverridesParser.create()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~") if "=" in override else override
        try:
            parser.parse_override(override)
        except HydraException as err:
            reason = " ".join(str(err).split()).replace("See https://hydra.cc/docs/1.2/advanced/override_grammar/basic "
                                                         "for details", "").strip()
            hint = (" (quote a value with special characters: key='value')" if "=" in override
                    else " (an override is key=value)")
            raise ConfigError(f"override {override!r} (key {key}): hydra cannot parse it: {reason}{hint}") from None
        if key == "hydra" or key.startswith("hydra."):
            raise ConfigError(f"override {override!r}: hydra's own settings are not used here (no working-directory "
                              f"change, no sweeps): the run writes under paths.root (outputs/<name>, checkpoints/<name>, "
                              f"...); set paths.root and name instead")
        ours = ours_for(key)
        if ours is not None:
            raise ConfigError(f"override {override!r}: {key} is verl's key; here it is {ours} (README, \"From verl: "
                              f"the report's runs in verl's keys\")")


def _unresolved_key(node: Any, prefix: str = "") -> Optional[str]:
    """``key=${...}`` of the first value under ``node`` whose interpolation does not resolve
    (OmegaConf's message names the missing reference, not the key that holds it)."""
    from omegaconf import ListConfig

    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        full = f"{prefix}.{key}" if prefix and isinstance(node, DictConfig) else (
            f"{prefix}[{key}]" if prefix else str(key))
        if OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except Exception:
                return f"{full}={node._get_node(key)._value()}"
        else:
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                found = _unresolved_key(child, full)
                if found:
                    return found
    return None


def _explain(err: Exception) -> str:
    """Hydra's and OmegaConf's message, without their internals; names the full key. Where
    hydra's message wraps OmegaConf's (an override it could not merge), OmegaConf's says why.
    Where hydra raises its own while composing a file (a bad key in an experiment or group file,
    packaged or ``--config-dir``: "In 'experiment/mine': ..."), OmegaConf's error is its context,
    not its cause: its full dotted key (``trainer.max_step``) is named, with hydra's file."""
    from omegaconf.errors import OmegaConfBaseException

    while isinstance(err.__cause__, OmegaConfBaseException):
        err = err.__cause__
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(("object_type", "full_key", "reference_type"))]
    full_key, inner = None, err
    while inner is not None and not full_key:
        full_key, inner = getattr(inner, "full_key", None), inner.__cause__ or inner.__context__
    text = " ".join(kept) or type(err).__name__
    if full_key and full_key not in text:
        text = f"{full_key}: {text}"
    if "is not in struct" in text:  # hydra merges a dict override into the dict, which takes no new key
        text += " (a key the dict does not have yet is added with +: +<key>={...} or +<key>.<name>=<value>)"
    # a group option that is not there: hydra appends its search path, which names no choice of the user's
    text = text.split(" Config search path:", 1)[0]
    if "Could not find '" in text:
        text += (" (your own group files: --config-dir DIR holding DIR/<group>/<option>.yaml, e.g. "
                 "DIR/experiment/mine.yaml for experiment=mine)")
    return text


#: What stands in a written config for a credential.
REDACTED = "***"
#: The last ``_``-separated words of a key that holds a credential (``hf_token``, ``api_key``,
#: ``client_secret``, ``password``, ``key``): a token budget (``max_token_len_per_gpu``) ends otherwise.
_CREDENTIAL_ENDINGS = ("token", "secret", "password", "passwd", "api_key", "apikey", "access_key", "secret_key",
                       "credentials", "credential", "auth", "key")
#: Words that mark a credential wherever they stand in a key (``auth_header``, ``Authorization``,
#: ``client_secret_path``): no setting of the schema holds one.
_CREDENTIAL_WORDS = frozenset({"auth", "authorization", "bearer", "cookie", "credential", "credentials", "passwd",
                               "password", "secret"})
#: A URL's password (``scheme://user:password@host``).
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+(?P<tail>@)")
#: Credentials recognisable by their form: an HTTP bearer token, a Hugging Face token.
_CREDENTIAL_TEXT = re.compile(r"(?i)(?<=\bbearer )\S+|\bhf_[A-Za-z0-9]{20,}")


def is_credential_key(key: str) -> bool:
    """Whether config key ``key`` (its last dotted part; ``camelCase`` read as ``camel_case``)
    names a credential: its last words are one of ``_CREDENTIAL_ENDINGS``, or one of its words
    is one of ``_CREDENTIAL_WORDS``. Environment variables are read the same way (``HF_TOKEN``)."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(key).rsplit(".", 1)[-1]).lower().replace("-", "_")
    return (any(name == end or name.endswith("_" + end) for end in _CREDENTIAL_ENDINGS)
            or not _CREDENTIAL_WORDS.isdisjoint(name.split("_")))


def redacted_text(text: str, environ: Optional[Any] = None) -> str:
    """``text`` with every credential in it masked (``REDACTED``): a URL's password, a bearer
    token, a Hugging Face token, and the value of any credential the environment holds (a
    variable whose name ``is_credential_key``: ``HF_TOKEN``, ``WANDB_API_KEY``, ``OPENAI_API_KEY``).
    What the run's logs (``run/wiring.RunLogHandler``) and the Hub client's messages pass through."""
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if len(value) >= 8 and value in text and is_credential_key(name):
            text = text.replace(value, REDACTED)
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED + m.group("tail"), text)
    return _CREDENTIAL_TEXT.sub(REDACTED, text)


def redacted(cfg: Any) -> Any:
    """``cfg`` resolved to plain data with every credential masked (``REDACTED``): the value of a
    key that names one (``is_credential_key``: a scorer's ``+reward.api_key``, a header
    ``Authorization``) and, in any text, what ``redacted_text`` masks (a URL's password:
    ``hub.endpoint=https://user:pw@host``, a bearer or Hub token, a credential of the environment). What every file the run writes holds of its
    config (``config.yaml``, the W&B run config, the run export, ``run.json``): the run itself
    reads the real values from ``cfg``."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg

    def mask(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: (REDACTED if is_credential_key(k) and v is not None else mask(v, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [mask(item, key) for item in node]
        if isinstance(node, str):
            return redacted_text(node)
        return node

    return mask(data)


def redacted_argv(argv: list[str]) -> list[str]:
    """A command line with every credential masked as ``redacted`` masks the config: the value
    of an override whose key names one (``+reward.api_key=...``) and what ``redacted_text`` masks."""
    out = []
    for arg in argv:
        key, sep, _ = str(arg).partition("=")
        if sep and is_credential_key(key.lstrip("+~")):
            out.append(f"{key}={REDACTED}")
        else:
            out.append(redacted_text(str(arg)))
    return out


#: The run's folders among ``paths``' keys (``PathsConfig``), ``root`` first.
RUN_FOLDERS = ("root", "artifacts", "checkpoints", "outputs", "logs", "wandb", "runs")


def run_dirs(cfg: DictConfig) -> dict[str, Path]:
    """The README's "On-disk layout" for this run: ``{key: Path}`` of ``paths``' folder keys
    (``RUN_FOLDERS``; ``PathsConfig`` defines each). Read once at start-up into the run's facts
    (``run/facts.py``)."""
    return {key: Path(cfg.paths[key]) for key in RUN_FOLDERS}
