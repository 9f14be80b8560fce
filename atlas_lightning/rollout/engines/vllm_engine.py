"""In-process vLLM: a ``vllm.LLM`` living inside a training process (colocated layouts).

Contract (see ``../shared/VLLM-NOTES.md`` for what was seen working):

- Construct it after Lightning has made its process group (``on_fit_start``), on every rank at
  the same point: engine construction is collective. With ``tensor_parallel_size > 1`` the
  ranks of a TP group form one engine (``external_launcher``) and must feed identical requests.
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
  caching allocator, so memory PyTorch merely caches is not free for it.
- Versions: written against vLLM 0.32 (CPU build) and 0.26 (CUDA, torch 2.11): the same
  ``LLM`` arguments, ``LLMEngine`` request API, worker ``reload_weights`` and LoRA manager
  internals (``_held_lora``) in both.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Optional

import torch

from atlas_lightning.rollout.engine import (
    AdapterVersion,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SyncReport,
)

#: LoRA ranks vLLM accepts for ``max_lora_rank``.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def prepare_cpu_environment(kvcache_gib: int, threads: Optional[int] = None) -> None:
    """Set what vLLM's CPU backend reads at import and start (before ``import vllm``).

    In-process engine core (no extra process), a bounded KV cache, and a thread count that the
    CPU worker will impose process-wide (it replaces ``torch.set_num_threads``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    threads = threads or torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def lora_rank_slot(rank: int) -> int:
    for slot in _VLLM_LORA_RANKS:
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest supported rank {_VLLM_LORA_RANKS[-1]}")


def _held_lora(worker, lora_id: int) -> tuple[int, float]:
    """Runs inside the vLLM worker: (tensor count, checksum) of the adapter it holds for
    ``lora_id``, with B scaled, over every A and B (packed modules count each slice)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    model = manager.get_adapter(lora_id)
    if model is None:
        return 0, 0.0
    count, total = 0, 0.0
    for weights in model.loras.values():
        a_list = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        b_list = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        scalings = weights.scaling if isinstance(weights.scaling, list) else [weights.scaling]
        for a, b, scaling in zip(a_list, b_list, scalings):
            if a is None:
                continue
            a64 = a.detach().to(torch.float64)
            b64 = b.detach().to(torch.float64) * float(scaling)
            total += float(a64.sum() + a64.square().sum() + b64.sum() + b64.square().sum())
            count += 2
    return count, total


def lora_checksum(a_b_pairs: Iterable[tuple[torch.Tensor, torch.Tensor, float]],
                  dtype: Optional[torch.dtype] = None) -> tuple[int, float]:
    """The trainer's side of ``_held_lora``: over (A, B, scaling) of each adapted module.
    Layout-independent (sums), so vLLM's packing of q/k/v and transposes do not matter.

    ``dtype``: the engine's LoRA dtype (vLLM casts a loaded adapter to the model's dtype, so a
    bf16 engine holds bf16-rounded factors of the trainer's fp32 ones); each factor is rounded
    to it before summing, so that the sums compare exactly. None: as given."""
    count, total = 0, 0.0
    for a, b, scaling in a_b_pairs:
        if dtype is not None:
            a, b = a.detach().to(dtype), b.detach().to(dtype)
        a64 = a.detach().to(torch.float64).cpu()
        b64 = b.detach().to(torch.float64).cpu() * float(scaling)
        total += float(a64.sum() + a64.square().sum() + b64.sum() + b64.square().sum())
        count += 2
    return count, total


def _reload_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, float]:
    """Runs inside the vLLM worker: load HF-named tensors through the model's own loader, in ONE
    ``reload_weights`` call; returns (count, plain float64 sum) of what the loader consumed.

    One call for a whole sync, never one per bucket: vLLM 0.32's layerwise reload materialises a
    fused layer (``qkv_proj``, ``gate_up_proj``) from empty memory when a call delivers only some
    of its parts and writes it back, so a bucket boundary inside a layer corrupts the part that
    arrives in the other call (seen: greedy output all token 0). A streamed iterator keeps
    memory at what the caller holds (a bucket) while vLLM sees every weight of every layer."""
    count, total = 0, 0.0

    def counted():
        nonlocal count, total
        for name, tensor in weights:
            total += float(tensor.detach().to(torch.float64).sum())
            count += 1
            yield name, tensor

    worker.reload_weights(weights_iterator=counted())
    return count, total


class VLLMEngine(Engine):
    """``vllm.LLM`` driven request by request through its ``LLMEngine`` (continuous batching
    across episodes' turns). One instance a process (or a TP group)."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        lora_rank: Optional[int] = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.6,
        enable_sleep_mode: bool = False,
        enforce_eager: bool = False,
        seed: int = 0,
        external_launcher: bool = False,
        cpu_kvcache_gib: int = 1,
        max_num_seqs: int = 256,
        sleep_level: int = 1,
    ) -> None:
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            prepare_cpu_environment(cpu_kvcache_gib)
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level}: vLLM's levels are 1 (keep a host copy of the weights) "
                             f"and 2 (drop them)")
        # the engine core in this process: collective_rpc hands the worker live objects (a
        # generator of weights); with external_launcher vLLM requires it anyway
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs = dict(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=True,
        )
        if on_cpu:
            # vLLM 0.32 rewinds a seeded request's generator (set_offset) when a chunked prefill
            # discards its sampled token, and CPU generators refuse that ("CPU Generator does not
            # use offset"): the step fails and its requests are stranded. Whole-prompt prefills
            # never discard, so prompts are never split on CPU (VLLM-NOTES, the seeded-chunking trap).
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
        else:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(lora_rank), max_loras=1)
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self._sleep_enabled = enable_sleep_mode and not on_cpu
        self._sleep_level = sleep_level
        self._weights_dropped = False  # level-2 sleep dropped the weights; a load_weights brings them back
        self._lora_enabled = lora_rank is not None
        self.llm = LLM(**kwargs)
        self._engine = self.llm.llm_engine
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
        try:
            outputs = self._engine.step()
        except Exception as err:  # the engine core is gone: nothing pending will come back
            raise EngineError(f"vllm engine step failed with {len(self._pending)} requests pending: {err!r}") from err
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
            self._engine.abort_request(ids)
            self._pending.difference_update(ids)

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep or self._weights_dropped:
            raise EngineError("vllm engine is asleep or its weights were dropped: no probe possible")
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
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
            self._engine.remove_lora(self._lora.lora_int_id)
            self._lora = None
        self._engine.reset_prefix_cache()
        if adapter is None:
            return SyncReport(tensor_count=0, checksum=0.0)
        lora_id = adapter.version + 1  # ids must be positive and new for every version
        request = LoRARequest(f"{adapter.name}-v{adapter.version}", lora_id, adapter.folder)
        if not self._engine.add_lora(request):
            raise EngineError(f"vllm refused the adapter {adapter.folder}")
        self._lora = request
        held = self.llm.collective_rpc(_held_lora, args=(lora_id,))
        count, checksum = held[0]
        return SyncReport(tensor_count=count, checksum=checksum, extra={"lora_int_id": lora_id})

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        """Every base weight of one sync (a stream, consumed once, in one reload; see
        ``_reload_weights``). The iterator reaches the worker as it is: this engine runs its
        worker in this process (in-process engine core on CPU, ``external_launcher`` on GPUs)."""
        if self._asleep:
            raise EngineError("vllm engine is asleep: wake_up() before loading weights")
        held = self.llm.collective_rpc(_reload_weights, args=(weights,))
        self._engine.reset_prefix_cache()
        count, checksum = held[0]
        self._weights_dropped = False
        return SyncReport(tensor_count=count, checksum=checksum)

    # -- memory ---------------------------------------------------------------------------

    @property
    def sleeps(self) -> bool:
        """True where ``sleep`` frees memory (GPUs with ``enable_sleep_mode``)."""
        return self._sleep_enabled

    def sleep(self) -> None:
        """Free the weights and the KV cache (module doc); a no-op without sleep mode."""
        if self._sleep_enabled and not self._asleep:
            self.llm.sleep(level=self._sleep_level)
            self._asleep = True
            self._weights_dropped = self._sleep_level == 2

    def wake_up(self) -> None:
        """Map the engine's memory again (after returning PyTorch's cached blocks, module doc)."""
        if self._asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        if self._pending:
            self.abort(list(self._pending))
        self.llm = None
        self._engine = None
