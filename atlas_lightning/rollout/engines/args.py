"""The engine arguments, built once from the config: what ``VLLMEngine`` passes to ``vllm.LLM``,
what ``VLLMServer`` turns into ``vllm serve`` flags, and what the planner sizes an engine with.

``EngineArgs.from_config(cfg)`` is the one mapping from ``rollout.*``, ``model.*`` and
``layout.engine_tp`` to vLLM's engine arguments; ``vllm_kwargs`` spells them in vLLM's names
(its ``EngineArgs`` fields, which its CLI turns into ``--flags``), CPU and GPU apart.

Requests in flight. ``rollout.max_in_flight`` is what ONE engine holds at once: vLLM's
``max_num_seqs`` is ``min(max_in_flight, MAX_NUM_SEQS)``, and the agent loop that feeds an
engine keeps at most ``max_in_flight`` requests in it (a TP group's ranks feed identical
requests to their one engine). In the separate layout every training rank is a client of the
one server, so each keeps ``max_in_flight // ranks`` in flight (``client_in_flight``): the
server never holds more than ``max_in_flight``, the number the plan sized it for.

Hybrid models (Qwen3.5/3.6: Gated DeltaNet and attention layers, checkpoints of the image-text
architecture ``Qwen3_5ForConditionalGeneration``):

* the Gated DeltaNet prefill kernel is ``rollout.gdn_prefill_backend``, passed as vLLM's engine
  argument ``gdn_prefill_backend`` (``EngineArgs`` field since vLLM 0.26, which stores it in
  ``additional_config``; its choices ``VLLM_GDN_PREFILL_KERNELS``). ``auto`` passes ``triton`` on
  GPUs: vLLM's own default on an H100/H200 (SM90) is FlashInfer's kernel, JIT-built at the first
  prefill, and the device wheel set cannot build it ("SM90 GDN prefill DSL kernel is
  unavailable", seen on the H200); the Triton/FLA kernels run. On CPU nothing is passed: vLLM
  takes its CPU kernel whatever is asked;
* each sequence's Gated DeltaNet state is kept between engine steps in
  ``rollout.mamba_ssm_cache_dtype`` (vLLM's ``mamba_ssm_cache_dtype``; ``float32`` unless set).
  The trainer carries the state in float32 through a whole sequence; an engine that keeps it in
  bfloat16 rounds it at every decoded token and at every prefix-cache block boundary of a
  prefill, a rounding that compounds over the Gated DeltaNet layers. vLLM's own default for a
  Qwen3.5/3.6 checkpoint is its ``mamba_ssm_dtype`` (float32 in the published ones), else the
  model's dtype; ``auto`` leaves it to vLLM, and so does a CPU engine (vLLM's CPU kernel was
  never run here with a float32 state);
* every engine is started ``language_model_only``: the agent sends text alone, so vLLM builds
  no vision tower (its weights in the folder are skipped: no memory, no encoder profiling,
  no image processor needed). Attention-only models ignore both.

The lm_head's output dtype is ``model.head_dtype``, the trainer's (``models/logprobs.py``), passed
as ``hf_overrides={"head_dtype": "float32"}`` when not ``model``: both sides must compute logits
alike, or the one that keeps float32 logits parts from the other by the other's rounding.

Pure Python (no torch, no vLLM): ``planning`` imports it. Who calls it: ``rollout.factory``,
``rollout.separate``, ``rollout.datamodule``, ``planning.estimate``, tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from atlas_lightning.store.lora_shapes import LoraShape, lora_shapes_or_config

#: Most sequences one engine schedules at once: vLLM's own default on 70 GB+ cards (H100, H200,
#: B200); requests beyond it would wait in vLLM's queue while their timeouts run.
MAX_NUM_SEQS = 1024

#: vLLM's Gated DeltaNet prefill kernels (its ``gdn_prefill_backend`` choices in 0.26); the
#: config's ``rollout.gdn_prefill_backend`` adds ``auto`` (module doc).
VLLM_GDN_PREFILL_KERNELS = ("triton", "flashinfer", "cutedsl")

#: LoRA ranks vLLM accepts for ``max_lora_rank``.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


#: vLLM's engine arguments that a config key sets, by vLLM's name: a refusal at the engine's start
#: names them in vLLM's words (``refused_arguments``)
CONFIG_KEYS = {
    "max_num_seqs": "rollout.max_in_flight", "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "max_model_len": "rollout.max_model_len", "tensor_parallel_size": "layout.engine_tp",
    "max_lora_rank": "model.lora.rank", "dtype": "model.dtype", "enable_sleep_mode": "rollout.enable_sleep_mode",
    "mamba_ssm_cache_dtype": "rollout.mamba_ssm_cache_dtype", "gdn_prefill_backend": "rollout.gdn_prefill_backend",
    "enforce_eager": "rollout.enforce_eager", "hf_overrides": "model.head_dtype",
}


def refused_arguments(message: str, kwargs: dict[str, Any]) -> list[str]:
    """``"<vLLM name>=<value> (<config key>)"`` for each engine argument of ``kwargs`` that a
    config key sets (``CONFIG_KEYS``) and ``message`` (vLLM's refusal) names as a word; empty when
    it names none (then the refusal is not about this config's values)."""
    return [f"{key} (vLLM's {name}={kwargs[name]!r})" for name, key in CONFIG_KEYS.items()
            if name in kwargs and re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", message)]


def refusal_message(text: str, kwargs: dict[str, Any]) -> Optional[str]:
    """The config error for an engine that refused its arguments as it started: ``text`` is vLLM's
    error (``TypeName: message`` of an in-process engine, or a server's log tail), whose last line
    that reports an error and names an argument of ``kwargs`` that a config key sets is taken (the
    log's other lines, its command line among them, name arguments without refusing them); None
    when no line does."""
    errors = [line for line in text.splitlines() if "error" in line.lower() and not line.startswith("$ ")]
    for line in reversed(errors):
        named = refused_arguments(line, kwargs)
        if named:
            said = " ".join(line.split())[:500]
            return f"the rollout engine refused {'; '.join(named)} at its start; vLLM says: {said}"
    return None


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for slot in VLLM_LORA_RANKS:
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest supported rank {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class EngineArgs:
    """One engine's arguments (``from_config``); the same for an in-process engine and a server."""

    #: A local folder in Hugging Face layout (``model.path``).
    model: str
    dtype: str
    max_model_len: int
    #: ``layout.engine_tp``.
    tensor_parallel_size: int
    #: ``min(rollout.max_in_flight, MAX_NUM_SEQS)`` (module doc).
    max_num_seqs: int
    seed: int
    #: Fraction of a card the engine takes (GPU only).
    gpu_memory_utilization: float
    #: Sleep between rollouts (GPU only; a server is refused it before it starts).
    enable_sleep_mode: bool
    enforce_eager: bool
    #: The CPU engine's KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``, read at vLLM's start).
    cpu_kvcache_gib: int
    #: LoRA rank served with ``rollout.weight_sync=lora``: the actor's largest (its starting
    #: adapter's ``adapter_config.json`` when it has one, else ``model.lora.rank``; the shape the
    #: run resolved once, ``from_config``; the critic never reaches an engine). None: no LoRA
    #: (merged weights arrive in the base).
    lora_rank: Optional[int]
    #: ``rollout.gdn_prefill_backend``: ``auto`` or one of ``VLLM_GDN_PREFILL_KERNELS`` (module doc).
    gdn_prefill_backend: str = "auto"
    #: ``rollout.mamba_ssm_cache_dtype``: ``auto`` (vLLM's choice) or a dtype (module doc).
    mamba_ssm_cache_dtype: str = "float32"
    #: ``model.head_dtype``: ``model`` or ``float32``, the trainer's (``models/logprobs.py``); the
    #: engine gets it as vLLM's ``hf_overrides={"head_dtype": ...}`` (0.26 and 0.32 honour it).
    head_dtype: str = "model"

    @classmethod
    def from_config(cls, cfg: Any, actor_lora: Optional[LoraShape] = None) -> "EngineArgs":
        """The arguments of every engine of ``cfg`` (a composed config). ``actor_lora``: the LoRA
        shape the actor trains, as the run resolved it once at start-up (``run.facts.RunFacts.lora``:
        the trainer's, handed down through ``RolloutDataModule``); None: resolved here from ``cfg``
        the same way (``store.lora_shapes``; ``plan``, an engine built on its own)."""
        r = cfg.rollout
        lora_rank = None
        if r.weight_sync == "lora":
            lora_rank = (actor_lora or lora_shapes_or_config(cfg)[0]["actor"]).max_rank
        return cls(
            model=str(cfg.model.path),
            dtype=str(cfg.model.dtype),
            max_model_len=int(r.max_model_len),
            tensor_parallel_size=int(cfg.layout.engine_tp),
            max_num_seqs=min(int(r.max_in_flight), MAX_NUM_SEQS),
            seed=int(cfg.seed),
            gpu_memory_utilization=float(r.gpu_memory_utilization),
            enable_sleep_mode=bool(r.enable_sleep_mode),
            enforce_eager=bool(r.enforce_eager),
            cpu_kvcache_gib=int(r.cpu_kvcache_gib),
            lora_rank=lora_rank,
            gdn_prefill_backend=str(r.gdn_prefill_backend),
            mamba_ssm_cache_dtype=str(r.mamba_ssm_cache_dtype),
            head_dtype=str(cfg.model.head_dtype),
        )

    def vllm_kwargs(self, *, on_cpu: bool) -> dict[str, Any]:
        """vLLM's engine arguments by its own names (``vllm.LLM(**kwargs)``; ``--name-with-dashes``
        for its server). Log-probs are of the distribution sampled from (``processed_logprobs``).
        ``ValueError`` for a ``gdn_prefill_backend`` vLLM does not have."""
        kernel = gdn_prefill_kernel(self.gdn_prefill_backend, on_cpu=on_cpu)
        kwargs: dict[str, Any] = dict(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            language_model_only=True,
        )
        if kernel is not None:
            kwargs["gdn_prefill_backend"] = kernel
        if self.head_dtype != "model":
            kwargs["hf_overrides"] = {"head_dtype": self.head_dtype}
        if self.mamba_ssm_cache_dtype != "auto" and not on_cpu:
            kwargs["mamba_ssm_cache_dtype"] = self.mamba_ssm_cache_dtype
        if on_cpu:
            # vLLM 0.32 rewinds a seeded request's generator (set_offset) when a chunked prefill
            # discards its sampled token, and CPU generators refuse that ("CPU Generator does not
            # use offset"): the step fails and its requests are stranded. Whole-prompt prefills
            # never discard, so prompts are never split on CPU.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 4096))
        else:
            kwargs.update(gpu_memory_utilization=self.gpu_memory_utilization,
                          enable_sleep_mode=self.enable_sleep_mode)
        if self.lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(self.lora_rank), max_loras=1)
        return kwargs


def gdn_prefill_kernel(choice: str, *, on_cpu: bool) -> Optional[str]:
    """vLLM's ``gdn_prefill_backend`` for ``rollout.gdn_prefill_backend=choice`` (module doc):
    ``auto`` is ``triton`` on GPUs and None (not passed) on CPU; a kernel of
    ``VLLM_GDN_PREFILL_KERNELS`` is passed as it is; anything else is a ``ValueError`` naming the key."""
    if choice == "auto":
        return None if on_cpu else "triton"
    if choice not in VLLM_GDN_PREFILL_KERNELS:
        raise ValueError(f"rollout.gdn_prefill_backend={choice!r} is not one of auto, "
                         f"{', '.join(VLLM_GDN_PREFILL_KERNELS)}")
    return choice


def client_in_flight(cfg: Any, training_ranks: int) -> int:
    """Requests one training rank keeps in flight at its engine (module doc): the whole
    ``rollout.max_in_flight`` where the engine is its own (or its TP group's), an equal share of
    it where ``training_ranks`` ranks share the separate layout's one server (at least 1)."""
    if cfg.layout.mode == "separate":
        return max(1, int(cfg.rollout.max_in_flight) // max(int(training_ranks), 1))
    return int(cfg.rollout.max_in_flight)
