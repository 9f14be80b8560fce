"""A torch.distributed (FSDP2) checkpoint whose trainable tensors or optimizer state hold a NaN or
an inf is refused before a resume writes anything (``run/resume_values.py``), as a single-file
state is: a real checkpoint of the PPO module at two ranks (gloo, each rank's shards in its own
``.distcp``), one value rewritten through torch.distributed.checkpoint in the same layout and its
marker rewritten (a state saved with the NaN verifies against its own marker)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_lightning.run.resume_state import ResumeStateError, check_resume_state
from atlas_lightning.store.checkpoints import MARKER, checkpoint_step, lightning_state_path, write_marker
from tests.run.test_resume_kept_state import _tree, run_logs_removed  # noqa: F401 (a fixture)
from tests.e2e_variants import first_variant_in_make_test

pytestmark = pytest.mark.multiprocess

TESTS = Path(__file__).resolve().parents[1]
FORKED_RANKS = TESTS / "forked_ranks.py"
CHECKPOINTING = TESTS / "callbacks" / "ppo_checkpoint_worker.py"
DAMAGE = Path(__file__).with_name("dcp_damage_worker.py")


def _ranks(*args: str) -> None:
    done = subprocess.run([sys.executable, str(FORKED_RANKS), "2", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def fsdp_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """``global_step_3`` of the PPO module trained three steps under FSDP2 at two ranks."""
    root = tmp_path_factory.mktemp("fsdp")
    _ranks(str(CHECKPOINTING), str(tiny_model_dir), str(root))
    return root / "checkpoints" / "ppo" / "global_step_3"


def _damaged(source: Path, folder: Path, prefix: str, part: str, suffix: str, value: str) -> tuple[str, int]:
    """``source`` copied to ``folder`` with the last value of its first tensor named
    ``prefix...part...suffix`` set to ``value`` (two ranks rewrite their shards), marker rewritten:
    the tensor's key and how many values it has."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(source, folder)
    state = lightning_state_path(folder)
    metadata = FileSystemReader(str(state)).read_metadata().state_dict_metadata
    key = next(key for key in sorted(metadata) if key.startswith(prefix) and part in key and key.endswith(suffix))
    values = metadata[key].size.numel()
    _ranks(str(DAMAGE), str(state), key, str(values - 1), value)
    (folder / MARKER).unlink()
    write_marker(folder, checkpoint_step(folder))
    return key, values


#: (damage, key prefix, part of the key, key suffix, value, what the refusal says of the key)
def _named(case: tuple) -> str:
    return case[0]


#: Each case copies and rewrites the distributed checkpoint: the first in ``make test``, the
#: others in ``make test-e2e``.
_CLI = [
    ("nan_in_an_actor_lora_factor", "state_dict.", ".lora_B.actor.", ".weight", "nan",
     lambda key, n: f"its Lightning state's trainable tensor {key.removeprefix('state_dict.')} holds 1 NaN or inf "
                    f"value(s) of {n}"),
    ("inf_in_a_critic_exp_avg_sq", "optimizer_1.state.", ".lora_A.critic.", ".exp_avg_sq", "inf",
     lambda key, n: f"the critic optimizer's exp_avg_sq holds 1 NaN or inf value(s) of {n} (parameter "
                    f"{key.removeprefix('optimizer_1.state.').removesuffix('.exp_avg_sq')})"),
]


@pytest.mark.usefixtures("run_logs_removed")
@pytest.mark.parametrize("damage, prefix, part, suffix, value, said", first_variant_in_make_test(_CLI, _named))
def test_a_distributed_checkpoint_holding_nan_or_inf_exits_2_and_changes_no_file(
        fsdp_checkpoint, tmp_path, cfg_of, tiny_model_dir, sample_data_dir, damage, prefix, part, suffix, value, said):
    """Through the CLI: a run's folder as its launch left it (``config.yaml``, logs) and its
    checkpoint with one value not finite: exit 2, one line naming the checkpoint and the tensor,
    no traceback, every file as it was."""
    from atlas_lightning.run.wiring import prepare_run

    prepare_run(cfg_of(), "fit")
    folder = tmp_path / "checkpoints" / "run" / "global_step_3"
    key, values = _damaged(fsdp_checkpoint, folder, prefix, part, suffix, value)
    before = _tree(tmp_path)
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"paths.root={tmp_path}",
               "name=run", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"trainer.resume={folder}",
               "logger.mode=disabled"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert done.returncode == 2, done.stderr[-4000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert lines[0] == (f"atlas-lightning fit: config error: trainer.resume={folder}: checkpoint {folder}: "
                        f"{said(key, values)}: resume from an earlier checkpoint"), lines[0]
    assert _tree(tmp_path) == before


#: The rest of the class, each part of the state once: the critic's value head (whole in rank 0's
#: shard), the actor optimizer's moments, a step (a tensor every rank holds whole).
_PARTS = [
    ("nan_in_the_value_head", "state_dict.", "value_head.", ".weight", "nan",
     "its Lightning state's trainable tensor model.value_head.weight holds 1 NaN or inf value(s) of 128"),
    ("minus_inf_in_an_actor_exp_avg", "optimizer_0.state.", ".lora_B.actor.", ".exp_avg", "-inf",
     "the actor optimizer's exp_avg holds 1 NaN or inf value(s) of "),
    ("nan_in_a_critic_step", "optimizer_1.state.", ".critic.", ".step", "nan",
     "the critic optimizer's step holds 1 NaN or inf value(s) of 1 (parameter "),
]


@pytest.mark.parametrize("damage, prefix, part, suffix, value, said", first_variant_in_make_test(_PARTS, _named))
def test_every_floating_tensor_of_a_distributed_state_is_checked(fsdp_checkpoint, tmp_path, damage, prefix, part,
                                                                 suffix, value, said):
    check_resume_state(fsdp_checkpoint)  # the run's own checkpoint: whole and finite
    folder = tmp_path / "global_step_3"
    _damaged(fsdp_checkpoint, folder, prefix, part, suffix, value)
    with pytest.raises(ResumeStateError) as refused:
        check_resume_state(folder)
    assert str(refused.value).startswith(f"checkpoint {folder}: {said}"), str(refused.value)
