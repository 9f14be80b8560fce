"""Is a checkpoint's Lightning state whole? Checked before a resume writes anything.

Lightning restores what a checkpoint holds and, for optimizers, silently starts fresh where it
holds nothing: an optimizer whose state is missing, or that keeps Adam's moments for only some of
its parameters, resumes with those tensors' moments at zero and no word of it. The adapters are
checked against the built model elsewhere (``PPOModule``); this checks the rest of the state
``trainer.resume`` restores, from the files alone (the single-file state is memory-mapped, a
torch.distributed checkpoint from its metadata, its tensor values for the finiteness check
alone), before the model is built:

* both optimizers (``actor``, ``critic``, in ``configure_optimizers``' order) are there;
* each either has no per-parameter state (it has not stepped: the actor during
  ``algorithm.critic_warmup``) or has ``step``, ``exp_avg`` and ``exp_avg_sq`` for every
  parameter its groups list; the critic has stepped once any RL step was checkpointed;
* the loops' progress, the callbacks' states, the data cursor (``next_step``) and the module's
  own ``atlas`` record (the RL step, its folder's ``N``) are there;
* the trainable tensors and Adam moments match the checkpoint's adapters, by role and shape
  (``run/resume_tensors.py``), and every floating tensor of the state is finite (a
  torch.distributed state's values read in bounded batches: ``run/resume_values.py``);
* each optimizer was set up with this run's ``algorithm.actor_lr`` / ``critic_lr``,
  ``weight_decay`` and ``betas`` (Lightning restores the saved ones: a changed learning rate
  would be recorded in the run's config and not used);
* every rank's random generator states (``ppo/rng_state.py``: torch CPU and CUDA, numpy,
  Python) are there: without them the resumed run's LoRA dropout would draw other masks than
  the uninterrupted run's, a silent divergence like fresh Adam moments. A checkpoint written
  before they were kept is refused like one without its optimizer state; its adapters still
  start a run (``trainer.init_from``);
* it was saved in the format this run restores (``StateLayout``): one file (``state.ckpt``, one
  CPU process) or a torch.distributed checkpoint folder (FSDP2). Lightning restores neither into
  the other (a folder into one process: ``IsADirectoryError``; a file into FSDP2: the optimizers'
  moments matched to the wrong parameters, a size mismatch), each only after the run's config and
  log are written. A torch.distributed checkpoint does restore at another world size: torch
  reshards every tensor and moment (``tests/run/test_resume_other_world_size.py``: the restored
  values equal the saved ones); only the random draws do not continue exactly (``ppo/rng_state.py``).

``ResumeStateError`` (an ``InputError``: the CLI exits 2) names the folder and what is missing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from atlas_lightning.errors import InputError, quoted
from atlas_lightning.ppo import rng_state
from atlas_lightning.ppo.rng_state import RNG_KEY
from atlas_lightning.store.checkpoints import lightning_state_path

#: The optimizers ``PPOModule.configure_optimizers`` returns, in order.
OPTIMIZER_ROLES = ("actor", "critic")
#: What AdamW keeps for each parameter it has stepped.
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
#: What every rank's generator states hold (``rng_state.capture``; CUDA's only where it ran).
RNG_PARTS = ("torch", "numpy", "python")
#: Top-level entries a resumable state must have besides the optimizers.
REQUIRED = ("loops", "callbacks", "atlas")


class ResumeStateError(InputError):
    """A checkpoint's Lightning state lacks part of what a resume restores."""


@dataclass(frozen=True)
class StateLayout:
    """How a Lightning state is saved: a torch.distributed checkpoint folder (``sharded``: FSDP2,
    whatever the world size) or one file, and by how many ranks."""

    sharded: bool
    world_size: int

    @property
    def format(self) -> str:
        """The format in words, for a refusal."""
        return ("a torch.distributed checkpoint folder (FSDP2)" if self.sharded
                else "one file, lightning/state.ckpt (one CPU process, no FSDP2)")


def check_resume_state(folder: str | Path, algorithm: Any = None, sampling: Optional[str] = None,
                       layout: Optional[StateLayout] = None) -> StateLayout:
    """Refuse ``folder`` (a verified ``global_step_N``) when its Lightning state is not whole
    (module doc), or, given this run's ``algorithm`` config, when its optimizers were set up
    with other hyper-parameters (``_check_hyperparameters``), or, given this run's ``sampling``
    digest (``questions.sampler.sampling_digest``), when its data cursor counts steps of other
    training questions or sampling settings (a cursor written before it kept one passes), or,
    given this run's ``layout``, when it was saved in the other format (``_check_layout``).
    Returns how it was saved (its world size: the ranks whose generator states it keeps)."""
    path = lightning_state_path(folder)
    where = f"checkpoint {folder}"
    if path.is_file():
        top, optimizers = _single_file(path)
    else:
        top, metadata = _distributed_files(path)
        optimizers = _distributed_optimizers(path, metadata)
    for key in REQUIRED:
        if key not in top:
            raise ResumeStateError(f"{where}: its Lightning state has no {key!r} entry: not a resumable state")
    _check_rng(where, top.get(RNG_KEY))
    cursors = [value["next_step"] for value in top.values() if isinstance(value, dict) and "next_step" in value]
    if not cursors:
        raise ResumeStateError(f"{where}: its Lightning state has no data cursor (the datamodule's next_step)")
    rl_step = _check_steps(where, folder, (top.get("atlas") or {}).get("rl_step", 0), cursors[0])
    kept = [value["sampling"] for value in top.values() if isinstance(value, dict) and "sampling" in value]
    if sampling is not None and kept and kept[0] != sampling:
        raise ResumeStateError(f"{where}: its data cursor counts steps of other training questions or sampling "
                               f"settings than this run's (data.root, data.seed, data.shuffle, "
                               f"algorithm.train_batch_size, rollout.n, rollout.max_prompt_length or the files "
                               f"changed): resuming would not continue its run; resume with its settings, or "
                               f"start a new run from its adapters with trainer.init_from={folder}")
    if len(optimizers) != len(OPTIMIZER_ROLES):
        raise ResumeStateError(f"{where}: its Lightning state holds {len(optimizers)} optimizer state(s), "
                               f"a resume needs {len(OPTIMIZER_ROLES)} ({', '.join(OPTIMIZER_ROLES)})")
    for role, (params, state, groups) in zip(OPTIMIZER_ROLES, optimizers):
        _check_optimizer(where, role, params, state, rl_step)
        if algorithm is not None:
            _check_hyperparameters(where, role, groups, algorithm)
    from atlas_lightning.run import resume_tensors

    if path.is_file():
        resume_tensors.check_state_tensors(where, Path(folder), top, ResumeStateError)
    else:
        resume_tensors.check_state_shapes(where, Path(folder), *_distributed_shapes(metadata, optimizers),
                                          ResumeStateError)
        from atlas_lightning.run.resume_values import check_distributed_values

        check_distributed_values(where, path, metadata, ResumeStateError)
    saved = StateLayout(sharded=not path.is_file(), world_size=len(top[RNG_KEY]["ranks"]))
    if layout is not None:  # last: a state that is not whole is refused for that, in either format
        _check_layout(folder, saved, layout)
    return saved


def _check_layout(folder: str | Path, saved: StateLayout, mine: StateLayout) -> None:
    """A state restores only in its own format (module doc); at another world size a
    torch.distributed one is resharded, so only the format is compared."""
    if saved.sharded == mine.sharded:
        return
    world = saved.world_size
    back = ("on one CPU process (trainer.devices=1 layout.gpus=1 layout.train_gpus=1)" if not saved.sharded else
            f"under FSDP2: on GPUs, or on {world} CPU processes as saved (trainer.devices={world} "
            f"layout.train_gpus={world})")
    raise ResumeStateError(
        f"checkpoint {folder}: its Lightning state was saved by {world} rank(s) as {saved.format}; this run "
        f"({mine.world_size} rank(s)) restores only {mine.format}, and Lightning cannot restore one into the "
        f"other: resume {back}, or start a new run from its adapters with trainer.init_from={folder} "
        f"trainer.resume=null and another name")


def _check_steps(where: str, folder: str | Path, rl_step: Any, next_step: Any) -> int:
    """The RL step the state records is its folder's ``global_step_N`` and the data cursor the
    step after it: otherwise the resumed run would count steps, or draw questions, from elsewhere."""
    from atlas_lightning.store.checkpoints import checkpoint_step

    if type(rl_step) is not int or type(next_step) is not int or next_step < 1:
        raise ResumeStateError(f"{where}: its Lightning state records RL step {rl_step!r} and data cursor "
                               f"{next_step!r}: not step numbers")
    step = checkpoint_step(folder)
    if step is not None and rl_step != step:
        raise ResumeStateError(f"{where}: its Lightning state records RL step {rl_step}, its folder is "
                               f"{Path(folder).name}: the state is another step's")
    if next_step != rl_step + 1:  # the cursor holds the next step to train (rollout/datamodule.py)
        raise ResumeStateError(f"{where}: its Lightning state records RL step {rl_step} and data cursor {next_step} "
                               f"(the next step to train is {rl_step + 1}): the resumed run would "
                               f"{'train step(s) again' if next_step <= rl_step else 'skip step(s)'}")
    return rl_step


#: ``algorithm`` keys -> the AdamW setting each becomes, per role (``PPOModule.configure_optimizers``).
_HYPERPARAMETERS = {"lr": {"actor": "actor_lr", "critic": "critic_lr"},
                    "weight_decay": {"actor": "weight_decay", "critic": "weight_decay"},
                    "betas": {"actor": "betas", "critic": "betas"}}


def _check_hyperparameters(where: str, role: str, groups: list[dict], algorithm: Any) -> None:
    """The optimizer's saved settings against this run's: Lightning restores them with the
    moments, so a changed ``algorithm.actor_lr`` (or ``critic_lr``, ``weight_decay``, ``betas``)
    would be written to the run's config and silently not used."""
    import math

    for field, keys in _HYPERPARAMETERS.items():
        mine = algorithm[keys[role]]
        mine = [float(v) for v in mine] if field == "betas" else float(mine)
        for group in groups:
            if field not in group:
                continue
            saved = [float(v) for v in group[field]] if field == "betas" else float(group[field])
            same = (all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(saved, mine)) if field == "betas"
                    else math.isclose(saved, mine, rel_tol=1e-9))
            if not same:
                raise ResumeStateError(
                    f"{where}: its {role} optimizer was set up with {field}={saved} (this run: algorithm."
                    f"{keys[role]}={mine}); a resume restores the checkpoint's and would not use this run's: "
                    f"resume with algorithm.{keys[role]}={saved}, or start a new run from its adapters with "
                    f"trainer.init_from={where.removeprefix('checkpoint ')} trainer.resume=null")


def _check_rng(where: str, entry: Any) -> None:
    """``entry``: the state's ``RNG_KEY`` value (``rng_state.capture``'s)."""
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    if not ranks:
        raise ResumeStateError(
            f"{where}: its Lightning state holds no random generator states (written before they were kept): "
            f"a resume would draw other LoRA dropout masks than the run it continues; resume from a newer "
            f"checkpoint, or start a new run from its adapters with trainer.init_from={where.removeprefix('checkpoint ')}")
    lacking = [rank for rank, state in enumerate(ranks) if not isinstance(state, dict) or not set(RNG_PARTS) <= set(state)]
    if lacking:
        raise ResumeStateError(f"{where}: the random generator states of rank(s) {lacking} lack some of "
                               f"{', '.join(RNG_PARTS)}")
    try:
        rng_state.check(entry)
    except ValueError as err:
        raise ResumeStateError(f"{where}: {err}") from None


def _check_optimizer(where: str, role: str, params: list, state: dict[Any, set[str]], rl_step: int) -> None:
    """``params``: the parameters the optimizer's groups list; ``state``: for each parameter
    that has state, the names of what it keeps."""
    if not state:
        if role == "critic" and rl_step >= 1:
            raise ResumeStateError(f"{where}: the critic optimizer has no state after RL step {rl_step}: "
                                   f"its moments were lost")
        return
    incomplete = [param for param in params if not set(ADAM_STATE) <= state.get(param, set())]
    if incomplete:
        raise ResumeStateError(
            f"{where}: the {role} optimizer keeps Adam's moments for {len(params) - len(incomplete)} of its "
            f"{len(params)} parameters (missing e.g. {', '.join(str(p) for p in incomplete[:3])}): those would "
            f"restart from zero; resume from an earlier checkpoint")


def _single_file(path: Path) -> tuple[dict, list[tuple[list, dict, list[dict]]]]:
    """Lightning's one-file state, memory-mapped (no tensor data is read)."""
    import torch

    try:
        # as Lightning loads it (torch's default, weights only): a state it would refuse is refused here
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # a file torch cannot read, whatever the library raises
        raise ResumeStateError(f"checkpoint {path.parent.parent}: {path.name} cannot be read: "
                               f"{quoted(str(err))}") from None
    optimizers = []
    for entry in checkpoint.get("optimizer_states") or []:
        params = [p for group in entry.get("param_groups", []) for p in group.get("params", [])]
        state = {param: set(values) for param, values in (entry.get("state") or {}).items()}
        optimizers.append((params, state, list(entry.get("param_groups", []))))
    return checkpoint, optimizers


def _distributed_files(path: Path) -> tuple[dict, dict]:
    """A torch.distributed checkpoint's non-tensor state (Lightning's ``meta.pt``) and its
    metadata (``state_dict_metadata``: each key's size and dtype), each read once."""
    import torch
    from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
    from torch.distributed.checkpoint import FileSystemReader

    try:
        top = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=True)
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # a damaged folder, whatever the library raises
        raise ResumeStateError(f"checkpoint {path.parent}: its Lightning state cannot be read: "
                               f"{quoted(str(err))}") from None
    return top, metadata


def _distributed_optimizers(path: Path, metadata: dict) -> list[tuple[list, dict, list[dict]]]:
    """Each optimizer's parameter names, per-parameter state and param groups, from the metadata
    and the groups' entries read from ``path``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    keys = list(metadata)
    optimizers = []
    for index in range(len({key.split(".", 1)[0] for key in keys if key.startswith("optimizer_")})):
        prefix = f"optimizer_{index}."
        param_keys = sorted(key for key in keys if key.startswith(prefix + "param_groups.")
                            and key.rpartition(".")[2] in ("params", *_HYPERPARAMETERS))
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            loaded = _load_state_dict_from_keys(keys=set(param_keys), checkpoint_id=str(path)) if param_keys else {}
        groups = list(loaded.get(f"optimizer_{index}", {}).get("param_groups", []))
        params = [p for group in groups for p in group.get("params", [])]
        state: dict[str, set[str]] = {}
        for key in keys:
            if key.startswith(prefix + "state."):
                name, _, kept = key[len(prefix + "state."):].rpartition(".")
                state.setdefault(name, set()).add(kept)
        optimizers.append((params, state, groups))
    return optimizers


def _distributed_shapes(metadata: dict, optimizers: list) -> tuple[dict[str, tuple], list[tuple[int, dict]]]:
    """A torch.distributed state's trainable tensors (name -> shape) and, for each optimizer,
    ``(parameters listed, {moment: [shapes]})``, from its metadata alone (``resume_tensors``)."""
    from atlas_lightning.run.resume_tensors import MOMENTS

    sizes = {key: tuple(entry.size) for key, entry in metadata.items() if hasattr(entry, "size")}
    state = {key[len("state_dict."):]: size for key, size in sizes.items() if key.startswith("state_dict.")}
    moments = [(len(params), {moment: [size for key, size in sizes.items()
                                       if key.startswith(f"optimizer_{index}.state.") and key.endswith(f".{moment}")]
                              for moment in MOMENTS})
               for index, (params, _, _) in enumerate(optimizers)]
    return state, moments
