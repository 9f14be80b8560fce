"""What a resume reads besides the adapters and the optimizers, checked before anything is
written: the trajectories a checkpoint keeps in flight (``inflight/rank_<r>.pkl``: read as data
only, never code; every damage named with the file; kept trajectories refused where the run
would not continue them), every rank's random generator states (each one set on a generator of
its own), and the checkpoints whose save did not finish (``trainer.resume=auto`` skips them and
says so)."""

from __future__ import annotations

import os
import pickle
import re

import pytest

from atlas_lightning.config import ConfigError
from atlas_lightning.rollout import inflight
from atlas_lightning.rollout.agent_loop import Trajectory
from atlas_lightning.store.checkpoints import MARKER, write_marker
from tests.harness import callbacks_harness
from tests.store.test_checkpoint_verification import _checkpoint, _write_state, resumable_state

SEPARATE = ["layout=separate_cpu", "rollout=vllm_server_cpu", "layout.partial_rollouts=true"]


def _trajectory(uid="gt1-0", session="s2", tokens=3, **change) -> Trajectory:
    from atlas_lightning.env.episode import Episode

    harness = callbacks_harness()
    traj = Trajectory(uid=uid, session_id=session, episode=Episode(harness.TRAIN_QUESTIONS[0], 0),
                      prompt_ids=[1, 2, 3], response_ids=list(range(5, 5 + tokens)), response_mask=[1] * tokens,
                      response_logprobs=[-0.5] * tokens, response_versions=[2] * tokens)
    for key, value in change.items():
        setattr(traj, key, value)
    return traj


def _file(rank=0, steps=None, **content) -> bytes:
    steps = [{"step": 4, "version": 2, "trajectories": [_trajectory()]}] if steps is None else steps
    return pickle.dumps({"format": inflight.FORMAT, "rank": rank, "steps": steps, **content},
                        protocol=pickle.HIGHEST_PROTOCOL)


def _with_inflight(folder, files: dict[str, bytes]):
    """``folder`` (a checkpoint) with ``inflight/`` holding ``files``, its marker written anew
    (so that only the reading of the files, not the sha256 check, can refuse them)."""
    target = folder / inflight.FOLDER
    target.mkdir(exist_ok=True)
    for name, data in files.items():
        (target / name).write_bytes(data)
    (folder / MARKER).unlink()
    write_marker(folder, 3)
    return folder


class _RunsCode:
    """A pickle that would run a command when loaded by a plain unpickler."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_kept_trajectories_of_every_rank_read_back_and_resume(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs
    from tests.rollout.test_inflight_continued import kept_step_files

    files = kept_step_files(cfg_of(*SEPARATE), 4, ranks=2)  # written at world size 2, read at 1: merged by step
    folder = _with_inflight(_checkpoint(tmp_path / "elsewhere", 3), files)
    start = check_inputs(cfg_of(f"trainer.resume={folder}", *SEPARATE)).start
    assert start.resume == folder
    kept = inflight.restore(folder)
    count = sum(len(pickle.loads(data)["steps"][0]["trajectories"]) for data in files.values())
    assert list(kept) == [4] and len(kept[4].trajectories) == count and inflight.saved_tokens(kept) == 3 * count
    assert len(files) == 2 and count > 2


def test_what_a_question_read_from_parquet_holds_reads_back(tmp_path):
    """numpy scalars and arrays (a question's costs as a parquet gives them) are plain data."""
    import dataclasses

    import numpy as np

    traj = _trajectory()
    question = traj.episode.question
    costly = dataclasses.replace(question, candidates=tuple(dataclasses.replace(c, cost_usd=np.float64(c.cost_usd))
                                                            for c in question.candidates))
    traj.episode.question = costly
    traj.episode.proposed_calls.append({"ids": np.arange(3)})
    folder = _with_inflight(_checkpoint(tmp_path, 3), {"rank_0.pkl": _file(0, [
        {"step": 4, "version": 2, "trajectories": [traj]}])})
    kept = inflight.restore(folder)[4].trajectories[0]
    assert kept.episode.question == costly and (kept.episode.proposed_calls[0]["ids"] == np.arange(3)).all()


@pytest.mark.parametrize("name, data, message", [
    ("rank_0.pkl", b"\x80\x05garbage", "cannot be read as an in-flight file"),
    ("rank_0.pkl", None, "cannot be read as an in-flight file"),  # truncated
    ("rank_0.pkl", "code", "is not a class an in-flight file holds"),
    ("rank_0.pkl", pickle.dumps({"format": 99, "rank": 0, "steps": []}), "not an in-flight file of format 1"),
    ("rank_0.pkl", pickle.dumps(["not", "a", "dict"]), "not an in-flight file of format 1"),
    ("rank_1.pkl", "rank0", "holds rank 0's steps, not those of its name's rank"),
    ("notes.txt", b"x", "not an in-flight file (a checkpoint's inflight/ holds rank_<r>.pkl files only)"),
    ("rank_0.pkl", "old_step", "step 3 is not a step after the checkpoint's (3)"),
    ("rank_0.pkl", "bad_version", "version 'v2' is not an int"),
    ("rank_0.pkl", "not_a_trajectory", "a saved trajectory is a dict, not a Trajectory"),
    ("rank_0.pkl", "short_mask", "its response ids, mask, log-probs and versions are not lists of one length"),
    ("rank_0.pkl", "nan_logprob", "a log-prob is not a finite number"),
    ("rank_0.pkl", "negative_id", "a token id is not an int >= 0"),
    ("rank_0.pkl", "mask_2", "its response mask holds a value other than 0 and 1"),
    ("rank_1.pkl", "twice", "step 4 keeps trajectory gt1-0/s2 more than once"),
])
def test_an_inflight_file_that_is_not_what_capture_writes_is_refused_naming_it(tmp_path, cfg_of, name, data,
                                                                                message):
    from atlas_lightning.run.facts import check_inputs

    sentinel = tmp_path / "ran"
    made = {"code": lambda: pickle.dumps({"format": inflight.FORMAT, "rank": 0, "steps": [_RunsCode(sentinel)]}),
            "rank0": lambda: _file(0),
            "old_step": lambda: _file(0, [{"step": 3, "version": 2, "trajectories": []}]),
            "bad_version": lambda: _file(0, [{"step": 4, "version": "v2", "trajectories": []}]),
            "not_a_trajectory": lambda: _file(0, [{"step": 4, "version": 2, "trajectories": [{"uid": "x"}]}]),
            "short_mask": lambda: _file(0, [{"step": 4, "version": 2, "trajectories": [
                _trajectory(response_mask=[1])]}]),
            "nan_logprob": lambda: _file(0, [{"step": 4, "version": 2, "trajectories": [
                _trajectory(response_logprobs=[-0.5, float("nan"), -0.5])]}]),
            "negative_id": lambda: _file(0, [{"step": 4, "version": 2, "trajectories": [
                _trajectory(response_ids=[5, -1, 7])]}]),
            "mask_2": lambda: _file(0, [{"step": 4, "version": 2, "trajectories": [
                _trajectory(response_mask=[1, 2, 1])]}]),
            "twice": lambda: _file(1)}
    if data is None:
        data = _file(0)[:-40]
    elif isinstance(data, str):
        data = made[data]()
    files = {"rank_0.pkl": _file(0), name: data} if name != "rank_0.pkl" else {name: data}
    folder = _with_inflight(_checkpoint(tmp_path / "elsewhere", 3), files)
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg_of(f"trainer.resume={folder}", *SEPARATE))
    text = str(info.value)
    assert text.startswith(f"trainer.resume={folder}: {folder / inflight.FOLDER}") and message in text, text
    assert not sentinel.exists()  # nothing in the file ran
    assert not (tmp_path / "outputs").exists()


def test_a_damaged_inflight_file_fails_its_sha256_first(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs

    folder = _with_inflight(_checkpoint(tmp_path / "elsewhere", 3), {"rank_0.pkl": _file(0)})
    path = folder / inflight.FOLDER / "rank_0.pkl"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=re.escape("inflight/rank_0.pkl does not match its sha256")):
        check_inputs(cfg_of(f"trainer.resume={folder}", *SEPARATE))
    path.unlink()
    with pytest.raises(ConfigError, match=re.escape("inflight/rank_0.pkl is missing")):
        check_inputs(cfg_of(f"trainer.resume={folder}", *SEPARATE))


@pytest.mark.parametrize("layout", [[], ["layout=separate_cpu", "rollout=vllm_server_cpu"]],
                         ids=["colocated", "separate"])
def test_kept_tokens_a_run_would_not_continue_are_refused_naming_the_keys(tmp_path, cfg_of, layout):
    from atlas_lightning.run.facts import check_inputs

    folder = _with_inflight(_checkpoint(tmp_path / "elsewhere", 3), {"rank_0.pkl": _file(0)})
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg_of(f"trainer.resume={folder}", *layout))
    assert "keeps 1 trajectories of step(s) 4 in flight (3 generated tokens" in str(info.value)
    assert "layout.partial_rollouts=False would not continue them" in str(info.value)
    # a verb that does not train on (validate) reads the weights alone
    assert check_inputs(cfg_of(f"trainer.resume={folder}", *layout), training=False).start.resume == folder
    # steps opened but nothing generated yet: nothing would be lost
    empty = _with_inflight(_checkpoint(tmp_path / "empty", 3), {"rank_0.pkl": _file(0, [
        {"step": 4, "version": 2, "trajectories": [_trajectory(tokens=0)]}])})
    assert check_inputs(cfg_of(f"trainer.resume={empty}", *layout)).start.resume == empty


def _tree(root) -> dict[str, str]:
    """Every folder and file under ``root``: ``{relative path: sha256 of its bytes, or "folder"}``."""
    import hashlib

    return {str(p.relative_to(root)): "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def test_a_resume_whose_kept_steps_this_run_would_not_sample_exits_2_and_changes_no_file(
        tmp_path, cfg_of, tiny_model_dir, sample_data_dir, run_logs_removed):
    """Through the CLI: a run directory as a launch with ``rollout.n=2`` left it (its
    ``config.yaml`` and logs, a checkpoint keeping step 2 in flight), resumed with ``rollout.n=1``:
    refused in one line naming the checkpoint and the step, exit 2, every file as it was."""
    import subprocess
    import sys

    from atlas_lightning.run.wiring import prepare_run
    from tests.rollout.test_inflight_continued import checkpoint_keeping

    launch = [*SEPARATE, "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1"]
    prepare_run(cfg_of(*launch), "fit")  # what the launch that wrote the checkpoint left
    folder = checkpoint_keeping(cfg_of(*launch), tmp_path / "checkpoints" / "run", 2)
    before = _tree(tmp_path)
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"paths.root={tmp_path}",
               "name=run", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", *launch, "rollout.n=1",
               "trainer.resume=auto", "logger.mode=disabled"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert done.returncode == 2, done.stderr[-4000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert lines[0].startswith(f"atlas-lightning fit: config error: trainer.resume=auto: {folder}: step 2 in flight "
                               f"keeps 2 trajectories this run does not sample"), lines[0]
    assert _tree(tmp_path) == before


def _rng_damage(part):
    import torch

    def change(state):
        ranks = state["rng_states"]["ranks"]
        bad = dict(ranks[0])
        bad[part] = {"torch": torch.zeros(7, dtype=torch.uint8), "numpy": ("MT19937", torch.zeros(3), 0, 0, 0.0),
                     "python": (3, (1, 2), None), "torch.cuda": [torch.zeros(4)]}[part]
        return {**state, "rng_states": {"world_size": 1, "ranks": [bad]}}
    return change


@pytest.mark.parametrize("part, message", [
    ("torch", "rank 0's torch generator state cannot be set"),
    ("numpy", "rank 0's numpy generator state cannot be set"),
    ("python", "rank 0's python generator state cannot be set"),
    ("torch.cuda", "rank 0's CUDA generator states are not byte tensors"),
])
@pytest.mark.parametrize("distributed", [False, True], ids=["one_file", "distributed"])
def test_generator_states_that_cannot_be_set_are_refused_before_anything_is_written(tmp_path, cfg_of, part, message,
                                                                                  distributed):
    import random

    import numpy as np
    import torch

    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, _rng_damage(part)(resumable_state()), distributed)
    mine = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_inputs(cfg_of(f"trainer.resume={folder}"))
    # the check tried them on generators of its own: this process's are untouched
    assert torch.equal(torch.get_rng_state(), mine[0]) and (np.random.get_state()[1] == mine[1]).all()
    assert random.getstate() == mine[2]


def test_states_of_another_world_size_resume(tmp_path, cfg_of):
    """Two ranks' states read at world size 1: accepted (rank 0 takes its own; a warning at the
    start says the draws of the missing ranks do not continue exactly, ``rng_state.restore``)."""
    from atlas_lightning.run.facts import check_inputs

    state = resumable_state()
    state["rng_states"] = {"world_size": 2, "ranks": state["rng_states"]["ranks"] * 2}
    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, state, False)
    assert check_inputs(cfg_of(f"trainer.resume={folder}")).start.resume == folder


def test_a_state_lightning_would_not_load_is_refused_as_lightning_loads_it(tmp_path, cfg_of):
    """Lightning loads a resumed state weights-only: a state holding other objects is refused at
    the start, not by Lightning once the run has begun."""
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, {**resumable_state(), "extra": _RunsCode(tmp_path / "ran")}, False)
    with pytest.raises(ConfigError, match="state.ckpt cannot be read"):
        check_inputs(cfg_of(f"trainer.resume={folder}"))
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("unfinished", ["parts_without_marker", "staging_folder"])
def test_resume_auto_skips_a_save_that_did_not_finish_and_says_so(tmp_path, cfg_of, unfinished):
    from atlas_lightning.run.facts import check_inputs

    checkpoints = tmp_path / "checkpoints" / "run"
    good = _checkpoint(checkpoints, 3)
    if unfinished == "parts_without_marker":  # killed between the parts' move and the marker
        half = _checkpoint(checkpoints, 4)
        (half / MARKER).unlink()
    else:  # killed while the background write filled its staging folder
        half = checkpoints / ".tmp-global_step_4"
        (half / "lightning").mkdir(parents=True)
        (half / "lightning" / "state.ckpt").write_bytes(b"half")
    (checkpoints / "global_step_5" / "val_dumps").mkdir(parents=True)  # a validation's folder: no checkpoint
    start = check_inputs(cfg_of("trainer.resume=auto")).start
    assert start.resume == good
    assert start.notes == [f"trainer.resume=auto: skipped {half}: no checkpoint.json (its save did not finish)",
                           f"trainer.resume=auto: resuming from {good} (verified)"]
    # nothing complete at all: a fresh start, said so
    (good / MARKER).unlink()
    start = check_inputs(cfg_of("trainer.resume=auto")).start
    assert start.resume is None and start.notes[-1] == (
        f"trainer.resume=auto: no complete checkpoint under {checkpoints}: starting afresh")
    assert len(start.notes) == 3


def test_the_notes_reach_stderr_and_the_log(tmp_path, cfg_of, capsys, run_logs_removed):
    from atlas_lightning.run.wiring import prepare_run

    prepare_run(cfg_of(), "fit", notes=["trainer.resume=auto: skipped X: no checkpoint.json (its save did not finish)"])
    assert "atlas-lightning fit: trainer.resume=auto: skipped X" in capsys.readouterr().err
    assert "skipped X: no checkpoint.json" in (tmp_path / "outputs" / "run" / "main_ppo.log").read_text()


@pytest.fixture
def run_logs_removed():
    """The log handlers ``prepare_run`` adds, taken off again (they would outlive the test)."""
    import logging

    names = ("atlas_lightning", "lightning", "lightning.pytorch")
    before = {name: list(logging.getLogger(name).handlers) for name in names}
    yield
    for name in names:
        for handler in [h for h in logging.getLogger(name).handlers if h not in before[name]]:
            logging.getLogger(name).removeHandler(handler)
            handler.close()
