"""A transformers reference engine: plain, slow, obviously right. Tests check vLLM against it.

It decodes one request at a time with a KV cache, greedy or sampled with a ``torch.Generator``
seeded by the request's seed, and reports the log-prob of each chosen token under
``log_softmax(logits / temperature)`` (the distribution sampled from). Top-p/top-k are not
supported (the reference has no use for them) and are refused rather than ignored.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Optional

import torch

from atlas_lightning.rollout.digest import WeightDigest, digest_named
from atlas_lightning.rollout.engine import (
    AdapterVersion,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SyncReport,
)


class HFEngine(Engine):
    """Serves ``model`` (a causal LM, optionally a ``PeftModel``) in this process."""

    name = "hf"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self._queue: deque[GenerationRequest] = deque()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab_size = int(head.weight.shape[0]) if getattr(head, "weight", None) is not None else None

    def submit(self, request: GenerationRequest) -> None:
        spec = request.sampling
        if spec.top_p < 1.0 or spec.top_k > 0:
            raise EngineError("the hf reference engine supports neither top_p nor top_k")
        self._queue.append(request)

    def num_pending(self) -> int:
        return len(self._queue)

    def abort(self, request_ids) -> None:
        drop = set(request_ids)
        self._queue = deque(r for r in self._queue if r.request_id not in drop)

    def poll(self) -> list[GenerationResult]:
        if not self._queue:
            return []
        return [self._decode(self._queue.popleft())]

    @torch.no_grad()
    def _decode(self, request: GenerationRequest) -> GenerationResult:
        spec = request.sampling
        device = next(self.model.parameters()).device
        generator = torch.Generator(device="cpu")
        generator.manual_seed(spec.seed if spec.seed is not None else 0)
        ids = torch.tensor([list(request.prompt_ids)], device=device)
        past = None
        tokens: list[int] = []
        logprobs: list[float] = []
        reason = "length"
        for _ in range(spec.max_tokens):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            if spec.temperature > 0:
                logp = torch.log_softmax(logits / spec.temperature, dim=-1)
                token = int(torch.multinomial(logp.exp().cpu(), 1, generator=generator))
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = int(torch.argmax(logp))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            if token in spec.stop_token_ids:
                reason = "stop"
                break
            ids = torch.tensor([[token]], device=device)
        return GenerationResult(request.request_id, tokens, logprobs, reason)

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        device = next(self.model.parameters()).device
        logits = self.model(input_ids=torch.tensor([token_ids], device=device)).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        return logp.gather(-1, torch.tensor(token_ids[1:], device=device)[:, None])[:, 0].tolist()

    def set_adapter(self, adapter: Optional[AdapterVersion]) -> SyncReport:
        """Serve a PEFT folder on top of this engine's base (None: the bare base)."""
        from peft import PeftModel

        from atlas_lightning.rollout.digest import lora_digest

        if isinstance(self.model, PeftModel):
            self.model = self.model.unload()
        if adapter is None:
            self.model.eval()
            return SyncReport(tensor_count=0, digest=WeightDigest(), form={"kind": "lora"})
        self.model = PeftModel.from_pretrained(self.model, adapter.folder).eval()
        modules = {name: (m.lora_A["default"].weight, m.lora_B["default"].weight, m.scaling["default"])
                   for name, m in self.model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
        digest = lora_digest(modules)  # peft keeps the scaling apart from B
        dtype = str(next(iter(modules.values()))[0].dtype).removeprefix("torch.") if modules else None
        return SyncReport(tensor_count=len(digest), digest=digest, held="held by the peft model",
                          form={"kind": "lora", "dtype": dtype, "scale_b": False})

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        state = dict(weights)
        missing = [name for name in state if name not in dict(self.model.named_parameters())]
        if missing:
            raise EngineError(f"hf engine: unknown weight names {missing[:3]}")
        self.model.load_state_dict(state, strict=False)
        held = dict(self.model.named_parameters())
        digest = digest_named((name, held[name]) for name in state)  # read back from the model
        return SyncReport(tensor_count=len(state), digest=digest, held="held by the model", form={"kind": "tensors"})
