"""The run's facts: what a run starts from, verified and resolved once at start-up.

``check_inputs`` verifies what the run reads before anything is written and returns what it
read, as one ``RunFacts``: the run's folders, the LoRA shape each adapter trains, the question
splits, and the checkpoint it resumes from. Verifying is loading: the splits and adapter configs
checked here are the ones the run uses, never read a second time. Each component gets only its
slice (``run/verbs.py``): the datamodule the splits, the callbacks their folders (interpolated
from ``paths.*`` in ``conf/callbacks/``) and the run's record its LoRA shapes.

Who calls it: ``run/verbs.py`` (fit, validate), ``run/memory_check.py`` (no splits), tests.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from omegaconf import DictConfig

from atlas_lightning.config import ConfigError, run_dirs
from atlas_lightning.questions.loader import QuestionSplits
from atlas_lightning.store.lora_shapes import LoraShape

if TYPE_CHECKING:
    from atlas_lightning.run.resume_state import StateLayout


@dataclass
class StartingPoint:
    """The checkpoint a run resumes from, verified (``resume_path``)."""

    #: The ``global_step_N`` folder ``trainer.resume`` resolved to (None: a fresh run).
    resume: Optional[Path] = None
    #: What ``trainer.fit(ckpt_path=...)`` takes for it.
    state: Optional[str] = None
    #: What was decided on the way (e.g. newer checkpoints that did not verify), for the run's log.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunFacts:
    """What a run starts from (module doc), made once by ``check_inputs``."""

    #: The README's "On-disk layout" of this run (``config.run_dirs``: ``root``, ``artifacts``, ...).
    folders: Mapping[str, Path]
    #: ``{"actor", "critic"}``: the LoRA each adapter trains, from its starting folder's
    #: ``adapter_config.json`` or the config (``store.lora_shapes.lora_shapes``).
    lora: Mapping[str, LoraShape]
    #: The train and validation questions whose prompts fit ``rollout.max_prompt_length``
    #: (``rollout/step_questions.fitted_splits``; None for a verb that reads none: memory-check).
    questions: Optional[QuestionSplits]
    #: The checkpoint it resumes from (``resume_path``).
    start: StartingPoint
    #: What was decided about the questions (those skipped for their prompt's length), for the run's log.
    question_notes: tuple[str, ...] = ()

    @property
    def notes(self) -> list[str]:
        """Everything decided at start-up, for the run's log and stderr (``wiring.prepare_run``)."""
        return [*self.start.notes, *self.question_notes]


def check_inputs(cfg: DictConfig, *, data: bool = True, training: bool = True) -> RunFacts:
    """Verify what the run reads before anything is written (every verb that loads the model
    calls it first) and return it: the run's folders (``paths.*``: writable, or creatable), what
    the separate layout's server cannot run (``rollout/layout_checks.py``), what this machine cannot
    run (``run/environment.check_machine``: cards, W&B, the Hub), ``model.path`` (``planning.model_folder``; its weights
    every architecture tensor and every value finite: ``run/base_values.py``) and ``model.shape``, the question splits (``data``: ``data.root`` a folder of the benchmarks, every file of the train and validation splits loads,
    ``questions.loader.load_splits``, and is fitted to ``rollout.max_prompt_length`` under
    ``model.path``'s tokenizer, filling a batch whose trajectories, and a validation's, fit this machine's memory:
    ``rollout/step_questions.fitted_splits``), ``trainer.init_from``
    (a complete checkpoint whose adapters verify against ``checkpoint.json``), the starting
    adapter folders, their tensors and their LoRA shapes (``_check_starting_adapters``,
    ``store.lora_shapes``), and ``trainer.resume``
    (``resume_path``; ``training``: the run trains on from it, so the trajectories it keeps in
    flight must be continued; its token budgets as ``plan`` checks them: ``_check_token_budgets``).
    ``ConfigError`` / ``DataError`` / ``AdapterConfigError`` naming the key or file otherwise (the
    CLI exits 2)."""
    from atlas_lightning.planning.model_folder import check_model_folder
    from atlas_lightning.store.checkpoints import CheckpointError, verify_checkpoint
    from atlas_lightning.store.lora_shapes import CONFIG_FILE as ADAPTER_CONFIG, lora_shapes

    from atlas_lightning.run.environment import check_machine

    folders = run_dirs(cfg)
    check_writable(folders)
    _check_checkpoint_entries(folders["checkpoints"])
    _check_run_history(cfg)
    _check_separate_layout(cfg)
    if training:
        _check_token_budgets(cfg)
    check_machine(cfg)
    check_model_folder(cfg.model.path)
    _check_model_shape(cfg.model.shape)
    _check_lora_targets(cfg.model)
    questions, question_notes = None, []
    if data:
        from atlas_lightning.questions.loader import load_splits

        check_data_root(cfg.data)
        questions = load_splits(cfg.data)
    if cfg.trainer.init_from:
        parts = ("actor", "critic") if cfg.trainer.init_critic else ("actor",)
        try:
            verify_checkpoint(Path(cfg.trainer.init_from), parts=parts)
        except CheckpointError as err:
            raise ConfigError(f"trainer.init_from={cfg.trainer.init_from}: {err}") from None
    for role in ("actor", "critic"):
        folder = cfg.model.get(f"{role}_adapter")
        if folder and not Path(folder).is_dir():
            raise ConfigError(f"model.{role}_adapter={folder}: no such folder")
        if folder and not (Path(folder) / ADAPTER_CONFIG).is_file():
            raise ConfigError(f"model.{role}_adapter={folder}: no {ADAPTER_CONFIG} there (not a PEFT adapter "
                              f"folder: give a .../global_step_N/{role}/lora_adapter folder, or leave it null for "
                              f"a fresh adapter)")
    starting = _check_starting_adapters(cfg)
    from atlas_lightning.models.build import check_base_config, check_base_weights
    from atlas_lightning.models.serving_files import check_serving_files
    from atlas_lightning.run.base_values import check_finite_base

    # before the tokenizer loads: that reads config.json too, and fails on a bad one without naming it
    base_config = check_base_config(cfg.model.path)
    fitted = None
    if questions is not None:  # fitted after the files' checks (the tokenizer imports transformers), once
        from atlas_lightning.rollout.step_questions import fitted_splits

        loaded = questions
        fitted = functools.cache(lambda: fitted_splits(cfg, loaded, say=question_notes.append, training=training))
    start = resume_path(cfg, folders["checkpoints"], training=training, fitted=fitted)
    if fitted is not None:
        questions = fitted()
    fingerprint = check_base_weights(cfg.model.path, base_config)  # last: it builds the model on the meta device from every header
    check_finite_base(cfg.model.path)  # and every value of the base, read once (run/base_values.py)
    check_serving_files(cfg.model.path, base_config, cfg.rollout.max_model_len)  # what the engine reads beside them
    _check_adapter_bases(cfg, fingerprint, start.resume)
    _check_adapters_fit(cfg, starting)
    return RunFacts(folders=folders, lora=lora_shapes(cfg), questions=questions, start=start,
                    question_notes=tuple(question_notes))


def _check_starting_adapters(cfg: DictConfig) -> dict:
    """Each adapter that starts from a folder (``model.actor_adapter``, ``model.critic_adapter``,
    ``trainer.init_from``'s) read as the build reads it (``models.adapters.read_adapter_folder``:
    its files there and readable, every tensor finite, its ``atlas_base.json`` naming this role)
    and its tensors' shapes checked against its own ``adapter_config.json`` and this base from the
    safetensors header (``adapter_files.check_adapter``, pre-flight's check): refused here, naming the key and the folder,
    rather than when the model is built, after the run's config and logs are written. Returns
    ``{role: AdapterFolder}`` as read, for ``_check_adapters_fit``."""
    from atlas_lightning.errors import InputError
    from atlas_lightning.models.adapters import read_adapter_folder
    from atlas_lightning.planning.shapes import ShapeError, read_model_shape
    from atlas_lightning.run.adapter_files import check_adapter
    from atlas_lightning.store.lora_shapes import read_lora_shape, starting_adapter_source, starting_adapters

    from atlas_lightning.planning.model_folder import linear_module_names, unmatched_lora_targets

    folders, read = starting_adapters(cfg), {}
    shape = read_model_shape(cfg.model.path) if folders else None
    modules = linear_module_names(cfg.model.path) if folders else set()
    for role, folder in folders.items():
        source = starting_adapter_source(cfg, role)
        try:  # its adapter_config.json first, refused as lora_shapes refuses it; then its tensors
            lora = read_lora_shape(folder)
            unmatched = unmatched_lora_targets(lora.target_modules if isinstance(lora.target_modules, tuple) else None,
                                               modules)
            if unmatched:  # peft skips a target that matches nothing when another matches: the config lies
                raise ConfigError(f"{source}={folder}: its adapter_config.json's target_modules name "
                                  f"{', '.join(unmatched)}, which is no module of the base {cfg.model.path}")
            read[role] = read_adapter_folder(folder, role)
            check_adapter(cfg, shape, role, Path(folder))
        except (InputError, ShapeError, FileNotFoundError) as err:
            raise _named(err, source, folder) from None
    return read


def _check_no_earlier_run(cfg: DictConfig, folders: Mapping[str, Path]) -> None:
    """A fit that starts afresh (``trainer.resume`` unset) finds none of an earlier run's training
    under its name: no ``global_step_N`` in its checkpoints folder, no ``train/step_N`` in its
    artifacts. It would write its own step 1 over theirs, and leave their later steps beside its
    own for ``trainer.resume=auto`` and the closing summary to take as this run's."""
    from atlas_lightning.store.checkpoints import checkpoint_step

    def names(folder: Path, is_step: Callable[[Path], bool]) -> list[str]:  # in step order: step_2 before step_10
        return sorted((e.name for e in (folder.iterdir() if folder.is_dir() else ()) if is_step(e)),
                      key=lambda name: (len(name), name))

    checkpoints, train = folders["checkpoints"], folders["artifacts"] / "train"
    where, steps = checkpoints, names(checkpoints, lambda entry: checkpoint_step(entry) is not None)
    if not steps:
        where, steps = train, names(train, lambda entry: entry.name.startswith("step_"))
    if steps:
        shown = ", ".join(steps[:3]) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")
        raise ConfigError(f"name={cfg.name}: {where} holds an earlier run's steps ({shown}), which a fresh start "
                          f"would overwrite: continue it with trainer.resume=auto, or choose another name or "
                          f"paths.root")


def _check_run_history(cfg: DictConfig) -> None:
    """The export a run continues (``WANDB_RUN_ID`` naming an id whose ``runs/<name>/<id>/history.csv``
    exists: ``loggers/run_export.py`` reads it back and rewrites it with every step) must read back
    whole; refused here, before anything is written, rather than at the first logged metric."""
    from atlas_lightning.loggers.run_export import HISTORY_NAME, read_history

    run_id = os.environ.get("WANDB_RUN_ID")
    path = Path(str(cfg.paths.runs)) / run_id / HISTORY_NAME if run_id else None
    if path is not None and path.is_file():
        read_history(path)


def _named(err: Exception, source: str, folder) -> ConfigError:
    """``err`` about a starting adapter ``folder`` as a ``ConfigError`` naming the key ``source``."""
    message = str(err).removeprefix(f"{folder}: ")
    return ConfigError(message if message.startswith(source) else f"{source}={folder}: {message}")


def _check_adapters_fit(cfg: DictConfig, read: dict) -> None:
    """The starting adapters ``_check_starting_adapters`` read, against the model the build makes
    (``models.build.check_starting_adapters``, on the meta device): every tensor name, shape and
    LoRA field the build compares when it loads them, refused here, before anything is written."""
    from atlas_lightning.errors import InputError
    from atlas_lightning.models.build import check_starting_adapters
    from atlas_lightning.store.lora_shapes import starting_adapter_source

    try:
        check_starting_adapters(cfg.model, read)  # one meta build for both, as the build makes one model
    except (InputError, FileNotFoundError) as err:
        role = next((role for role, data in read.items() if str(data.folder) in str(err)), next(iter(read), "actor"))
        raise _named(err, starting_adapter_source(cfg, role), read[role].folder if role in read else "") from None


def _check_adapter_bases(cfg: DictConfig, fingerprint: Optional[str], resume: Optional[Path]) -> None:
    """Each adapter the run starts or resumes from was trained on this base's weights: its
    ``atlas_base.json`` fingerprint against ``model.path``'s (``models/identity.py``; same
    shapes, other weights is what it catches), where both are known. The build compares them
    again; here it is refused before anything is written."""
    from atlas_lightning.store.files import read_json_object
    from atlas_lightning.store.lora_shapes import starting_adapter_source, starting_adapters

    if fingerprint is None:
        return
    folders = [(starting_adapter_source(cfg, role), Path(folder)) for role, folder in starting_adapters(cfg).items()]
    if resume is not None:
        folders += [(f"trainer.resume={cfg.trainer.resume}", resume / role / "lora_adapter") for role in ("actor", "critic")]
    for key, folder in folders:
        identity = folder / "atlas_base.json"
        if not identity.is_file():
            continue  # an adapter from elsewhere: its tensors' shapes were the check
        theirs = read_json_object(identity, ConfigError, f"{key}: {folder}").get("fingerprint")
        if isinstance(theirs, str) and theirs != fingerprint:
            raise ConfigError(f"{key}: {folder} was trained on a different base model: model.path={cfg.model.path}'s "
                              f"weights hash to {fingerprint}, its base's to {theirs} (same shapes, different "
                              f"weights); give the base it was trained on")


def _check_separate_layout(cfg: DictConfig) -> None:
    """What the separate layout's server cannot run (``rollout/layout_checks.py``), refused here,
    before anything is written, as well as where the server starts."""
    if cfg.layout.mode != "separate":
        return
    from atlas_lightning.rollout.layout_checks import separate_refusals

    problems = separate_refusals(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def _check_token_budgets(cfg: DictConfig) -> None:
    """The update's token budgets hold the longest sequence a rollout makes: ``plan``'s rule
    (``planning.checks.token_budget_refusals``), refused here before anything is written."""
    from atlas_lightning.planning.checks import token_budget_refusals

    problems = token_budget_refusals(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def check_data_root(data_cfg) -> None:
    """``data.root`` is a folder holding a folder for each of ``data.benchmarks`` (the loader
    would name only the first file it misses, not the key to fix)."""
    root = Path(data_cfg.root)
    if not root.is_dir():
        what = "not a folder" if root.exists() else "no such folder"
        raise ConfigError(f"data.root={data_cfg.root}: {what} (a folder of <benchmark>/<split>.parquet files; "
                          f"`atlas-lightning data sample --out DIR` writes one)")
    missing = [name for name in data_cfg.benchmarks if not (root / name).is_dir()]
    if missing:
        raise ConfigError(f"data.root={data_cfg.root}: no {', '.join(missing)} folder there (data.benchmarks="
                          f"{list(data_cfg.benchmarks)}; each is <data.root>/<benchmark>/<split>.parquet)")


def _check_model_shape(shape) -> None:
    """``model.shape``, when set, names an architecture ``plan`` knows (``planning/named_shapes.py``)."""
    from atlas_lightning.planning.named_shapes import NAMED_CONFIGS

    if shape is not None and shape not in NAMED_CONFIGS:
        raise ConfigError(f"model.shape={shape!r} is not one of {', '.join(NAMED_CONFIGS)} (or null: the shape "
                          f"model.path's config.json gives)")


def _check_lora_targets(model_cfg) -> None:
    """``model.lora.target_modules`` (and ``model.critic_lora``'s) each name a module of the base
    (peft would fail on none matching only after the engine started, and skip a typo silently
    when another target matches)."""
    from atlas_lightning.planning.model_folder import linear_module_names, unmatched_lora_targets

    modules = None
    for key in ("lora", "critic_lora"):
        targets = model_cfg[key].target_modules
        if targets is None or targets == "all-linear":
            continue
        modules = linear_module_names(model_cfg.path) if modules is None else modules
        unmatched = unmatched_lora_targets(list(targets), modules)
        if unmatched:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in modules})
            raise ConfigError(f"model.{key}.target_modules: {', '.join(unmatched)} names no module of the base "
                              f"{model_cfg.path} (its linear modules end in: {', '.join(leaves[:20])})")


def unwritable(folder: Path) -> Optional[str]:
    """Why no file can be made in ``folder`` (or, while it does not exist, in the nearest existing
    folder above it, where it would be made), or None when one can. Tried with an unnamed
    temporary file rather than ``os.access``, which says yes to root on a read-only mount, an
    immutable folder or ``/proc``."""
    import tempfile

    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{existing} is not writable ({err.strerror or err})"
    return None


def check_writable(dirs: Mapping[str, Path]) -> None:
    """Every folder the run writes (``run_dirs``: root, outputs, logs, checkpoints, artifacts,
    runs, wandb) can be written (``unwritable``); ``ConfigError`` naming its key otherwise."""
    for key, folder in dirs.items():
        reason = unwritable(folder)
        if reason:
            where = f"paths.{key}={folder}" + ("" if key == "root" else f" (the run's {key} folder)")
            other = "paths.root" if key == "root" else f"paths.{key} or paths.root"
            raise ConfigError(f"{where}: {reason}; choose another {other}")


def _check_checkpoint_entries(checkpoints: Path) -> None:
    """No entry of the run's checkpoints folder named as a step's checkpoint (``global_step_N``)
    is anything but a folder: ``trainer.resume=auto`` would pass over it and the run would stop
    when it saves that step (a file where the checkpoint's folder goes)."""
    from atlas_lightning.store.checkpoints import checkpoint_step

    for entry in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        if checkpoint_step(entry) is not None and not entry.is_dir():
            raise ConfigError(f"the run's checkpoints folder holds {entry}, which is not a folder (a step's "
                              f"checkpoint is one): move it away, or choose another name or paths.root")


def resume_path(cfg: DictConfig, checkpoints: Path, *, training: bool = True,
                fitted: Optional[Callable[[], QuestionSplits]] = None) -> StartingPoint:
    """``trainer.resume``: None (fresh; when ``training``, over no earlier run of this name:
    ``_check_no_earlier_run``), ``auto`` (this run's newest checkpoint under
    ``checkpoints`` that verifies; newer ones that do not, or whose save did not finish, are
    named in ``notes``; if checkpoints exist and none verifies it is refused rather than started
    afresh over them) or a ``global_step_N`` folder, which must verify
    (``store.checkpoints.verify_checkpoint``: marker, file list, sizes, sha256). Either way its
    Lightning state must be whole and in the format this run restores (``_check_state``), its
    adapters of this run's LoRA settings and base (``run/resume_adapters.py``) and, when
    ``training``, the trajectories it keeps in flight readable and continued by this config
    (``_check_kept_rollouts``; the steps this run samples come from ``fitted()``, the splits
    ``check_inputs`` fits for the run, or are loaded and fitted here). Not ``training`` (the
    ``validate`` verb), ``auto`` with no checkpoint at all is refused: it asked for the run's
    weights, and the starting adapters' scores would read as theirs."""
    from atlas_lightning.run.resume_adapters import check_resume_adapters
    from atlas_lightning.store.checkpoints import (
        CheckpointError, latest_verified, lightning_state_path, verify_checkpoint,
    )

    resume = cfg.trainer.resume
    if not resume:
        if training:
            _check_no_earlier_run(cfg, run_dirs(cfg))
        return StartingPoint()
    if resume == "auto":
        folder, refusals = latest_verified(checkpoints)
        notes = [f"trainer.resume=auto: skipped {reason}" for reason in refusals]
        notes += [f"trainer.resume=auto: skipped {unfinished}: no checkpoint.json (its save did not finish)"
                  for unfinished in unfinished_checkpoints(checkpoints, after=folder)]
        if folder is None and refusals:
            raise ConfigError("trainer.resume=auto: no checkpoint of this run verifies:\n  " + "\n  ".join(refusals)
                              + "\nmove the damaged folders away, or set trainer.resume=null to start afresh")
        if folder is None and not training:  # validating fresh adapters is not what auto asked for
            raise ConfigError(f"trainer.resume=auto: no checkpoint of run {cfg.name!r} under {checkpoints} to "
                              f"validate: check name and paths.root, name a global_step_N folder, or leave "
                              f"trainer.resume unset to validate the starting adapters")
        if folder is not None:
            notes += _check_state(folder, "trainer.resume=auto", cfg, fitted if training else None)
            check_resume_adapters(cfg, folder, "trainer.resume=auto")
            if training:
                _check_steps_left(cfg, folder, "trainer.resume=auto")
                _check_kept_rollouts(cfg, folder, "trainer.resume=auto", fitted)
            notes.append(f"trainer.resume=auto: resuming from {folder} (verified)")
        elif notes:
            notes.append(f"trainer.resume=auto: no complete checkpoint under {checkpoints}: starting afresh")
        return StartingPoint(folder, str(lightning_state_path(folder)) if folder else None, notes)
    folder = Path(resume)
    if not folder.exists():
        raise ConfigError(f"trainer.resume={resume}: no such folder (a global_step_N folder of a run, or auto)")
    try:
        verify_checkpoint(folder)
    except CheckpointError as err:
        raise ConfigError(f"trainer.resume={resume}: {err}") from None
    notes = _check_state(folder, f"trainer.resume={resume}", cfg, fitted if training else None)
    check_resume_adapters(cfg, folder, f"trainer.resume={resume}")
    if training:
        _check_steps_left(cfg, folder, f"trainer.resume={resume}")
        _check_kept_rollouts(cfg, folder, f"trainer.resume={resume}", fitted)
    notes.append(f"trainer.resume: resuming from {folder} (verified)")
    return StartingPoint(folder, str(lightning_state_path(folder)), notes)


def unfinished_checkpoints(checkpoints: Path, after: Optional[Path]) -> list[Path]:
    """The checkpoints under ``checkpoints`` newer than ``after`` (all, when None) whose save
    began and did not finish: a ``global_step_M`` folder holding checkpoint parts but no marker
    (a kill between its parts' move and the marker), or a staging folder (``.tmp-global_step_M``,
    a kill while its files were written)."""
    from atlas_lightning.callbacks.checkpoint_write import staging_dir
    from atlas_lightning.store.checkpoints import MARKER, OPTIONAL_PARTS, PARTS, checkpoint_step

    newer_than = -1 if after is None else checkpoint_step(after)
    found = []
    for entry in sorted(Path(checkpoints).iterdir()) if Path(checkpoints).is_dir() else []:
        step = checkpoint_step(entry)
        if step is not None:
            begun = any((entry / part).exists() for part in PARTS + OPTIONAL_PARTS)
            unfinished = begun and not (entry / MARKER).exists()
        else:
            step = checkpoint_step(entry.name.rpartition("-")[2])
            unfinished = step is not None and entry == staging_dir(checkpoints, step)
        if unfinished and entry.is_dir() and step > newer_than:
            found.append(entry)
    return found


def _check_steps_left(cfg: DictConfig, folder: Path, key: str) -> None:
    """A resumed run trains steps N+1 .. ``trainer.total_steps`` after ``folder``'s step N: a
    ``trainer.total_steps`` below N is refused (it would write a run that trains nothing); N itself
    is a finished run, which ends at once; above N trains on (``PPOModule.on_load_checkpoint``)."""
    from atlas_lightning.store.checkpoints import checkpoint_step

    step = checkpoint_step(folder)
    if step is not None and step > int(cfg.trainer.total_steps):
        raise ConfigError(f"{key}: {folder} is step {step}, beyond trainer.total_steps={cfg.trainer.total_steps}: "
                          f"nothing would be trained; set trainer.total_steps above {step} to train on from it")


def _check_kept_rollouts(cfg: DictConfig, folder: Path, key: str,
                         fitted: Optional[Callable[[], QuestionSplits]]) -> None:
    """The trajectories ``folder`` keeps in flight (partial rollouts, ``rollout/inflight.py``)
    read back whole, and this run continues them: with scheduling by trajectory off (another
    layout, or ``layout.partial_rollouts=false``) their generated tokens would be dropped, and
    with it on each kept step must hold the trajectories this run samples for it
    (``_check_same_steps``)."""
    from atlas_lightning.rollout import inflight

    try:
        steps = inflight.restore(folder)
    except inflight.InflightError as err:
        raise ConfigError(f"{key}: {err}") from None
    tokens = inflight.saved_tokens(steps)
    continued = cfg.layout.mode == "separate" and bool(cfg.layout.get("partial_rollouts", False))
    if tokens and not continued:
        count = sum(len(opened.trajectories) for opened in steps.values())
        raise ConfigError(
            f"{key}: {folder} keeps {count} trajectories of step(s) {', '.join(map(str, sorted(steps)))} in flight "
            f"({tokens} generated tokens, partial rollouts); layout.mode={cfg.layout.mode} "
            f"layout.partial_rollouts={bool(cfg.layout.get('partial_rollouts', False))} would not continue them "
            f"and they would be lost: resume with layout.mode=separate layout.partial_rollouts=true")
    if steps and continued:
        _check_same_steps(cfg, folder, key, steps, fitted)


def _check_same_steps(cfg: DictConfig, folder: Path, key: str, steps: dict,
                      fitted: Optional[Callable[[], QuestionSplits]]) -> None:
    """Each kept step holds exactly the trajectories this run samples for it
    (``inflight.check_continued``): a step's questions are the sampler's draw from the training
    questions whose prompts fit under ``model.path``'s tokenizer (``fitted()``, the splits
    ``check_inputs`` fits for the run, or loaded and fitted here), as the data module draws them
    (``rollout/step_questions.py``), so ``rollout.n``, ``data.*`` or ``data.seed`` changed since the
    checkpoint are refused here, before anything is written."""
    from atlas_lightning.questions.loader import load_splits
    from atlas_lightning.rollout import inflight
    from atlas_lightning.rollout.step_questions import StepQuestions, fitted_splits

    splits = fitted() if fitted is not None else fitted_splits(cfg, load_splits(cfg.data), say=lambda _: None)
    sampled = StepQuestions(splits.train, cfg)
    try:
        inflight.check_continued(steps, sampled.keys, folder)
    except inflight.InflightError as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_state(folder: Path, key: str, cfg: DictConfig,
                 fitted: Optional[Callable[[], QuestionSplits]] = None) -> list[str]:
    """The checkpoint's Lightning state is whole, of this run's optimizer settings and in the
    format this run restores (``run/resume_state.py``; ``state_layout``) and, given the run's
    ``fitted()`` splits (a run that trains on), its data cursor of this run's training questions
    and sampling, or the key is refused. Returns what the log should say of it: a state of
    another world size, resharded."""
    from atlas_lightning.run.resume_state import ResumeStateError, check_resume_state

    sampling = None
    if fitted is not None:
        from atlas_lightning.rollout.step_questions import StepQuestions

        sampling = StepQuestions(fitted().train, cfg).digest
    mine = state_layout(cfg)
    try:
        saved = check_resume_state(folder, cfg.algorithm, sampling, layout=mine)
    except ResumeStateError as err:
        raise ConfigError(f"{key}: {err}") from None
    if not saved.sharded or saved.world_size == mine.world_size:
        return []
    return [f"{key}: {folder} was saved by {saved.world_size} rank(s), this run has {mine.world_size}: "
            f"torch.distributed.checkpoint reshards its tensors and Adam moments; the random draws (LoRA "
            f"dropout) do not continue those of the saved run exactly"]


def state_layout(cfg: DictConfig) -> StateLayout:
    """How this run saves and restores its Lightning state (``run/resume_state.StateLayout``): in
    the format the strategy it builds writes (``run/strategy_choice.build_strategy``,
    ``callbacks/checkpoint_write.writes_sharded_state``), at its world size."""
    from atlas_lightning.callbacks.checkpoint_write import writes_sharded_state
    from atlas_lightning.run.resume_state import StateLayout
    from atlas_lightning.run.strategy_choice import build_strategy

    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    return StateLayout(sharded=writes_sharded_state(build_strategy(cfg)), world_size=world)
