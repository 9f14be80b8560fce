"""What each config value may be: one declarative table beside the typed schema (``config.py``).

``CONSTRAINTS`` maps every numeric key of the schema (and every string or list whose value has
rules) to its rule; ``check_values`` applies them all and, first, refuses a non-finite number
anywhere in the config (``nan``/``inf`` in any group, list or callback argument). Each refusal
is a ``ConfigError`` naming the full key, the value and the rule:

    rollout.top_p=1.5: must be within (0, 1]

Rules here concern one value each; checks that relate several keys (a mini-batch dividing the
batch, cards and engines agreeing) stay in ``config.validate``. A test requires every numeric
field of the schema to have a rule here, so a new key cannot arrive unchecked.

Who calls it: ``config.validate`` (every verb, before any work). Nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from atlas_lightning.questions.rows import LABEL_CONFLICT_POLICIES
from atlas_lightning.questions.schema import BENCHMARKS, MAX_COST_USD

# ----------------------------------------------------------------------------- rule kinds


class Violation(ValueError):
    """A value breaks its rule; the text says how (``check_values`` adds the key)."""


@dataclass(frozen=True)
class Real:
    """A finite number (int or float) within ``low``..``high``; ``*_open`` excludes the bound."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    optional: bool = False

    def describe(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "a finite number"
        if self.high == math.inf:
            return f"a finite number {'>' if self.low_open else '>='} {self.low:g}"
        if self.low == -math.inf:
            return f"a finite number {'<' if self.high_open else '<='} {self.high:g}"
        return (f"within {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")

    def __call__(self, value: Any) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Violation(f"must be {self.describe()}, got {type(value).__name__}")
        if not math.isfinite(value):
            raise Violation("must be a finite number")
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if below or above:
            raise Violation(f"must be {self.describe()}")


#: The largest integer any config value may hold: counts and sizes reach ``len()``, torch and
#: numpy, which take 64-bit integers (a larger one fails deep inside a run, after it wrote files).
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Int(Real):
    """An integer within ``low``..``high`` (bounds inclusive), and within 64 bits."""

    def __call__(self, value: Any) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise Violation(f"must be an integer, got {type(value).__name__}")
        if abs(value) > INT64_MAX and self.high > INT64_MAX:
            raise Violation(f"must be {self.describe()} that fits in 64 bits (at most {INT64_MAX})")
        super().__call__(value)

    def describe(self) -> str:
        if self.high == math.inf:
            return f"an integer >= {self.low:g}"
        return f"an integer within {self.low:.0f}..{self.high:.0f}"


@dataclass(frozen=True)
class OneOf:
    """One of ``choices``; ``hint``, when given, follows the refusal (what to set instead)."""

    choices: tuple
    hint: str = ""

    def __call__(self, value: Any) -> None:
        if value not in self.choices:
            hint = f" ({self.hint})" if self.hint else ""
            raise Violation(f"is not one of {', '.join(map(str, self.choices))}{hint}")


@dataclass(frozen=True)
class Text:
    """A string matching ``pattern`` (whole), or None where ``optional``."""

    pattern: str
    meaning: str
    optional: bool = False

    def __call__(self, value: Any) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, str) or not re.fullmatch(self.pattern, value):
            raise Violation(f"must be {self.meaning}")


@dataclass(frozen=True)
class Items:
    """A list whose every item passes ``each``; ``length`` exact or ``min_length``; ``unique``."""

    each: Callable[[Any], None]
    length: Optional[int] = None
    min_length: int = 0
    unique: bool = False

    def __call__(self, value: Any) -> None:
        if not isinstance(value, (list, tuple)):
            raise Violation(f"must be a list, got {type(value).__name__}")
        if self.length is not None and len(value) != self.length:
            raise Violation(f"must hold exactly {self.length} values, got {len(value)}")
        if len(value) < self.min_length:
            raise Violation(f"must hold at least {self.min_length} value(s), got {len(value)}")
        if self.unique:
            repeated = sorted({str(v) for v in value if list(value).count(v) > 1})
            if repeated:
                raise Violation(f"lists {', '.join(repeated)} more than once")
        for index, item in enumerate(value):
            try:
                self.each(item)
            except Violation as err:
                raise Violation(f"item {index} ({item!r}) {err}") from None


@dataclass(frozen=True)
class Either:
    """Passes when any of ``rules`` does (``meaning`` says what is accepted)."""

    rules: tuple
    meaning: str

    def __call__(self, value: Any) -> None:
        for rule in self.rules:
            try:
                rule(value)
                return
            except Violation:
                continue
        raise Violation(f"must be {self.meaning}")


#: A name used as one folder or file name under ``paths.root``: no separator, no ``..``, no
#: leading dot or dash, printable ASCII only (it also names W&B runs and Hub paths).
SAFE_NAME = Text(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,127}",
                 "a single safe path component: letters, digits and . _ + = - (not starting with . or -), "
                 "at most 128 characters, no / or ..")
_MODULE_NAME = Text(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*", "a module name such as q_proj")
#: Not empty and not only spaces (the look-ahead), wherever a value names something: an empty
#: name is a slip (an unset shell variable in ``logger.project=$PROJECT``) that W&B or the loader
#: would take as "no name" and fill in silently, or fail on far from the key.
_SOME_TEXT = r"(?=.*\S)"
#: A name a service or a reader sees (a W&B project or entity, a tag): printable, not blank.
_NAME = Text(_SOME_TEXT + r"[^\x00-\x1f\x7f]+", "a name (not empty, not only spaces, no control characters)")
_COLUMN = Text(_SOME_TEXT + r"[^\x00-\x1f]+", "a column name (not empty, not only spaces)")
_SEED = Int(0, 2**32 - 1)
#: A file or folder: an empty (or blank) value would read as the working directory (or a folder
#: named by spaces in it).
_PATH_TEXT = r"(?s)" + _SOME_TEXT + r"[^\x00]+"
_PATH = Text(_PATH_TEXT, "a path (not empty)")
_OPTIONAL_PATH = Text(_PATH_TEXT, "null or a path (not empty)", optional=True)

#: Costs reach the reward as ``-cost_per_usd * cost_usd`` per explore (at most 64 explores):
#: these bounds keep every reward finite in float32, the dtype PPO receives.
MAX_COST_PER_USD = 1e6
MAX_SHAPING = 1e6

# ----------------------------------------------------------------------------- the table

CONSTRAINTS: dict[str, Callable[[Any], None]] = {
    "name": SAFE_NAME,
    "seed": _SEED,
    **{f"paths.{key}": _PATH for key in ("root", "cache", "artifacts", "checkpoints", "outputs", "logs", "wandb",
                                         "runs")},
    "model.path": _PATH,
    "model.shape": Text(r"[A-Za-z0-9_.-]+", "null or an architecture name (planning/shapes.py)", optional=True),
    "model.actor_adapter": _OPTIONAL_PATH,
    "model.critic_adapter": _OPTIONAL_PATH,
    "data.root": _PATH,
    # model
    "model.dtype": OneOf(("bfloat16", "float16", "float32")),
    "model.lora.rank": Int(1, 512),  # vLLM's largest LoRA rank
    "model.lora.alpha": Int(1),
    "model.lora.dropout": Real(0.0, 1.0, high_open=True),
    "model.lora.target_modules": Either(
        (OneOf(("all-linear",)), Items(_MODULE_NAME, min_length=1, unique=True)),
        "'all-linear' or a non-empty list of module names (e.g. [q_proj, v_proj])"),
    # the critic's LoRA when it starts fresh: null takes model.lora's (store/lora_shapes.py)
    "model.critic_lora.rank": Int(1, 512, optional=True),
    "model.critic_lora.alpha": Int(1, optional=True),
    "model.critic_lora.dropout": Real(0.0, 1.0, high_open=True, optional=True),
    "model.critic_lora.target_modules": Either(
        (OneOf((None, "all-linear")), Items(_MODULE_NAME, min_length=1, unique=True)),
        "null (model.lora's), 'all-linear' or a non-empty list of module names"),
    "model.logprob_chunk_tokens": Int(1),
    "model.head_dtype": OneOf(("model", "float32")),
    "model.attn_implementation": OneOf(("sdpa", "sdpa_varlen", "eager", "flash_attention_2", "flash_attention_3")),
    "model.sequence_layout": OneOf(("auto", "packed", "padded")),
    "model.linear_attention_kernel": OneOf(("auto", "fla", "torch")),
    "model.elementwise_kernels": OneOf(("auto", "liger", "torch")),
    "model.attention_length_bucket": Int(0, optional=True),
    "model.layer_recompute": Either((OneOf((None,)), Items(OneOf(("layer", "mixer", "mlp", "none")), min_length=1)),
                                    "null or a list of layer, mixer, mlp, none (one a decoder layer)"),
    "model.checkpoint_layers": Either((OneOf((None, "auto")), Int(0)), "null, auto or an integer >= 0"),
    # data
    "data.benchmarks": Items(OneOf(BENCHMARKS), min_length=1, unique=True),
    "data.train_split": SAFE_NAME,
    "data.val_split": SAFE_NAME,
    "data.subset_columns": Items(_COLUMN, unique=True),
    "data.val_max_questions": Int(1, optional=True),
    "data.label_conflicts": OneOf(LABEL_CONFLICT_POLICIES),
    "data.split_overlap": OneOf(("refuse", "allow")),
    "data.seed": _SEED,
    # rollout
    "rollout.n": Int(1),
    # the trainer divides logits by it: 0 (greedy) is for validation only
    "rollout.temperature": Real(0.0, 100.0, low_open=True),
    "rollout.top_p": Real(0.0, 1.0, low_open=True),
    "rollout.top_k": Int(-1),
    "rollout.val_temperature": Real(0.0, 100.0),
    "rollout.val_n": Int(1),
    "rollout.max_prompt_length": Int(1),
    "rollout.max_response_length": Int(1),
    "rollout.max_tokens_per_turn": Int(1),
    "rollout.max_model_len": Int(1),
    "rollout.max_turns": Int(1),
    "rollout.max_explores": Int(0, 64),
    "rollout.max_in_flight": Int(1),
    "rollout.gpu_memory_utilization": Real(0.0, 1.0, low_open=True),
    "rollout.weight_sync": OneOf(("lora", "merged")),
    "rollout.bucket_mb": Int(1),
    "rollout.weight_transfer": OneOf((None, "gloo", "nccl")),
    "rollout.request_timeout_s": Real(0.0, low_open=True),
    "rollout.max_retries": Int(0),
    "rollout.cpu_kvcache_gib": Int(1),
    "rollout.gdn_prefill_backend": OneOf(("auto", "triton", "flashinfer", "cutedsl")),
    "rollout.mamba_ssm_cache_dtype": OneOf(("auto", "float32", "bfloat16", "float16")),
    "rollout.max_logprob_gap": Real(0.0, low_open=True),
    "rollout.logprob_gap_factor": Real(1.0),
    "rollout.marked_check_every": Int(0),
    "rollout.server_url": Text(r"https?://[^\s/]+(:\d+)?/?", "http(s)://host:port", optional=True),
    "rollout.server_start_timeout_s": Real(0.0, low_open=True),
    # algorithm
    "algorithm.gamma": Real(0.0, 1.0),
    "algorithm.lam": Real(0.0, 1.0),
    "algorithm.clip_ratio_low": Real(0.0, 1.0, high_open=True),
    "algorithm.clip_ratio_high": Real(0.0),
    "algorithm.clip_ratio_c": Real(1.0, low_open=True),  # the dual clip must sit above 1
    "algorithm.loss_agg_mode": OneOf(("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm")),
    "algorithm.entropy_coeff": Real(),
    "algorithm.kl_loss_coef": Real(0.0),
    "algorithm.kl_loss_type": OneOf(("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")),
    "algorithm.kl_penalty": OneOf(("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")),
    "algorithm.kl_coef": Real(0.0),
    "algorithm.cliprange_value": Real(0.0),
    "algorithm.actor_lr": Real(0.0, 1.0, low_open=True),
    "algorithm.critic_lr": Real(0.0, 1.0, low_open=True),
    "algorithm.weight_decay": Real(0.0, 1.0),
    "algorithm.betas": Items(Real(0.0, 1.0, high_open=True), length=2),
    "algorithm.grad_clip": Real(0.0, low_open=True),
    "algorithm.train_batch_size": Int(1),
    "algorithm.ppo_mini_batch_size": Int(1),
    "algorithm.ppo_epochs": Int(1),
    "algorithm.ppo_max_token_len_per_gpu": Int(1),
    "algorithm.forward_max_token_len_per_gpu": Int(1),
    "algorithm.critic_warmup": Int(0),
    "algorithm.off_policy_loss": OneOf(("none", "decoupled")),
    "algorithm.behav_imp_weight_cap": Real(1.0),
    "algorithm.behav_imp_weight_mode": OneOf(("truncate", "mask")),
    # reward
    "reward.cost_per_usd": Real(0.0, MAX_COST_PER_USD),
    "reward.no_submit_reward": Real(-MAX_SHAPING, MAX_SHAPING),
    # trainer
    "trainer.total_steps": Int(1),
    "trainer.val_every": Int(0),
    "trainer.save_every": Int(0),
    "trainer.gpu_hour_usd": Real(0.0),
    "trainer.accelerator": OneOf(("auto", "cpu", "gpu", "cuda")),
    "trainer.devices": Int(1),
    "trainer.num_nodes": Int(1),
    # the trainer's dtypes are model.dtype's and FSDP2's policy under Lightning's 32-true: another
    # plugin casts the whole module (the fp32 LoRA masters, "64-true" and "*-true": module.to) or
    # autocasts the update (bf16-mixed on CPU fails in step 1's fused LoRA matmul, models/fused_lora.py)
    "trainer.precision": OneOf(("32-true", "32"), hint="the base's dtype is model.dtype (bfloat16, float16 or "
                                                       "float32); LoRA masters stay float32, and on GPUs FSDP2 "
                                                       "computes in bfloat16 (models/sharding.py)"),
    "trainer.resume": Text(_PATH_TEXT, "null, auto or a checkpoint folder", optional=True),
    "trainer.init_from": Text(_PATH_TEXT, "null or a checkpoint folder", optional=True),
    "trainer.memory_check_steps": Int(1),
    "trainer.memory_check_generation": OneOf((True, False)),
    # layout
    "layout.mode": OneOf(("colocated", "separate")),
    "layout.gpus": Int(1),
    "layout.train_gpus": Int(1),
    "layout.serve_gpus": Int(0),
    "layout.engine_tp": Int(1),
    "layout.max_staleness": Int(0),
    "layout.staleness_policy": OneOf(("wait", "drop")),
    "layout.partial_rollouts": OneOf((True, False)),
    "layout.share_cards": OneOf((True, False)),
    # logger, hub
    "logger.mode": OneOf(("auto", "online", "offline", "disabled")),
    "logger.project": _NAME,
    "logger.entity": Text(_NAME.pattern, f"null or {_NAME.meaning}", optional=True),
    "logger.tags": Items(Text(_SOME_TEXT + r"[^\x00-\x1f]{1,64}", "a tag of 1-64 printable characters, not only spaces")),
    "hub.repo_id": Text(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", "owner/name", optional=True),
    "hub.repo_type": OneOf(("dataset", "model")),
    "hub.endpoint": Text(r"https?://[^\s/]+(/\S*)?", "null or the Hub's http(s):// URL", optional=True),
    # the question paragraph of the data root's published README: null writes none, an empty one a blank one
    "hub.description": Text(r"(?s)" + _SOME_TEXT + r".+", "null or a text that is not blank", optional=True),
    # plan
    "plan.card_gib": Real(0.0, low_open=True),
}


# ----------------------------------------------------------------------------- checking


def _nonfinite_leaves(node: Any, key: str):
    """Full keys of every NaN/inf number under ``node`` (dicts, lists, callback arguments)."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _nonfinite_leaves(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _nonfinite_leaves(value, f"{key}[{index}]")
    elif isinstance(node, float) and not math.isfinite(node):
        yield key, node


def check_values(cfg: DictConfig, error: type[Exception]) -> None:
    """Every rule of ``CONSTRAINTS`` on ``cfg`` (resolved), after refusing any non-finite number.
    Raises ``error`` (``config.ConfigError``) naming the key; a key of the table missing from
    ``cfg`` is an error too (the table and the schema must move together)."""
    for key, value in _nonfinite_leaves(OmegaConf.to_container(cfg, resolve=True), ""):
        raise error(f"{key}={value}: must be a finite number")
    for key, rule in CONSTRAINTS.items():
        if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            raise error(f"{key}: has a rule in constraints.py but is not in the config schema")
        value = OmegaConf.select(cfg, key)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        try:
            rule(value)
        except Violation as err:
            raise error(f"{key}={value!r}: {err}") from None


_MISSING = object()

__all__ = ["CONSTRAINTS", "MAX_COST_PER_USD", "MAX_COST_USD", "SAFE_NAME", "Violation", "check_values"]
