"""In-process vLLM: a ``vllm.LLM`` living inside a training process (colocated layouts).

Contract:

- Construct it after Lightning has made its process group (``on_fit_start``), on every rank at
  the same point: engine construction is collective. With ``layout.engine_tp > 1`` the
  ranks of a TP group form one engine (``external_launcher``) and must feed identical requests.
- Its arguments are ``args.EngineArgs`` (built once from the config, the same a server gets).
  vLLM checks some of them only as it starts, against the card (a hybrid's state slots for
  ``max_num_seqs`` requests): its refusal naming arguments a config key sets is a ``ConfigError``
  naming those keys (``_started``).
- It is kept out of the LightningModule's submodules, so FSDP and checkpoints never see it.
- LoRA: each sync gets a new ``lora_int_id`` (the worker caches adapters by id; the same id
  with a new folder would silently serve the old adapter), and the previous one is removed.
- Log-probs are vLLM's ``processed_logprobs``: of the distribution sampled from (temperature
  applied), which is what the trainer recomputes.
- The engine core always runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the weight
  sync hands the worker a generator (``_reload_weights``), which cannot cross a process boundary.
  Under a training process group (Lightning's ``ModelParallelStrategy``, world 1 included) the
  engine joins it through ``external_launcher``.
- Sleep (GPUs, ``enable_sleep_mode``): ``sleep`` frees the weights and the KV cache for the
  update; level 1 keeps a host copy of the weights (a pinned copy made at every sleep), level 2
  drops them, for a sync that reloads every weight anyway (merged); an engine whose dropped
  weights were not reloaded refuses to generate. ``wake_up`` first returns the trainer's cached
  blocks to the driver (``torch.cuda.empty_cache``): vLLM maps its memory outside PyTorch's
  caching allocator, so memory PyTorch merely caches is not free for it. While it sleeps the
  trainer allocates in expandable segments, whose free pages that return releases whole
  (``trainer_allocator``).
- Failure: every call into vLLM goes through a ``failure.FailureGuard``: an engine that died
  (whatever vLLM raises then: an ``AssertionError``, ``EngineDeadError``, ``RuntimeError``) is
  an ``EngineError`` naming the operation, and stays failed.
- Versions: written against vLLM 0.32 (CPU build) and 0.26 (CUDA, torch 2.11): the same
  ``LLM`` arguments, ``LLMEngine`` request API, worker ``reload_weights`` and LoRA manager
  internals (``_held_lora``) in both.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, Iterator, Optional

import torch

from atlas_lightning.rollout.digest import WeightDigest
from atlas_lightning.rollout.engines import card_holdings, trainer_allocator
from atlas_lightning.rollout.engines.vllm_lifetime import shut_down_llm, start_llm
from atlas_lightning.rollout.engine import (
    AdapterVersion,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SyncReport,
)
from atlas_lightning.rollout.engines.adapter_folder import check_adapter_folder
from atlas_lightning.rollout.engines.args import EngineArgs, refusal_message
from atlas_lightning.rollout.engines.failure import FailureGuard

log = logging.getLogger(__name__)


def prepare_cpu_environment(kvcache_gib: int, threads: Optional[int] = None) -> None:
    """Set what vLLM's CPU backend reads at import and start (before ``import vllm``).

    In-process engine core (no extra process), a bounded KV cache, and a thread count that the
    CPU worker will impose process-wide (it replaces ``torch.set_num_threads``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    threads = threads or torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _started(kwargs: dict):
    """``start_llm(**kwargs)``; a ``ValueError`` of vLLM's that names arguments a config key sets
    (``args.refusal_message``: vLLM checks its arguments, and what they leave on this card, as it
    starts) becomes a ``ConfigError`` naming those keys (exit 2, no traceback). Any other error
    propagates as it is."""
    from atlas_lightning.config import ConfigError
    from atlas_lightning.errors import first_line

    try:
        return start_llm(**kwargs)
    except ValueError as err:
        refusal = refusal_message(f"{type(err).__name__}: {first_line(err, 2000)}", kwargs)
        if refusal is None:
            raise
        raise ConfigError(refusal) from None


def head_dtype_problem(engine, wanted: str) -> Optional[str]:
    """None when ``engine`` (a ``vllm.LLMEngine``) computes its logits in ``wanted``
    (``model.head_dtype``: ``model`` is the model's dtype), else what is wrong. vLLM falls back to
    the model's dtype, with a warning only, on a platform without float32, and a vLLM before the
    generation models' ``head_dtype`` ignores the override: either would leave the trainer's
    float32 logits against the engine's rounded ones."""
    config = engine.model_config
    held = getattr(config, "head_dtype", None)
    expected = config.dtype if wanted == "model" else getattr(torch, wanted)
    if held == expected:
        return None
    return (f"model.head_dtype={wanted}: the vLLM engine computes its logits in {held or 'the model dtype'}, "
            f"not {str(expected).removeprefix('torch.')}; the trainer and the engine would round logits "
            f"differently (set model.head_dtype=model, or use a vLLM that honours head_dtype for "
            f"generation models)")


def _held_lora(worker, lora_id: int) -> Optional[dict]:
    """Runs inside the vLLM worker: the digest (``digest.WeightDigest`` entries, by canonical
    module name) of the LoRA factors it holds for ``lora_id``, exactly as held, with their dtype
    and whether ``B`` carries its scaling (vLLM folds it in on load); None if it holds none.
    Packed modules (``qkv_proj``, ``gate_up_proj``) are named by their parts."""
    from atlas_lightning.rollout.digest import canonical_module, digest_named

    manager = worker.model_runner.lora_manager._adapter_manager
    model = manager.get_adapter(lora_id)
    if model is None:
        return None
    # vLLM keeps an adapter's factors in host memory (copied into the card's slots when active):
    # digested on the worker's card, in batches, as the trainer digests what it sent
    device = getattr(worker, "device", None)
    held, dtypes, folded = [], set(), True
    for module_name, weights in model.loras.items():
        packed = isinstance(weights.lora_a, list)
        names = manager.packed_modules.get(module_name, []) if packed else [module_name]
        a_list = weights.lora_a if packed else [weights.lora_a]
        b_list = weights.lora_b if packed else [weights.lora_b]
        scalings = weights.scaling if isinstance(weights.scaling, list) else [weights.scaling]
        if len(names) != len(a_list):
            raise RuntimeError(f"vllm LoRA module {module_name}: {len(a_list)} slices but parts {names}")
        for name, a, b, scaling in zip(names, a_list, b_list, scalings):
            if a is None:  # a part without LoRA
                continue
            key = canonical_module(name)
            held += [(f"{key}.lora_A", a), (f"{key}.lora_B", b)]
            dtypes.add(str(a.dtype).removeprefix("torch."))
            folded = folded and scaling == 1
    entries = digest_named((name, tensor if device is None else tensor.to(device)) for name, tensor in held).entries
    return {"entries": entries, "dtype": dtypes.pop() if len(dtypes) == 1 else sorted(dtypes), "scale_b": folded}


def _reload_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """Runs inside the vLLM worker: load HF-named tensors through the model's own loader, in ONE
    ``reload_weights`` call; returns the digest entries (``digest.tensor_digest`` by name) of
    what the loader consumed.

    One call for a whole sync, never one per bucket: vLLM 0.32's layerwise reload materialises a
    fused layer (``qkv_proj``, ``gate_up_proj``) from empty memory when a call delivers only some
    of its parts and writes it back, so a bucket boundary inside a layer corrupts the part that
    arrives in the other call (seen: greedy output all token 0). A streamed iterator keeps
    memory at what the caller holds (a bucket) while vLLM sees every weight of every layer."""
    from atlas_lightning.rollout.digest import tensor_digest

    entries: dict[str, str] = {}

    def counted():
        for name, tensor in weights:
            if name in entries:
                raise RuntimeError(f"reload_weights: {name} arrived twice in one sync")
            entries[name] = tensor_digest(tensor)
            yield name, tensor

    worker.reload_weights(weights_iterator=counted())
    return entries


class VLLMEngine(Engine):
    """``vllm.LLM`` driven request by request through its ``LLMEngine`` (continuous batching
    across episodes' turns). One instance a process (or a TP group)."""

    name = "vllm"

    def __init__(self, args: EngineArgs, *, external_launcher: bool = False, sleep_level: int = 1) -> None:
        """Start ``vllm.LLM`` with ``args`` (collective over a TP group). ``external_launcher``:
        this process is one of several training processes, or one under a training process
        group (vLLM's ``external_launcher``). ``sleep_level``: vLLM's 1 (keep a host copy of the
        weights while asleep) or 2 (drop them: a merged sync reloads every weight anyway)."""
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            prepare_cpu_environment(args.cpu_kvcache_gib)
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level}: vLLM's levels are 1 (keep a host copy of the weights) "
                             f"and 2 (drop them)")
        # the engine core in this process: collective_rpc hands the worker live objects (a
        # generator of weights); with external_launcher vLLM requires it anyway
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs = args.vllm_kwargs(on_cpu=on_cpu)
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.args = args
        self._sleep_enabled = args.enable_sleep_mode and not on_cpu
        self._sleep_level = sleep_level
        self._weights_dropped = False  # level-2 sleep dropped the weights; a load_weights brings them back
        self._lora_enabled = args.lora_rank is not None
        self.guard = FailureGuard(self.name)
        #: the card a sleeping engine gives way on (None: this engine never sleeps)
        self._card = torch.device("cuda", torch.cuda.current_device()) if self._sleep_enabled else None
        card = self._card
        allocated = torch.cuda.memory_allocated(card) if card is not None else 0
        held_before = card_holdings.storages(card) if card is not None else set()
        self.llm = _started(kwargs)
        self._engine = self.llm.llm_engine
        problem = head_dtype_problem(self._engine, args.head_dtype)
        if problem:
            shut_down_llm(self.llm)
            raise EngineError(problem)
        # what a failed wake tells apart from the trainer's holdings (card_holdings.py)
        self._own_bytes = torch.cuda.memory_allocated(card) - allocated if card is not None else 0
        self._own_storages = frozenset(card_holdings.storages(card) - held_before) if card is not None else frozenset()
        self.vocab_size = _sampled_vocab_size(self._engine)
        self._lora = None  # the LoRARequest every request carries
        self._pending: set[str] = set()
        self._asleep = False

    # -- requests -------------------------------------------------------------------------

    def _sampling_params(self, request: GenerationRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        spec = request.sampling
        return SamplingParams(
            n=1,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            seed=spec.seed,
            max_tokens=spec.max_tokens,
            stop_token_ids=list(spec.stop_token_ids),
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def submit(self, request: GenerationRequest) -> None:
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise EngineError("vllm engine is asleep: wake_up() before submitting requests")
        if self._weights_dropped:
            raise EngineError("vllm engine slept at level 2 (weights dropped) and no load_weights() brought "
                              "them back: refusing to generate from undefined weights")
        with self.guard.call("submit"):
            self._engine.add_request(
                request.request_id,
                TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                self._sampling_params(request),
                lora_request=self._lora,
            )
        self._pending.add(request.request_id)

    def poll(self) -> list[GenerationResult]:
        if not self._pending:
            return []
        with self.guard.call(f"a generation step ({len(self._pending)} requests pending)"):  # none comes back
            outputs = self._engine.step()
        results = []
        for output in outputs:
            if not output.finished:
                continue
            self._pending.discard(output.request_id)
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs or [], token_ids)]
            if len(logprobs) != len(token_ids):
                results.append(GenerationResult(output.request_id, token_ids, logprobs, "error",
                                                error=f"{len(token_ids)} tokens but {len(logprobs)} log-probs"))
                continue
            reason = "length" if completion.finish_reason == "length" else "stop"
            if completion.finish_reason not in ("length", "stop"):
                results.append(GenerationResult(output.request_id, token_ids, logprobs, "error",
                                                error=f"finish_reason={completion.finish_reason!r}"))
                continue
            results.append(GenerationResult(output.request_id, token_ids, logprobs, reason))
        return results

    def num_pending(self) -> int:
        return len(self._pending)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._pending]
        if ids:
            with self.guard.call("abort"):
                self._engine.abort_request(ids)
            self._pending.difference_update(ids)

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep or self._weights_dropped:
            raise EngineError("vllm engine is asleep or its weights were dropped: no probe possible")
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        with self.guard.call("prompt_logprobs (the weight sync's probe)"):
            output = self.llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params,
                                       lora_request=self._lora, use_tqdm=False)[0]
        return [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:])]

    # -- weights --------------------------------------------------------------------------

    def set_adapter(self, adapter: Optional[AdapterVersion]) -> SyncReport:
        from vllm.lora.request import LoRARequest

        if not self._lora_enabled:
            raise EngineError("this vllm engine was built without LoRA (rollout.weight_sync must be 'lora')")
        if self._asleep:
            raise EngineError("vllm engine is asleep: wake_up() before setting an adapter")
        if self._lora is not None:
            with self.guard.call("set_adapter (removing the previous adapter)"):
                self._engine.remove_lora(self._lora.lora_int_id)
            self._lora = None
        with self.guard.call("set_adapter (resetting the prefix cache)"):
            self._engine.reset_prefix_cache()
        if adapter is None:
            return SyncReport(tensor_count=0, digest=WeightDigest(), form={"kind": "lora"})
        check_adapter_folder(adapter.folder)
        lora_id = adapter.version + 1  # ids must be positive and new for every version
        request = LoRARequest(f"{adapter.name}-v{adapter.version}", lora_id, adapter.folder)
        with self.guard.call(f"set_adapter ({adapter.folder})"):
            added = self._engine.add_lora(request)
        if not added:
            raise EngineError(f"vllm refused the adapter {adapter.folder}")
        self._lora = request
        return self.held_adapter()

    def held_adapter(self) -> SyncReport:
        """The digest of the adapter every request is served with (the id requests carry), read
        back from the worker: what it holds, not what it was asked to load."""
        if self._lora is None:
            return SyncReport(tensor_count=0, digest=WeightDigest(), form={"kind": "lora"})
        lora_id = self._lora.lora_int_id
        with self.guard.call("reading back the adapter held"):
            held = self.llm.collective_rpc(_held_lora, args=(lora_id,))[0]
        if held is None:
            raise EngineError(f"vllm engine: the worker holds no adapter for id {lora_id} ({self._lora.lora_path})")
        return SyncReport(tensor_count=len(held["entries"]), digest=WeightDigest(held["entries"]),
                          held="held by the engine's worker",
                          form={"kind": "lora", "dtype": held["dtype"], "scale_b": held["scale_b"]},
                          extra={"lora_int_id": lora_id, "lora_path": self._lora.lora_path})

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        """Every base weight of one sync (a stream, consumed once, in one reload; see
        ``_reload_weights``). The iterator reaches the worker as it is: this engine runs its
        worker in this process (in-process engine core on CPU, ``external_launcher`` on GPUs)."""
        if self._asleep:
            raise EngineError("vllm engine is asleep: wake_up() before loading weights")
        with self.guard.call("load_weights"):  # an error of the trainer's iterator passes as it is
            entries = self.llm.collective_rpc(_reload_weights, args=(self.guard.passing(weights),))[0]
            self._engine.reset_prefix_cache()
        self._weights_dropped = False
        return SyncReport(tensor_count=len(entries), digest=WeightDigest(entries),
                          held="received by the engine's weight loader", form={"kind": "tensors"})

    # -- memory ---------------------------------------------------------------------------

    @property
    def sleeps(self) -> bool:
        """True where ``sleep`` frees memory (GPUs with ``enable_sleep_mode``)."""
        return self._sleep_enabled

    def sleep(self) -> None:
        """Free the weights and the KV cache (module doc); a no-op without sleep mode."""
        if self._sleep_enabled and not self._asleep:
            with self.guard.call("sleep"):
                self.llm.sleep(level=self._sleep_level)
            self._asleep = True
            self._weights_dropped = self._sleep_level == 2
            trainer_allocator.for_training()

    def wake_up(self) -> None:
        """Map the engine's memory again (after returning PyTorch's cached blocks, module doc)."""
        if self._asleep:
            before = None
            trainer_allocator.for_engine()  # the trainer's side: not the engine's failure if it raised
            try:
                with self.guard.call("wake_up"):
                    torch.cuda.empty_cache()
                    before = card_holdings.summary(self._card, self._own_bytes)  # asleep: on a card
                    log.info("waking the engine: %s", before)
                    self.llm.wake_up()
            except EngineError as err:
                if before is None or "out of memory" not in str(err):
                    raise
                # the driver's message names no holder: what the trainer kept alive does
                holders = card_holdings.largest_live(self._card, exclude=self._own_storages)
                raise EngineError(f"{err}; before the wake: {before}; {holders}") from err
            self._asleep = False

    @property
    def failure(self) -> Optional[str]:
        return self.guard.failed

    def close(self) -> None:
        """Abort what is pending and end the engine now (``vllm_lifetime``: not when the garbage
        collector reaches it, which would pull process groups from under whatever runs then)."""
        if self.llm is None:
            return
        with self.guard.closing():  # a failed engine's close does not raise over its failure
            if self._pending and self.guard.failed is None:
                self.abort(list(self._pending))
            llm, self.llm, self._engine = self.llm, None, None
            shut_down_llm(llm)


def _sampled_vocab_size(engine) -> Optional[int]:
    """The vocabulary vLLM samples from (its model config's), None where this vLLM does not say."""
    try:
        return int(engine.model_config.get_vocab_size())
    except Exception:  # another vLLM's layout: the reply check then only bounds ids below
        return None
