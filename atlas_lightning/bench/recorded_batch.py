"""A batch ``fit`` trained on, read back from its step folder, for the batch benchmark to replay.

``fit`` writes each training step's trajectories under ``artifacts/<name>/train/step_N/``
(README, "On-disk layout"): ``tensors.npz`` holds every trajectory's ``prompt_ids``,
``response_ids`` and ``response_mask``, and ``artifacts/<name>/run.json`` the resolved config.
``read_recorded_batch(step_folder)`` returns what that step's actor update computed on one card:

* the sequences (prompt + response token ids) in the records' order, the order
  ``PPOModule._sequences`` packs them in, with their prompt lengths and loss masks (1 on generated
  tokens, 0 on tool responses);
* the update's shape from the run's config: ``algorithm.ppo_epochs`` passes over
  ``train_batch_size // ppo_mini_batch_size`` mini-batches (contiguous chunks, as
  ``PPOModule._update`` cuts them), micro-batches of at most ``ppo_max_token_len_per_gpu`` tokens;
* the run's model keys that decide what the update computes and with which kernels
  (``MODEL_KEYS``: LoRA, dtype, head dtype, kernels, layout), for the benchmark's model build.

A run of several ranks gathered every rank's records in rank order; the first ``1 / world_size``
of them (rank 0's share where the ranks held equal shares) is what one card updated.

Bad input (no ``tensors.npz``, an array missing, no ``run.json`` two folders up or a key missing
in it) raises ``RecordedBatchError`` naming the file and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from atlas_lightning.errors import quoted
from atlas_lightning.store.records import TENSORS_NAME, RecordError, read_step_tensors

#: the run's config keys the update's shape is read from (``algorithm.<key>``)
SHAPE_KEYS = ("train_batch_size", "ppo_mini_batch_size", "ppo_epochs", "ppo_max_token_len_per_gpu")
#: the run's ``model.<key>`` values the benchmark's model is built with: what the update computes
#: and with which kernels (its weights, folder and recomputation are the benchmark's own)
MODEL_KEYS = ("dtype", "lora", "critic_lora", "gradient_checkpointing", "logprob_chunk_tokens", "head_dtype",
              "attn_implementation", "sequence_layout", "linear_attention_kernel", "elementwise_kernels",
              "attention_length_bucket", "fused_lora", "lean_activations")
#: what the run's model resolved ``auto`` to (``ActorCritic.resolved_keys``) that a replay must
#: match to run the step's kernels (its recompute plan is the benchmark's own, sized for its card)
RESOLVED_KEYS = ("elementwise_kernels", "linear_attention_kernel", "attention_length_bucket")


class RecordedBatchError(ValueError):
    """A step folder the benchmark cannot replay; the message names the file and what is wrong."""


@dataclass(frozen=True)
class RecordedBatch:
    """One card's share of a training step's batch and its update's shape (module doc)."""

    source: str
    sequences: list[np.ndarray]  # int64 token ids, prompt + response
    prompt_lengths: list[int]
    response_masks: list[np.ndarray]  # 1 on generated tokens, 0 on tool responses
    mini_batches: int
    epochs: int
    budget: int
    world_size: int
    model_keys: dict
    #: what rank 0's model resolved its ``auto`` keys to in the run (``run.json``'s rank entry,
    #: ``ActorCritic.resolved_keys``); None where the run did not record it
    resolved: Optional[dict] = None

    def differs_from(self, resolved: dict) -> dict[str, tuple]:
        """The keys a model built here resolved otherwise than the run's (``{key: (here, run's)}``;
        empty where they agree or the run recorded none): a replay on another card or with
        ``--elementwise-kernels`` may run other kernels than the step did."""
        run = self.resolved or {}
        return {key: (resolved.get(key), run[key]) for key in RESOLVED_KEYS
                if key in run and resolved.get(key) != run[key]}

    @property
    def largest_token_id(self) -> int:
        return max(int(s.max()) for s in self.sequences)

    def mini_batch_indices(self) -> list[list[int]]:
        """The contiguous chunks ``PPOModule._update`` updates one after the other."""
        from atlas_lightning.ppo.module import _contiguous_chunks

        return _contiguous_chunks(len(self.sequences), self.mini_batches)


def _run_settings(run_json: Path) -> tuple[dict[str, int], int, dict, Optional[dict]]:
    """``(algorithm keys of SHAPE_KEYS, world size, model keys of MODEL_KEYS, rank 0's resolved
    model keys or None)`` from the run's ``run.json``."""
    try:
        run = json.loads(run_json.read_text())
    except FileNotFoundError:
        raise RecordedBatchError(f"{run_json}: not found (a step folder of `fit` sits in artifacts/<name>/train/, "
                                 f"beside the run's run.json)") from None
    except (OSError, ValueError) as err:
        raise RecordedBatchError(f"{run_json}: cannot be read ({quoted(str(err))})") from None
    algorithm = ((run.get("config") or {}).get("algorithm") or {}) if isinstance(run, dict) else {}
    missing = [key for key in SHAPE_KEYS if not isinstance(algorithm.get(key), int) or algorithm[key] < 1]
    if missing:
        raise RecordedBatchError(f"{run_json}: config.algorithm lacks a positive whole {', '.join(missing)}")
    world = (run.get("hosts") or {}).get("world_size", 1)
    if not isinstance(world, int) or world < 1:
        raise RecordedBatchError(f"{run_json}: hosts.world_size is {world!r}, not a positive whole number")
    if algorithm["train_batch_size"] % algorithm["ppo_mini_batch_size"]:  # fit refuses such a run
        raise RecordedBatchError(f"{run_json}: config.algorithm.ppo_mini_batch_size {algorithm['ppo_mini_batch_size']} "
                                 f"does not divide train_batch_size {algorithm['train_batch_size']}")
    model = (run.get("config") or {}).get("model") or {}
    absent = [key for key in MODEL_KEYS if key not in model]
    if absent:
        raise RecordedBatchError(f"{run_json}: config.model lacks {', '.join(absent)}")
    ranks = (run.get("hosts") or {}).get("ranks") or [{}]
    resolved = ranks[0].get("model") if isinstance(ranks[0], dict) else None
    return ({key: algorithm[key] for key in SHAPE_KEYS}, world, {key: model[key] for key in MODEL_KEYS},
            resolved if isinstance(resolved, dict) else None)


def read_recorded_batch(step_folder: str | Path) -> RecordedBatch:
    """The batch of ``step_folder`` (``artifacts/<name>/train/step_N``) as one card updated it."""
    folder = Path(step_folder)
    tensors_path = folder / TENSORS_NAME
    if not tensors_path.is_file():
        raise RecordedBatchError(f"{tensors_path}: not found (a training step folder `fit` wrote: "
                                 f"artifacts/<name>/train/step_N)")
    try:
        arrays = read_step_tensors(tensors_path)
    except RecordError as err:
        raise RecordedBatchError(str(err)) from None
    missing = [name for name in ("prompt_ids", "response_ids", "response_mask") if name not in arrays]
    if missing:
        raise RecordedBatchError(f"{tensors_path}: holds no {', '.join(missing)}")
    shape, world, model_keys, resolved = _run_settings(folder.parent.parent / "run.json")
    count = len(arrays["uid"]) // world
    if count < 1:
        raise RecordedBatchError(f"{tensors_path}: {len(arrays['uid'])} trajectories for {world} ranks")
    prompts, responses, masks = (arrays[name][:count] for name in ("prompt_ids", "response_ids", "response_mask"))
    for i, (response, mask) in enumerate(zip(responses, masks)):
        if len(response) != len(mask) or len(response) == 0:
            raise RecordedBatchError(f"{tensors_path}: trajectory {arrays['uid'][i]}/{arrays['session_id'][i]} has "
                                     f"{len(response)} response tokens and a mask of {len(mask)}")
    return RecordedBatch(
        source=str(folder),
        sequences=[np.concatenate([p, r]).astype(np.int64) for p, r in zip(prompts, responses)],
        prompt_lengths=[len(p) for p in prompts],
        response_masks=[np.asarray(m, dtype=np.float32) for m in masks],
        mini_batches=shape["train_batch_size"] // shape["ppo_mini_batch_size"],
        epochs=shape["ppo_epochs"], budget=shape["ppo_max_token_len_per_gpu"], world_size=world,
        model_keys=model_keys, resolved=resolved,
    )
