"""Adapter folders: save a run's adapter as a PEFT folder, start an adapter from one.

A saved folder (``global_step_N/actor/lora_adapter/``, README, "On-disk layout"):

* ``adapter_config.json`` and ``adapter_model.safetensors``: exactly what
  ``PeftModel.from_pretrained(base, folder)`` loads (keys without the adapter name,
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``);
* ``value_head.safetensors`` (critic only): ``weight (1, H)`` and ``bias (1,)``, fp32;
  peft ignores it;
* ``atlas_base.json``: the identity of the base it was trained on (``identity.py``).

Saving is atomic: the folder is written complete under a temporary name beside the target
and renamed into place (an existing folder is moved aside first and removed after, so a
reader sees the old folder or the new one, never a half-written one). Under FSDP2 the
tensors are gathered whole (a collective every rank calls) and rank 0 alone writes; all
ranks leave together (barrier).

Starting from a folder: the model builder gives each adapter the LoRA its folder describes
(``adapter_lora_config``: rank, alpha, target modules, per-module patterns), so actor and
critic may differ. Folders as other trainers write them are taken as they are: tensor names in
the base checkpoint's own naming (a Qwen3.5/3.6 checkpoint's ``model.language_model.layers``,
where transformers loads ``model.layers``) are renamed through the base's name map
(``checkpoint_names.py``), and a critic whose value head was saved inside
``adapter_model.safetensors`` as a peft ``modules_to_save`` module (a ``(1, hidden)`` weight and
a ``(1,)`` bias, e.g. ``base_model.model.score``) gets its head from there when the folder has
no ``value_head.safetensors`` (``check_adapter_fits``).

Loading first checks a folder against what it says it is (``read_adapter_folder``): every
file readable and whole (an empty or truncated safetensors, an invalid ``adapter_config.json``
or a damaged ``atlas_base.json`` is an ``AdapterError`` naming the folder and the file), every
weight finite, and its role: ``atlas_base.json`` names the adapter it holds, and a folder with
a value head is a critic's, never loaded as the actor. Then it refuses, naming the folder and
the field, an adapter whose base differs (config shape fields, then the weights fingerprint;
folders from elsewhere without ``atlas_base.json`` are checked by tensor shapes alone, with a
warning), whose rank, alpha or other LoRA hyper-parameters differ, or whose set of adapted
modules differs (``check_adapter_fits``, also what a resume checks before Lightning's state
is loaded).

Who calls it: checkpointing (save; the step checkpoint copies both adapters to the host at the
step's end, into ``HostBuffers`` it keeps for the run, and writes the copies later:
``copy_adapters``, ``write_adapter_copies``), the weight sync (the actor for the engines,
``save_adapter``: new host copies of its own, since it runs while a checkpoint write may still
read the step checkpoint's), run start from another run's step (load), resume
(``read_adapter_folder`` + ``check_adapter_fits`` on the checkpoint's adapters).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from atlas_lightning.distributed import broadcast_object
from atlas_lightning.errors import quoted
from atlas_lightning.store.files import read_json_object
from atlas_lightning.store.lora_shapes import CONFIG_FILE, AdapterError, read_adapter_config, shape_from_adapter_config

from .actor_critic import ADAPTERS, CRITIC, ActorCritic
from .identity import identity_mismatch
from .weights import adapter_state, full_tensor

log = logging.getLogger(__name__)

WEIGHTS_FILE = "adapter_model.safetensors"
VALUE_HEAD_FILE = "value_head.safetensors"
BASE_FILE = "atlas_base.json"

#: LoRA hyper-parameters that must agree between a folder and the adapter it starts.
COMPARED_FIELDS = (
    "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias", "rank_pattern", "alpha_pattern",
)


class AdapterMismatchError(AdapterError):
    """A folder's adapter cannot start this model's adapter; the message names folder and field."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class AdapterCopy:
    """One adapter as its PEFT folder will hold it, on the host: its tensors (copies: later
    updates of the model do not change them), its config and its base's identity. Written by
    ``write_adapter_copy`` from any thread, with no collective."""

    name: str
    config: Any
    state: dict[str, Tensor]
    value_head: Optional[dict[str, Tensor]]
    identity: dict


class HostBuffers:
    """Host tensors kept by name from one copy to the next, so that a copy made at every step (the
    step checkpoint's adapters) reuses its host memory instead of allocating it again. Under FSDP2
    the adapters are gathered into new tensors at every copy, so a cache keyed by the source's
    storage (torch's ``StateDictStager``) would miss every time: these are keyed by name.

    ``pinned`` (the model on CUDA): page-locked, and the device-to-host copies are queued without
    waiting (``non_blocking``); they are complete once ``synchronize`` has returned. Copying again
    overwrites the previous copies: whoever passes the buffers must be done reading them first
    (``StepCheckpoint`` is: it waits for the previous write before it stages). They stay
    allocated, the size of what was copied into them, until ``clear``."""

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned
        self._buffers: dict[str, Tensor] = {}

    def copy(self, name: str, tensor: Tensor) -> Tensor:
        """``tensor`` copied into the buffer ``name`` (made, or made again, to its shape and dtype)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pinned)
            self._buffers[name] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=self.pinned)

    def synchronize(self) -> None:
        """Wait for the copies ``copy`` queued (pinned buffers only: the others were made at once)."""
        if self.pinned:
            torch.cuda.synchronize()

    def clear(self) -> None:
        """Drop the buffers (copies handed out stay valid while referenced)."""
        self._buffers.clear()


def copy_adapter(model: ActorCritic, adapter_name: str, keep: bool = True, *,
                 checkpoint_names: bool = False, into: Optional[HostBuffers] = None,
                 state: Optional[dict[str, Tensor]] = None) -> Optional[AdapterCopy]:
    """``adapter_name`` (and, for the critic, the value head) copied to the host. Collective
    under FSDP2 (all ranks call: the tensors are gathered whole); None where ``keep`` is False
    (the ranks that write nothing). ``checkpoint_names``: see ``save_adapter``. ``into``: host
    buffers reused from an earlier copy (``HostBuffers``; read the copies after its
    ``synchronize``), else new host tensors, complete on return. ``state``: the adapter's
    ``weights.adapter_state``, when the caller has already gathered it (not gathered again)."""
    from .checkpoint_names import lora_key_in_checkpoint_names

    if adapter_name not in ADAPTERS:
        raise ValueError(f"adapter_name={adapter_name!r} is not one of {', '.join(ADAPTERS)}")
    if state is None:
        state = adapter_state(model, adapter_name)
    if checkpoint_names and model.checkpoint_names:
        state = {lora_key_in_checkpoint_names(k, model.checkpoint_names): v for k, v in state.items()}
    value_head = None
    if adapter_name == CRITIC:
        with torch.no_grad():
            value_head = {n: full_tensor(p.detach()).clone() for n, p in model.value_head.named_parameters()}
    if not keep:
        return None
    return AdapterCopy(name=adapter_name, config=_saved_config(model, adapter_name),
                       state=_on_host(state, f"{adapter_name}/", into),
                       value_head=None if value_head is None else _on_host(value_head, f"{adapter_name}/head/", into),
                       identity={**model.base_identity, "adapter_name": adapter_name, "base_path": model.base_path})


def _on_host(tensors: dict[str, Tensor], prefix: str, into: Optional[HostBuffers]) -> dict[str, Tensor]:
    """``tensors`` on the host: in ``into``'s buffers ``prefix + name``, or new tensors."""
    if into is None:
        return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return {k: into.copy(prefix + k, v) for k, v in tensors.items()}


def copy_adapters(model: ActorCritic, into: Optional[HostBuffers] = None) -> list[AdapterCopy]:
    """Both adapters copied to the host (``copy_adapter``) on rank 0, ``[]`` on the other ranks,
    complete on return (``into``: copied into its buffers, then one ``synchronize``). Collective
    under FSDP2."""
    copies = [copy_adapter(model, name, keep=_rank() == 0, into=into) for name in ADAPTERS]
    if into is not None:
        into.synchronize()
    return [c for c in copies if c is not None]


def write_adapter_copies(copies: list[AdapterCopy], step_dir: str | Path) -> None:
    """``step_dir/<name>/lora_adapter`` for each of ``copies`` (``write_adapter_copy``)."""
    for copy_ in copies:
        write_adapter_copy(copy_, Path(step_dir) / copy_.name / "lora_adapter")


def save_adapter(model: ActorCritic, adapter_name: str, folder: str | Path, *, checkpoint_names: bool = False,
                 into: Optional[HostBuffers] = None, state: Optional[dict[str, Tensor]] = None) -> Path:
    """Write ``adapter_name`` (and, for the critic, the value head) as a PEFT folder at
    ``folder``, atomically. Collective under FSDP2 (all ranks call; rank 0 writes).
    ``checkpoint_names``: tensor keys in the base checkpoint's naming
    (``checkpoint_names.lora_key_in_checkpoint_names``; what vLLM applies to a Qwen3.5/3.6
    checkpoint), else as the model is loaded (what ``PeftModel.from_pretrained`` over
    ``AutoModelForCausalLM`` reads). ``into``: host buffers kept from an earlier save
    (``HostBuffers``: the folder is written from them, so nothing may read them in between), else
    new host tensors. ``state``: see ``copy_adapter``."""
    folder = Path(folder)
    copied = copy_adapter(model, adapter_name, keep=_rank() == 0, checkpoint_names=checkpoint_names, into=into,
                          state=state)
    if into is not None:
        into.synchronize()
    failure: BaseException | None = None
    if copied is not None:
        try:
            write_adapter_copy(copied, folder)
        except BaseException as err:  # re-raised below, after the other ranks have heard of it
            failure = err
    # every rank leaves together, and all of them fail if rank 0 could not write
    message = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"save_adapter({adapter_name!r}, {folder}) failed on rank 0: {message}")
    return folder


def save_adapters(model: ActorCritic, step_dir: str | Path) -> None:
    """Both adapters as ``step_dir/{actor,critic}/lora_adapter`` (``save_adapter`` each): a
    checkpoint's adapters. Collective under FSDP2 (all ranks call; rank 0 writes)."""
    for name in ADAPTERS:
        save_adapter(model, name, Path(step_dir) / name / "lora_adapter")


def write_adapter_copy(copied: AdapterCopy, folder: str | Path) -> Path:
    """``copied`` as a PEFT folder at ``folder``, atomically (written under a temporary name beside
    it, then renamed into place). No collective: one process writes."""
    from safetensors.torch import save_file

    from atlas_lightning.store.atomic import give_ordinary_modes

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        copied.config.save_pretrained(str(tmp))
        save_file(copied.state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if copied.value_head is not None:
            save_file(copied.value_head, str(tmp / VALUE_HEAD_FILE), metadata={"format": "pt"})
        (tmp / BASE_FILE).write_text(json.dumps(copied.identity, indent=2) + "\n")
        give_ordinary_modes(tmp)  # save_file's files are 0o600
        _replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _saved_config(model: ActorCritic, adapter_name: str):
    config = copy.deepcopy(model.peft_model.peft_config[adapter_name])
    config.inference_mode = True
    config.base_model_name_or_path = model.base_path
    return config


def _replace_folder(tmp: Path, folder: Path) -> None:
    if not folder.exists():
        os.replace(tmp, folder)
        return
    old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def adapter_lora_config(folder: str | Path):
    """The ``peft.LoraConfig`` an adapter starting from the PEFT folder ``folder`` is built with:
    its ``adapter_config.json`` as it is, made trainable (``inference_mode`` off) and without
    ``modules_to_save`` (a value head saved there is the critic's head, taken by
    ``load_adapter``; the task type is set by the builder). ``FileNotFoundError`` or
    ``AdapterMismatchError`` naming the folder."""
    from peft import LoraConfig

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    saved = json.loads((folder / CONFIG_FILE).read_text())
    if saved.get("peft_type", "LORA") != "LORA":
        raise AdapterMismatchError(f"{folder}: peft_type={saved.get('peft_type')!r}, expected 'LORA'")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except (TypeError, ValueError) as err:
        raise AdapterMismatchError(f"{folder}: {CONFIG_FILE} is not a LoRA config this peft reads "
                                   f"({quoted(str(err))})") from None
    config.inference_mode = False
    config.modules_to_save = None
    return config


def _adapted_modules(keys) -> set[str]:
    """Module paths that carry LoRA factors, from PEFT-style keys (``...q_proj.lora_A.weight``)."""
    return {key.split(".lora_")[0] for key in keys if ".lora_" in key}


@dataclass
class AdapterFolder:
    """What a PEFT folder holds, read and checked on its own terms (``read_adapter_folder``)."""

    folder: Path
    config: dict
    tensors: dict[str, Tensor]
    value_head: Optional[dict[str, Tensor]]
    #: ``atlas_base.json`` (None for folders written elsewhere).
    identity: Optional[dict]


def _safetensors(folder: Path, name: str) -> dict[str, Tensor]:
    """Every tensor of ``folder/name``; ``AdapterError`` naming the folder and the file when it is
    empty, truncated or not a safetensors file, holds no tensor, or holds a NaN or inf."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .finite_values import nonfinite_counts

    path = folder / name
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        size = path.stat().st_size if path.exists() else 0
        raise AdapterError(f"{folder}: {name} is not a readable safetensors file ({size} bytes; "
                           f"{type(err).__name__}: {err}); the folder is damaged or was copied in part") from None
    if not tensors:
        raise AdapterError(f"{folder}: {name} holds no tensors")
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterError(f"{folder}: {name} tensor {key} is {tensor.dtype}, not a floating-point weight")
        if tensor.element_size() < 2:  # 8-bit floats are quantized values, meaningless without their scales
            raise AdapterError(f"{folder}: {name} tensor {key} is {tensor.dtype}, a quantized type: an adapter's "
                               f"weights are 16- or 32-bit floating point")
        bad = sum(nonfinite_counts(tensor))
        if bad:
            raise AdapterError(f"{folder}: {name} tensor {key} holds {bad} non-finite value(s) of "
                               f"{tensor.numel()} (NaN or inf); refusing to start from it")
    return tensors


def _check_identity(folder: Path, identity: dict, role: str) -> None:
    """``atlas_base.json``: its fields, and the role it says the folder holds."""
    config, fingerprint, name = identity.get("config"), identity.get("fingerprint"), identity.get("adapter_name")
    if not isinstance(config, dict) or not isinstance(fingerprint, str) or len(fingerprint) != 64:
        raise AdapterError(f"{folder}: {BASE_FILE} is damaged (needs a 'config' object and a sha256 "
                           f"'fingerprint'); the base this adapter was trained on cannot be checked")
    if name is not None and name not in ADAPTERS:
        raise AdapterError(f"{folder}: {BASE_FILE} field adapter_name={name!r} is not one of {', '.join(ADAPTERS)}")
    if name is not None and name != role:
        raise AdapterMismatchError(f"{folder}: its {BASE_FILE} says it is the {name} adapter; refusing to load "
                                   f"it as the {role}")


def read_adapter_folder(folder: str | Path, role: str) -> AdapterFolder:
    """Read a PEFT folder meant to start ``role`` and check it against itself: the files are
    there and readable (``FileNotFoundError`` / ``AdapterError`` naming folder and file), every
    tensor is finite, ``adapter_config.json`` has its fields, ``atlas_base.json`` (when present)
    is intact and names this role, and a folder with a value head is never taken for the actor."""
    if role not in ADAPTERS:
        raise ValueError(f"adapter_name={role!r} is not one of {', '.join(ADAPTERS)}")
    folder = Path(folder)
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder}: no {needed} (not a PEFT adapter folder)")
    config = read_adapter_config(folder)
    shape_from_adapter_config(config, f"{folder}: {CONFIG_FILE}")
    identity = read_json_object(folder / BASE_FILE, AdapterError, folder) if (folder / BASE_FILE).exists() else None
    if identity is not None:
        _check_identity(folder, identity, role)
    has_head = (folder / VALUE_HEAD_FILE).exists()
    if role != CRITIC and has_head:
        raise AdapterMismatchError(f"{folder}: it holds {VALUE_HEAD_FILE}, so it is a critic adapter; refusing to "
                                   f"load it as the {role}")
    tensors = _safetensors(folder, WEIGHTS_FILE)
    value_head = _safetensors(folder, VALUE_HEAD_FILE) if role == CRITIC and has_head else None
    return AdapterFolder(folder=folder, config=config, tensors=tensors, value_head=value_head, identity=identity)


def check_adapter_fits(model: ActorCritic, role: str, data: AdapterFolder, *, require_value_head: bool = True,
                       modules_key: str = "model.lora.target_modules") -> dict[str, Tensor]:
    """``data`` against this model's ``role`` adapter: base (identity, else shapes), LoRA
    hyper-parameters, adapted modules (named by ``modules_key``), tensor names and shapes, the
    value head. Returns PEFT key -> the live parameter. ``AdapterMismatchError`` naming the
    folder and the field; ``FileNotFoundError`` for a missing value head when it is required."""
    _check_base(model, data.folder, data.identity, data.config)
    return check_adapter_tensors(model, role, data, require_value_head=require_value_head, modules_key=modules_key)


def check_adapter_tensors(model: Any, role: str, data: AdapterFolder, *, require_value_head: bool = True,
                          modules_key: str = "model.lora.target_modules") -> dict[str, Tensor]:
    """``check_adapter_fits`` without the base's identity: LoRA hyper-parameters, adapted
    modules, tensor names and shapes, the value head (exactly its ``weight`` and ``bias``).
    ``model``: an ``ActorCritic``, or what the start-up builds on the meta device
    (``build.check_starting_adapters``: its ``peft_model``, ``checkpoint_names``, ``value_head``
    and ``adapter_parameters``)."""
    folder = data.folder
    _check_lora_fields(model, role, folder, data.config)
    targets = _peft_named_parameters(model, role)
    # folders as other trainers wrote them (module doc): checkpoint names, a head in modules_to_save
    data.tensors = _renamed_to_loaded(model, data.tensors, targets)
    if role == CRITIC and data.value_head is None:
        data.value_head = _value_head_from_modules_to_save(model, folder, data.config, data.tensors)
    expected_modules, found_modules = _adapted_modules(targets), _adapted_modules(data.tensors)
    if expected_modules != found_modules:
        missing, extra = sorted(expected_modules - found_modules), sorted(found_modules - expected_modules)
        raise AdapterMismatchError(
            f"{folder}: target_modules differ from this run's {modules_key}: {len(missing)} modules adapted here "
            f"but not in the folder (e.g. {missing[:2]}), {len(extra)} in the folder but not here (e.g. {extra[:2]})"
        )
    if set(data.tensors) != set(targets):
        diff = sorted(set(data.tensors) ^ set(targets))
        raise AdapterMismatchError(f"{folder}: {WEIGHTS_FILE} keys differ from this adapter's, e.g. {diff[:3]}")
    for key, param in targets.items():
        if tuple(data.tensors[key].shape) != tuple(param.shape):
            raise AdapterMismatchError(
                f"{folder}: {key} has shape {tuple(data.tensors[key].shape)}, this model's is {tuple(param.shape)} "
                f"(a different base or rank)"
            )
    if role == CRITIC:
        if data.value_head is not None:
            extra = sorted(set(data.value_head) - {name for name, _ in model.value_head.named_parameters()})
            if extra:
                raise AdapterMismatchError(f"{folder}: {VALUE_HEAD_FILE} holds {extra}, which the value head has "
                                           f"no place for (it is a weight and a bias)")
            for name, param in model.value_head.named_parameters():
                found = tuple(data.value_head[name].shape) if name in data.value_head else "missing"
                if found != tuple(param.shape):
                    raise AdapterMismatchError(
                        f"{folder}: {VALUE_HEAD_FILE} field {name} is {found}, expected {tuple(param.shape)}"
                    )
        elif require_value_head:
            raise FileNotFoundError(
                f"{folder}: no {VALUE_HEAD_FILE} (the critic's value head) and no value head among "
                f"{CONFIG_FILE}'s modules_to_save; pass require_value_head=False to start a fresh head"
            )
    return targets


def load_adapter(model: ActorCritic, adapter_name: str, folder: str | Path, *, require_value_head: bool = True) -> None:
    """Start ``adapter_name`` from the PEFT folder ``folder`` (another run's step): read and
    check it (``read_adapter_folder``: intact files, finite weights, its own role), check it
    fits this base and this adapter's LoRA settings (``check_adapter_fits``), then copy its
    tensors into the (possibly sharded) parameters. For the critic, also the value head
    (``require_value_head=False`` keeps the fresh head when the folder has none). Raises
    ``FileNotFoundError``, ``AdapterError`` or ``AdapterMismatchError``, each naming the
    folder. Under FSDP2 every rank calls it (each reads the folder)."""
    data = read_adapter_folder(folder, adapter_name)
    targets = check_adapter_fits(model, adapter_name, data, require_value_head=require_value_head)
    with torch.no_grad():
        for key, param in targets.items():
            _copy_full_into(param, data.tensors[key])
        if data.value_head is not None:  # the critic's, checked whole by check_adapter_fits
            for name, param in model.value_head.named_parameters():
                _copy_full_into(param, data.value_head[name])


def _renamed_to_loaded(model: ActorCritic, tensors: dict[str, Tensor], targets: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` with keys in the base checkpoint's naming renamed to this model's (module
    doc): ``base_model.model.<checkpoint module>.lora_A.weight`` -> the live key whose base
    weight is stored under that checkpoint name. Keys already this model's are kept."""
    from .checkpoint_names import lora_key_in_checkpoint_names

    names = model.checkpoint_names
    if not names or set(tensors) <= set(targets):
        return tensors
    by_checkpoint = {lora_key_in_checkpoint_names(key, names): key for key in targets}
    return {(key if key in targets else by_checkpoint.get(key, key)): tensor for key, tensor in tensors.items()}


def _value_head_from_modules_to_save(model: ActorCritic, folder: Path, saved: dict,
                                     tensors: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """The critic's value head saved in ``adapter_model.safetensors`` as a peft
    ``modules_to_save`` module (module doc), as ``{"weight": (1, H), "bias": (1,)}``, its keys
    removed from ``tensors``; None when ``modules_to_save`` names no module in the file.
    ``AdapterMismatchError`` when the named module is not a ``(1, hidden)`` linear."""
    names = saved.get("modules_to_save") or []
    names = {str(n).split(".")[-1] for n in ([names] if isinstance(names, str) else names)}
    found: dict[str, dict[str, str]] = {}
    for key in tensors:
        module, _, leaf = key.rpartition(".")
        if ".lora_" not in key and module.split(".")[-1] in names:
            found.setdefault(module, {})[leaf] = key
    if not found:
        return None
    hidden = int(model.value_head.weight.shape[1])
    if len(found) != 1:
        raise AdapterMismatchError(f"{folder}: modules_to_save names several modules in {WEIGHTS_FILE} "
                                   f"({sorted(found)}); the critic has one value head")
    (module, keys), = found.items()
    weight = tensors[keys["weight"]] if "weight" in keys else None
    bias = tensors[keys["bias"]] if "bias" in keys else torch.zeros(1)
    if weight is None or tuple(weight.shape) != (1, hidden) or tuple(bias.shape) != (1,) or set(keys) - {"weight", "bias"}:
        shapes = {leaf: tuple(tensors[k].shape) for leaf, k in keys.items()}
        raise AdapterMismatchError(f"{folder}: {module} (modules_to_save) holds {shapes}; a value head is a "
                                   f"weight (1, {hidden}) and a bias (1,)")
    for key in keys.values():
        del tensors[key]
    if "bias" not in keys:
        log.warning("%s: %s has no bias; the value head starts with bias 0", folder, module)
    return {"weight": weight, "bias": bias}


def _check_base(model: ActorCritic, folder: Path, identity: Optional[dict], saved: dict) -> None:
    if identity is None:
        log.warning(
            "%s has no %s: its base (%s) is checked by tensor shapes only", folder, BASE_FILE,
            saved.get("base_model_name_or_path"),
        )
        return
    problem = identity_mismatch(model.base_identity, identity)
    if problem:
        raise AdapterMismatchError(f"{folder}: trained on a different base model: {problem}")


def _check_lora_fields(model: ActorCritic, adapter_name: str, folder: Path, saved: dict) -> None:
    live = model.peft_model.peft_config[adapter_name].to_dict()
    for field in COMPARED_FIELDS:
        a, b = live.get(field), saved.get(field)
        if field in ("rank_pattern", "alpha_pattern"):
            a, b = a or {}, b or {}
        if field == "lora_alpha" and isinstance(a, (int, float)) and isinstance(b, (int, float)):
            same = float(a) == float(b)
        else:
            same = a == b
        if not same:
            raise AdapterMismatchError(
                f"{folder}: {field}={b!r} in {CONFIG_FILE}, this run's {adapter_name} adapter has {field}={a!r}"
            )


def _peft_named_parameters(model: ActorCritic, adapter_name: str) -> dict[str, Tensor]:
    """PEFT file key -> the live (possibly sharded) parameter, without gathering anything."""
    from peft import get_peft_model_state_dict

    wanted = {id(p) for p in model.adapter_parameters(adapter_name)}
    live = {name: p for name, p in model.peft_model.named_parameters() if id(p) in wanted}
    return get_peft_model_state_dict(
        model.peft_model, state_dict=live, adapter_name=adapter_name, save_embedding_layers=False
    )


def _copy_full_into(param: Tensor, full: Tensor) -> None:
    """Copy a full tensor into ``param``; a DTensor keeps only its own shard of it."""
    full = full.to(device=param.device, dtype=param.dtype)
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        # every rank read the same file, so each takes its shard locally (no communication)
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)
