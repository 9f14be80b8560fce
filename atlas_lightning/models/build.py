"""The one builder of the trained model: ``build_actor_critic`` (the base placed on the training
device, ``ActorCritic`` from the ``model`` config group around it, then its starting adapters).

One path: ``fit`` and memory-check (``PPOModule.configure_model``) and the benchmarks
(``bench/update.OursRunner``: the update, sweep and batch benchmarks) all build through it, with
the same dtype, attention, kernels, placement and LoRA wrapping; a benchmark only swaps the
checkpoint folder for random weights of a shape (``random_base``).

Placement: the base is read straight onto ``device``, the card this process trains on
(``configure_model`` passes ``trainer.strategy.root_device``: ``cuda:LOCAL_RANK`` under
``ModelParallelStrategy``, the CPU in tests), with ``device_map={"": device}`` (safetensors
file by file onto the card, no host copy), every rank the whole base; ``sharding.shard`` (FSDP2)
then keeps each rank's 1/N of every tensor and frees the rest. So:

* every ``auto`` kernel choice (``model.elementwise_kernels``, ``model.attention_length_bucket``,
  ``model.linear_attention_kernel``) resolves for the card that trains, and an explicit
  ``liger``/``fla`` is checked there (``ActorCritic`` resolves them for the base's device);
* for one moment each card holds the whole bf16 base: 16 GB for an 8B, 54 GB (50.3 GiB) for
  Qwen3.6-27B, whatever the number of ranks. A colocated engine is built first (the data
  module's ``setup``); where it sleeps for updates it sleeps through the build too
  (``PPOModule.configure_model``), so the card holds the base, both adapters and the sleeping
  engine's ~1.5 GiB: an 80 GB card holds it, a 141 GB H200 easily. An engine without sleep mode
  keeps its budget: at ``gpu_memory_utilization=0.55`` that is 77 + 50 GiB of an H200's 140
  (fits, not by much) and more than an 80 GB card. ``plan`` sizes this moment (its
  ``model_build`` phase) and refuses a card that cannot hold it;
* host memory holds no copy (8 ranks each loading the base into RAM would need 432 GB for the
  27B); the files pass through the page cache once for all ranks of a host.

Why not the meta device: building on ``meta``, sharding, then reading each rank's rows of each
tensor would peak at 1/N of the base, but needs a loader of our own for transformers' checkpoint
conversions (Qwen3.5's ``model.language_model.*`` names and the like) and LoRA and value head
initialised after materialisation. That is the way for a base that does not fit one card (or
not beside an engine that cannot sleep); the report's 27B fits 80 GB cards and H200s.

Who calls it: ``PPOModule.configure_model`` (which shards the result under FSDP2), the
benchmarks (``bench/update.py``), tests.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from . import attention  # noqa: F401  (registers sdpa_varlen before a base asks for it)
from atlas_lightning.errors import InputError, first_line

from .actor_critic import ACTOR, CRITIC, ActorCritic
from .adapters import AdapterMismatchError, adapter_lora_config, load_adapter


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` (only the three float types)."""
    allowed = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if isinstance(dtype, torch.dtype) and dtype in allowed.values():
        return dtype
    if isinstance(dtype, str) and dtype in allowed:
        return allowed[dtype]
    raise ValueError(f"dtype={dtype!r} is not one of {', '.join(allowed)}")


def causal_lm_config(path: str | Path):
    """The configuration ``AutoModelForCausalLM`` builds from ``path``'s ``config.json``, read with
    transformers' own config class for its ``model_type``: for an image-text checkpoint whose
    causal-LM class is the text model's (Qwen3.5/3.6's ``Qwen3_5ForConditionalGeneration``) the
    text model's part, as ``AutoModelForCausalLM`` takes it.

    Why not ``AutoConfig``: an in-process vLLM registers its own config classes for some model
    types (``qwen3_5`` among them) with ``AutoConfig``. ``AutoModelForCausalLM`` then matches the
    causal-LM class by the class's name, does not recognise vLLM's text sub-config as that class's
    own and builds the text model from the whole image-text config ("'Qwen3_5Config' object has
    no attribute 'vocab_size'"). Seen on the H200 with vLLM 0.26 and transformers 5.17: ``fit``
    builds the engine before the trainer. A model type transformers does not know (remote code)
    goes to ``AutoConfig`` as before."""
    import transformers
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_dict, _ = PretrainedConfig.get_config_dict(str(path))
    class_name = CONFIG_MAPPING_NAMES.get(config_dict.get("model_type", ""))
    config_class = getattr(transformers, class_name, None) if class_name else None
    config = (config_class or AutoConfig).from_pretrained(str(path))
    # the text part exactly where AutoModelForCausalLM itself would take it: its class for this
    # config is built from the text sub-config (a model type it maps to an image-text class keeps all)
    text_class = getattr(config, "sub_configs", {}).get("text_config")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
    if text_class is not None and getattr(model_class, "config_class", None) is text_class:
        return config.get_text_config()
    return config


def load_base(model_cfg: Any, device: str | torch.device | None = None, *, random_base: Any = None,
              seed: int = 0) -> nn.Module:
    """The transformers causal LM of ``model_cfg`` (its ``path``, ``dtype`` and
    ``attn_implementation``) on ``device`` (None: the CPU), ``use_cache`` off (module doc,
    "Placement"). ``random_base``: a transformers config to build instead of reading ``path``,
    with transformers' own random initialisation run on ``device`` after ``torch.manual_seed(seed)``
    (same config and seed, same weights). Raises ``FileNotFoundError`` for a missing folder and
    ``ValueError`` for an unknown dtype."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else torch.device("cpu")
    options = {"dtype": torch_dtype(model_cfg.dtype), "attn_implementation": model_cfg.attn_implementation}
    if random_base is not None:
        torch.manual_seed(seed)
        with torch.device(device):
            base = AutoModelForCausalLM.from_config(random_base, **options)
    else:
        path = str(model_cfg.path)
        if not Path(path).is_dir():
            raise FileNotFoundError(f"base model folder {path} does not exist (a local folder, never a hub id)")
        # on the CPU nothing to place: no device map, exactly the load the CPU figures were made with
        placed = {"device_map": {"": device}} if device.type != "cpu" else {}
        base, info = AutoModelForCausalLM.from_pretrained(path, config=causal_lm_config(path), **options, **placed,
                                                          output_loading_info=True)
        _refuse_missing(path, info)
    base.config.use_cache = False
    return base


class BaseWeightsError(InputError):
    """A base folder that does not supply every weight its architecture has: those would be left
    at their random initialisation."""


def check_base_weights(path: str | Path, config: Any = None) -> Optional[str]:
    """The folder's weights are exactly the tensors its architecture has, as transformers maps
    checkpoint names onto the model (tied weights and the names its class ignores excepted), read
    on the meta device (no tensor data is read): ``BaseWeightsError`` naming ``model.path`` and
    the tensors otherwise. Refused: a tensor missing (it would train from its random
    initialisation), one of another shape, and one the architecture has no place for (the
    ``config.json`` and the weights disagree, e.g. fewer ``num_hidden_layers`` than the weights
    hold: the engine's loader refuses those, transformers' drops them silently); and a
    ``config.json`` transformers cannot build the model from, whatever its library raises. The
    engine reads the same folder, so this covers both sides; ``load_base`` checks the real load
    again. Returns the base's fingerprint (``identity.folder_fingerprint``; None where it cannot
    be read without loading), for the starting adapters' ``atlas_base.json`` to be checked against.
    ``config``: what ``check_base_config(path)`` returned, where the caller has it (read otherwise)."""
    from .identity import folder_fingerprint

    from transformers import AutoModelForCausalLM

    where = f"model.path={path}"
    config = check_base_config(path) if config is None else config
    try:
        with _quiet_meta_load():
            model, info = AutoModelForCausalLM.from_pretrained(str(path), config=config, device_map="meta",
                                                               ignore_mismatched_sizes=True, output_loading_info=True)
    except Exception as err:  # a config it cannot build a model from (a vocabulary too small for its ids, ...)
        raise BaseWeightsError(f"{where}: transformers cannot build the model its config.json describes from "
                               f"its weights ({first_line(err)})") from None
    _refuse_missing(str(path), info)
    _refuse_untied_copies(str(path), config, model)
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        shown = ", ".join(f"{name} is {list(theirs)} in the weights, {list(ours)} in the model"
                          for name, theirs, ours in mismatched[:3])
        raise BaseWeightsError(f"{where}: {len(mismatched)} tensor(s) of its weight files have another shape than "
                               f"its config.json gives them ({shown}{', ...' if len(mismatched) > 3 else ''}): "
                               f"the weights and the config are of different models")
    unexpected = sorted(name for name in info.get("unexpected_keys") or () if not name.endswith(_IGNORED_BUFFERS))
    if unexpected:
        raise BaseWeightsError(f"{where}: its weight files hold {len(unexpected)} tensor(s) the model its config.json "
                               f"describes has no place for ({', '.join(unexpected[:5])}"
                               f"{', ...' if len(unexpected) > 5 else ''}): the weights and the config disagree "
                               f"(e.g. num_hidden_layers, or a model_type of another family)")
    return folder_fingerprint(model, path)


def _refuse_untied_copies(path: str, config: Any, model: nn.Module) -> None:
    """A config that ties the output head to the embeddings, and weights that hold both with
    other values: transformers then unties them (the head trains from the file's copy), vLLM keeps
    them tied (the head is the embeddings): the trainer and the engine would score with different
    heads. Read only where transformers untied them (both stored)."""
    output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or output is None or output.weight is embeddings.weight:
        return
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.endswith(("lm_head.weight", "embed_tokens.weight")):
                    found[name] = handle.get_tensor(name)
    heads = [name for name in found if name.endswith("lm_head.weight")]
    tables = [name for name in found if name.endswith("embed_tokens.weight")]
    if len(heads) == 1 and len(tables) == 1 and not torch.equal(found[heads[0]], found[tables[0]]):
        raise BaseWeightsError(f"model.path={path}: config.json ties the output head to the embeddings "
                               f"(tie_word_embeddings), but the weights hold {heads[0]} with other values than "
                               f"{tables[0]}: the trainer would use the stored head, the engine the embeddings; "
                               f"set tie_word_embeddings to false, or remove {heads[0]}")


@contextmanager
def _quiet_meta_load():
    """A start-up check's load on the meta device, silent: transformers' load report would print
    the mismatches the check refuses (as a table), its progress bar and its warnings (e.g. the
    tensor-parallel plan's "layers were not sharded") lines before a refusal's one line on stderr."""
    import logging

    from transformers.utils import logging as transformers_logging

    loggers = [logging.getLogger(name) for name in ("transformers", "transformers.modeling_utils")]
    levels, bar = [one.level for one in loggers], transformers_logging.is_progress_bar_enabled()
    for one in loggers:
        one.setLevel(logging.ERROR)
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        for one, level in zip(loggers, levels):
            one.setLevel(level)
        if bar:
            transformers_logging.enable_progress_bar()


def check_base_config(path: str | Path):
    """The transformers config of ``path``'s ``config.json`` (``causal_lm_config``), or
    ``BaseWeightsError`` naming ``model.path`` with what transformers' parse or validation said
    (a field of the wrong type, ``layer_types`` of another length, an unknown ``model_type``)."""
    try:
        return causal_lm_config(path)
    except Exception as err:  # transformers' parse or validation error, whatever its type: named for the user
        raise BaseWeightsError(f"model.path={path}: config.json is not a model config transformers can read "
                               f"({first_line(err)})") from None


#: Buffers older checkpoints saved that both loaders skip (rotary frequencies, recomputed).
_IGNORED_BUFFERS = ("rotary_emb.inv_freq",)


def _refuse_missing(path: str, info: dict) -> None:
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise BaseWeightsError(f"model.path={path}: its weight files lack {len(missing)} tensor(s) the model has "
                               f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): they would train "
                               f"from random values; the folder is incomplete (a shard or tensors left out)")


@contextmanager
def _peft_refusal(folder) -> Iterator[None]:
    """peft's refusal to put ``folder``'s LoRA on this base (a ``target_modules`` that matches no
    module: ``ValueError``) as an ``AdapterMismatchError`` naming the folder's config file."""
    try:
        yield
    except ValueError as err:
        raise AdapterMismatchError(f"{folder}: adapter_config.json does not fit this base model: "
                                   f"{first_line(err)}") from None


def check_starting_adapters(model_cfg: Any, folders: dict) -> None:
    """Each starting adapter (``{role: adapters.AdapterFolder}``, read) checked as
    ``build_actor_critic`` checks it when it loads it (``adapters.check_adapter_tensors``: LoRA
    fields, adapted modules, every tensor's name and shape, the value head), against the same
    peft model built on the meta device (no value is read or made), so that what the build would
    refuse after the run's files are written is refused before. The bases' identities are
    compared by ``run/facts.py`` from the files. ``AdapterMismatchError`` naming the folder."""
    from types import SimpleNamespace

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from .actor_critic import peft_lora_config
    from .adapter_switch import tuner_layers
    from .adapters import check_adapter_tensors
    from .checkpoint_names import name_map

    if not folders:
        return
    path = str(model_cfg.path)
    with _quiet_meta_load():
        base = AutoModelForCausalLM.from_pretrained(path, config=causal_lm_config(path), device_map="meta")
    names, _ = name_map(base, path)
    roles = list(folders)
    with _peft_refusal(folders[roles[0]].folder):
        peft_model = get_peft_model(base, peft_lora_config(adapter_lora_config(folders[roles[0]].folder)),
                                    adapter_name=roles[0])
    for role in roles[1:]:
        with _peft_refusal(folders[role].folder):
            peft_model.add_adapter(role, peft_lora_config(adapter_lora_config(folders[role].folder)))
    hidden = base.get_output_embeddings().weight.shape[1]
    meta = SimpleNamespace(peft_model=peft_model, checkpoint_names=names, _tuner_layers=tuner_layers(peft_model),
                           value_head=nn.Linear(hidden, 1, dtype=torch.float32, device="meta"))
    meta.adapter_parameters = lambda role: ActorCritic.adapter_parameters(meta, role)
    for role, data in folders.items():
        check_adapter_tensors(meta, role, data)


def build_actor_critic(model_cfg: Any, *, seed: int = 0, actor_adapter: Optional[str] = None,
                       critic_adapter: Optional[str] = None, device: str | torch.device | None = None,
                       random_base: Any = None) -> ActorCritic:
    """``ActorCritic`` from ``model_cfg`` (``config.ModelConfig`` or its OmegaConf node) on
    ``device`` (module doc), adapters initialised from ``seed``; then the starting adapters:
    ``actor_adapter`` / ``critic_adapter`` (PEFT folders), else ``model_cfg.actor_adapter`` /
    ``critic_adapter``. ``random_base``: random weights of that transformers config instead of
    ``model_cfg.path`` (``load_base``; the benchmarks).

    Each adapter has its own LoRA shape: an adapter that starts from a folder is built with the
    LoRA that folder's ``adapter_config.json`` describes (rank, alpha, target modules, per-module
    patterns: ``adapter_lora_config``), whatever ``model_cfg.lora`` says; a fresh one with
    ``model_cfg.lora`` (actor) or ``model_cfg.critic_lora``'s fields over it (critic;
    ``store.lora_shapes.fresh_lora_spec``). The folders' tensors are then checked against this
    base and loaded (``adapters.load_adapter``).
    Unsharded: the caller shards it (``sharding.shard``)."""
    from atlas_lightning.store.lora_shapes import fresh_lora_spec

    folders = {ACTOR: actor_adapter or model_cfg.actor_adapter, CRITIC: critic_adapter or model_cfg.critic_adapter}
    lora = {role: adapter_lora_config(folder) if folder else fresh_lora_spec(model_cfg, role)
            for role, folder in folders.items()}
    base = load_base(model_cfg, device, random_base=random_base, seed=seed)
    model = ActorCritic(model_cfg, base, lora, seed=seed)
    for role, folder in folders.items():
        if folder:
            load_adapter(model, role, folder)
    return model
