"""A resume at another number of ranks (``run/resume_state.py``, ``StateLayout``).

A torch.distributed (FSDP2) checkpoint resumes at another world size: every trainable tensor and
AdamW value, restored at three ranks from a checkpoint two ranks wrote, equals the saved one, and
the resumed run trains on. A state in the other format (one file, a single CPU process; a
torch.distributed folder, FSDP2) is refused before anything is written, naming what it was saved
with, what this run restores and how to go on (Lightning would fail inside ``fit``, after the
run's config and log were written: a size mismatch on every rank, or ``IsADirectoryError``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_lightning.config import ConfigError
from tests.run.test_resume_kept_state import _tree, run_logs_removed  # noqa: F401 (a fixture)
from tests.store.test_checkpoint_verification import _checkpoint, _write_state, resumable_state, restoring

TESTS = Path(__file__).resolve().parents[1]
FORKED_RANKS = TESTS / "forked_ranks.py"
WORKER = Path(__file__).with_name("resume_world_worker.py")


def _state_of(world: int) -> dict:
    """``resumable_state`` as ``world`` ranks save it (every rank's generator states)."""
    state = resumable_state()
    state["rng_states"] = {"world_size": world, "ranks": state["rng_states"]["ranks"] * world}
    return state


@pytest.mark.parametrize("distributed", [True, False], ids=["fsdp_to_one_process", "one_file_to_fsdp"])
def test_a_state_of_the_other_format_is_refused_before_anything_is_written(tmp_path, cfg_of, distributed):
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, _state_of(2 if distributed else 1), distributed)
    assert check_inputs(cfg_of(f"trainer.resume={folder}", *restoring(distributed))).start.resume == folder
    before = _tree(tmp_path)
    with pytest.raises(ConfigError) as refused:
        check_inputs(cfg_of(f"trainer.resume={folder}", *restoring(not distributed)))
    message = str(refused.value)
    if distributed:
        said = ("saved by 2 rank(s) as a torch.distributed checkpoint folder (FSDP2); this run (1 rank(s)) restores "
                "only one file, lightning/state.ckpt (one CPU process, no FSDP2)")
        back = "resume under FSDP2: on GPUs, or on 2 CPU processes as saved (trainer.devices=2 layout.train_gpus=2)"
    else:
        said = ("saved by 1 rank(s) as one file, lightning/state.ckpt (one CPU process, no FSDP2); this run "
                "(2 rank(s)) restores only a torch.distributed checkpoint folder (FSDP2)")
        back = "resume on one CPU process (trainer.devices=1 layout.gpus=1 layout.train_gpus=1)"
    assert message.startswith(f"trainer.resume={folder}: checkpoint {folder}: its Lightning state was {said}"), message
    assert message.endswith(f"{back}, or start a new run from its adapters with trainer.init_from={folder} "
                            f"trainer.resume=null and another name"), message
    assert "\n" not in message and _tree(tmp_path) == before


def test_a_distributed_state_of_another_world_size_resumes_and_the_log_says_so(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, _state_of(2), True)
    start = check_inputs(cfg_of(f"trainer.resume={folder}", "trainer.devices=3", "layout.gpus=3",
                                "layout.train_gpus=3", "algorithm.train_batch_size=6",
                                "algorithm.ppo_mini_batch_size=3")).start
    assert start.resume == folder
    assert start.notes[0] == (f"trainer.resume={folder}: {folder} was saved by 2 rank(s), this run has 3: "
                              f"torch.distributed.checkpoint reshards its tensors and Adam moments; the random "
                              f"draws (LoRA dropout) do not continue those of the saved run exactly")


@pytest.mark.usefixtures("run_logs_removed")
def test_one_process_resumed_at_two_through_the_cli_exits_2_and_changes_no_file(
        tmp_path, cfg_of, tiny_model_dir, sample_data_dir):
    """As the launch that wrote it left the run's folder (its ``config.yaml``, logs, a one-file
    checkpoint), resumed with ``trainer.resume=auto`` at two ranks: one line, exit 2, every file
    as it was (Lightning's restore failed on both ranks, after rewriting them)."""
    from atlas_lightning.run.wiring import prepare_run

    prepare_run(cfg_of(), "fit")
    folder = _checkpoint(tmp_path / "checkpoints" / "run", 2)
    before = _tree(tmp_path)
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"paths.root={tmp_path}",
               "name=run", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", "trainer.resume=auto",
               "trainer.total_steps=3", *restoring(True), "logger.mode=disabled"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert done.returncode == 2, done.stderr[-4000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert lines[0].startswith(f"atlas-lightning fit: config error: trainer.resume=auto: checkpoint {folder}: its "
                               f"Lightning state was saved by 1 rank(s) as one file"), lines[0]
    assert f"trainer.init_from={folder} trainer.resume=null" in lines[0]
    assert _tree(tmp_path) == before


def _ranks(world: int, model: Path, root: Path, mode: str) -> dict:
    done = subprocess.run([sys.executable, str(FORKED_RANKS), str(world), str(WORKER), str(model), str(root), mode],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "result.json").read_text())


@pytest.mark.multiprocess
def test_a_distributed_checkpoint_of_two_ranks_restores_at_three_with_every_value_equal(tiny_model_dir, tmp_path):
    """Two ranks train RL steps 1-2 (LoRA dropout on, a checkpoint each step); three ranks resume
    from step 2 (uneven shards): every trainable tensor and every AdamW value gathered whole after
    the restore equals the saved one, while step 1's differ (the comparison sees a change), and
    step 3 trains. ~45 s on two cores."""
    from atlas_lightning.run.resume_state import check_resume_state

    assert _ranks(2, tiny_model_dir, tmp_path, "save")["rl_step"] == 2
    saved = check_resume_state(tmp_path / "checkpoints" / "ppo" / "global_step_2")
    assert saved.sharded and saved.world_size == 2
    result = _ranks(3, tiny_model_dir, tmp_path, "load")
    assert result["world"] == 3 and result["rl_step"] == 3
    assert result["compared"] > 100 and result["differ"] == [], result["differ"]
    assert result["differ_from_step_1"] > result["compared"] // 3  # the moments and factors moved in step 2
