"""ArtifactDumpCallback: run.json and train/step_N/ against the README's "On-disk layout" (folders and record fields), driven by a
real Lightning Trainer; step folders appear whole or not at all."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
from pathlib import Path

import lightning
import numpy as np
import pytest
import torch

from atlas_lightning.store.step_folder import gather_step, remove_stale_temporaries, write_step_folder
from atlas_lightning.ppo.step_output import read_step_output
from atlas_lightning.config import run_dirs
from atlas_lightning.store.records import (
    RECORD_FIELDS,
    RecordError,
    read_record,
    read_step_tensors,
    verify_manifest,
)

#: Seed section 4: the reward breakdown's and the episode's named fields.
SEED_REWARD_FIELDS = (
    "objective", "final_reward", "training_reward", "acc", "cost", "cost_total",
    *(f"explore_reward_{k}" for k in range(1, 9)), "terminal_reward", "found_correct", "first_correct_k",
    "submitted_after_correct", "terminal_reason_code",
)
SEED_EPISODE_FIELDS = ("generations", "proposed_calls", "events", "terminal_reason", "token_counts")


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_train_steps_are_dumped_as_the_seed_lays_them_out(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=3, extra=[
        "++model.actor_adapter=/runs/r25/global_step_29/actor/lora_adapter",
        "++model.critic_adapter=/runs/r25/global_step_29/critic/lora_adapter",
        "trainer.init_from=/runs/r25/global_step_29",
    ])
    artifacts = run_dirs(cfg)["artifacts"]
    stale = artifacts / "train" / ".tmp-step_9-deadbeef"
    stale.mkdir(parents=True)
    (stale / "half.json").write_text("{")

    _, module, _ = h.fit(cfg, chat, [h.callback(cfg, "artifacts")])

    assert _visible(artifacts) == ["run.json", "train"]
    assert _visible(artifacts / "train") == ["step_1", "step_2", "step_3"]  # the crashed run's temporary is gone
    for step in (1, 2, 3):
        folder = artifacts / "train" / f"step_{step}"
        assert verify_manifest(folder) == []
        manifest = json.loads((folder / "manifest.json").read_text())
        batch = module.outputs[step]["batch"]
        assert manifest["step"] == step and manifest["partition"] == "train"
        assert manifest["counts"]["records"] == len(batch.records) == 6
        assert set(manifest["tensor_names"]) == set(h.TENSOR_NAMES)

        expected = {r.filename: r for r in batch.records}
        assert sorted(p.name for p in folder.glob("*_*.json")) == sorted(expected)
        for name, original in expected.items():
            record = read_record(folder / name)
            data = record.to_json_dict()
            assert list(data)[: len(RECORD_FIELDS)] == list(RECORD_FIELDS)
            assert record.partition == "train" and record.global_steps == step and record.run_id == cfg.name
            assert set(SEED_REWARD_FIELDS) <= set(record.reward)
            assert set(SEED_EPISODE_FIELDS) <= set(record.episode)
            assert record.reward_score == record.reward["training_reward"]
            assert record.written_at
            mine = original.to_json_dict()
            assert {k: v for k, v in data.items() if k != "written_at"} == {k: v for k, v in mine.items() if k != "written_at"}
            _assert_token_arrays(record, original)

        tensors = read_step_tensors(folder / "tensors.npz")
        output = module.outputs[step]
        for i, record in enumerate(batch.records):
            assert (tensors["uid"][i], tensors["session_id"][i]) == (record.uid, record.session_id)
            np.testing.assert_array_equal(tensors["response_ids"][i], record.response_ids)
            np.testing.assert_array_equal(tensors["response_mask"][i], record.response_mask)
            np.testing.assert_array_equal(tensors["values"][i], output["tensors"]["values"][i])
            # Independent reference: with gamma = lam = 1, GAE's return at a generated token is the
            # sum of the token rewards from there on (rewards sit on generated tokens only).
            mask = record.response_mask.astype(bool)
            rewards = tensors["token_rewards"][i]
            reward_to_go = np.cumsum(rewards[::-1])[::-1]
            np.testing.assert_allclose(tensors["returns"][i][mask], reward_to_go[mask], atol=1e-5)
            assert np.isclose(rewards.sum(), record.reward["final_reward"], atol=1e-6)


def _assert_token_arrays(record, original=None) -> None:
    """The record read back carries the four per-token arrays, of the lengths
    the episode's token counts give; ``original``: the in-memory record they must equal."""
    counts = record.episode["token_counts"]
    assert set(record.token_arrays()) == {"prompt_ids", "response_ids", "response_mask", "response_logprobs"}
    assert len(record.prompt_ids) == counts["prompt"] > 0
    assert len(record.response_ids) == len(record.response_logprobs) == counts["response"] > 0
    assert int(record.response_mask.sum()) == counts["generated"]
    assert int((record.response_mask == 0).sum()) == counts["tool_response"]
    if original is not None:
        for name, array in original.token_arrays().items():
            np.testing.assert_array_equal(getattr(record, name), array)


def test_run_json_names_code_packages_hosts_and_starting_adapters(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=1, extra=[
        "++model.actor_adapter=/runs/r25/global_step_29/actor/lora_adapter", "trainer.init_from=/runs/r25/global_step_29"])
    h.fit(cfg, chat, [h.callback(cfg, "artifacts")])
    run = json.loads((run_dirs(cfg)["artifacts"] / "run.json").read_text())

    checkout = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert run["code_revision"]["git_commit"] == head.stdout.strip()
    assert run["code_revision"]["package_version"] == "0.1.0"
    assert run["packages"]["torch"] == torch.__version__
    assert run["packages"]["lightning"] == lightning.__version__
    assert {"vllm", "transformers", "peft", "python"} <= set(run["packages"])
    assert run["hosts"]["world_size"] == 1
    assert run["hosts"]["hostnames"] == [socket.gethostname()]
    assert run["hosts"]["ranks"][0]["rank"] == 0 and run["hosts"]["ranks"][0]["device"] == "cpu"
    assert run["starting_adapters"]["actor_adapter"] == "/runs/r25/global_step_29/actor/lora_adapter"
    assert run["starting_adapters"]["critic_adapter"] is None
    assert run["starting_adapters"]["init_from"] == "/runs/r25/global_step_29"
    # (the folders do not exist here: the shapes recorded are the config's, named as such)
    assert run["starting_adapters"]["lora"]["critic"]["source"] == "model.lora"
    assert run["starting_adapters"]["lora"]["actor"]["shape"].startswith(f"r{cfg.model.lora.rank} ")
    assert run["config"]["name"] == cfg.name and run["config"]["trainer"]["total_steps"] == 1
    assert run["start_time"].endswith("Z") and len(run["launches"]) == 1


def test_a_relaunch_keeps_the_earlier_launches(tmp_path, h):
    cfg = h.make_cfg(tmp_path)
    hosts = [{"rank": 0, "hostname": "node-a"}, {"rank": 1, "hostname": "node-b"}]
    callback = h.callback(cfg, "artifacts")
    callback.write_run_json(hosts[:1], 1)
    path = callback.write_run_json(hosts, 2)
    run = json.loads(path.read_text())
    assert [launch["hosts"]["world_size"] for launch in run["launches"]] == [1, 2]
    assert run["hosts"]["hostnames"] == ["node-a", "node-b"]


@pytest.mark.parametrize("damaged", ['{"launches": [{"pid": 1}', '[1, 2]', '{"launches": 3}'])
def test_a_relaunch_over_an_unreadable_run_json_keeps_it_beside(tmp_path, h, caplog, damaged):
    """The earlier launches it held are not overwritten: the file is kept as
    ``run.json.unreadable-<time>``, a warning names both, and the new record starts afresh."""
    cfg = h.make_cfg(tmp_path)
    callback = h.callback(cfg, "artifacts")
    path = callback.artifacts / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(damaged)
    with caplog.at_level("WARNING"):
        callback.write_run_json([{"rank": 0, "hostname": "node-a"}], 1)
    kept = sorted(path.parent.glob("run.json.unreadable-*"))
    assert len(kept) == 1 and kept[0].read_text() == damaged
    assert len(json.loads(path.read_text())["launches"]) == 1
    assert f"{path} cannot be read back" in caplog.text and kept[0].name in caplog.text


def _records(h, chat, tmp_path, step=1):
    dm = h.ScriptedDataModule(h.make_cfg(tmp_path), chat)
    return dm.rollout(step).records


def test_a_crash_mid_write_leaves_no_step_folder(tmp_path, h, chat):
    records = _records(h, chat, tmp_path)
    parent = tmp_path / "train"
    write_step_folder(parent, 7, records)
    before = json.loads((parent / "step_7" / "manifest.json").read_text())

    broken = [copy.deepcopy(r) for r in records]
    broken[3].reward["cost"] = float("nan")  # JSON refuses it: the 4th record's write fails
    with pytest.raises(RecordError, match="cannot be written as JSON"):
        write_step_folder(parent, 8, broken)
    with pytest.raises(RecordError):
        write_step_folder(parent, 7, broken)  # a failed rewrite keeps the old folder whole
    assert _visible(parent) == ["step_7"]  # no step_8, no hidden temporary
    assert verify_manifest(parent / "step_7") == []
    assert json.loads((parent / "step_7" / "manifest.json").read_text())["files"] == before["files"]

    write_step_folder(parent, 7, records[:2])  # a successful rewrite replaces it whole
    assert _visible(parent) == ["step_7"]
    assert sorted(p.name for p in (parent / "step_7").glob("*_*.json")) == sorted(r.filename for r in records[:2])
    assert verify_manifest(parent / "step_7") == []


def test_stale_temporaries_are_removed(tmp_path):
    for name in (".tmp-step_3-0a1b2c3d", ".old-step_2-00000000", "step_2"):
        (tmp_path / name).mkdir()
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == [".old-step_2-00000000", ".tmp-step_3-0a1b2c3d"]
    assert _visible(tmp_path) == ["step_2"]


def test_tensors_that_do_not_fit_the_trajectories_are_refused(tmp_path, h, chat):
    records = _records(h, chat, tmp_path)
    good = [np.zeros(len(r.response_ids), np.float32) for r in records]
    with pytest.raises(ValueError, match=r"tensors\['values'\] has 5 arrays for 6 trajectories"):
        gather_step(4, records, {"values": good[:5]})
    bad = list(good)
    bad[2] = np.zeros(len(good[2]) + 1, np.float32)
    with pytest.raises(ValueError, match=f"step 4: tensors\\['values'\\] of trajectory {records[2].uid}/{records[2].session_id}"):
        gather_step(4, records, {"values": bad})
    with pytest.raises(ValueError, match="two trajectories are named"):
        gather_step(4, records + records[:1])


@pytest.mark.parametrize("outputs, message", [
    (None, "must be the step-output dict"),
    ({"step": 1}, "lacks key"),
    ({"step": 0, "batch": None, "tensors": {}, "metrics": {}, "finite": True}, "1-based RL step"),
    ({"step": 1, "batch": [], "tensors": {}, "metrics": {}, "finite": True}, "must be a RolloutBatch"),
    ({"step": 1, "batch": None, "tensors": {}, "metrics": {}, "finite": 1}, "'finite' must be a bool"),
])
def test_a_step_output_off_contract_is_named(outputs, message):
    with pytest.raises(ValueError, match=message):
        read_step_output(outputs, "test")


def test_a_nonfinite_output_needs_its_diagnostic(tmp_path, h, chat):
    dm = h.ScriptedDataModule(h.make_cfg(tmp_path), chat)
    batch = dm.rollout(2)
    with pytest.raises(ValueError, match="'nonfinite' is None"):
        read_step_output({"step": 2, "batch": batch, "tensors": {}, "metrics": {}, "finite": False}, "test")
    with pytest.raises(ValueError, match="'step' is 3 but its batch is of step 2"):
        read_step_output({"step": 3, "batch": batch, "tensors": {}, "metrics": {}, "finite": True}, "test")


def test_rank_zero_work_returns_or_raises_its_own_error():
    from atlas_lightning.distributed import on_rank_zero

    assert on_rank_zero(lambda: {"acc": 1.0}, "work") == {"acc": 1.0}
    with pytest.raises(KeyError, match="missing"):
        on_rank_zero(lambda: {}["missing"], "work")


def test_each_ranks_entry_records_what_its_models_auto_keys_became(tiny_model_dir):
    """``run.json``'s rank entries (``host_description``): the model's resolved kernels, attention
    bucket and recompute plan, and ``checkpoint_layers=auto``'s choice on the card with the free
    memory it measured (what ``bench/card/same_batch.sh`` plans a replay of the step for)."""
    from types import SimpleNamespace

    from atlas_lightning.callbacks.artifacts import host_description
    from atlas_lightning.config import LoraConfig, compose
    from atlas_lightning.planning import planned_shape
    from atlas_lightning.run.recompute import choose_for
    from tests.model_builds import actor_critic

    model = actor_critic(tiny_model_dir, LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules="all-linear"),
                         attn_implementation="sdpa_varlen")
    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}"])
    gib = 2.0**30
    choice = choose_for(cfg, planned_shape(cfg), free=20 * gib, card=24 * gib)[0]
    module = SimpleNamespace(device=torch.device("cpu"), model=model, checkpoint_layers_for=SimpleNamespace(choice=choice))
    entry = host_description(SimpleNamespace(global_rank=0, local_rank=0, node_rank=0), module)
    layers = len(model.decoder_layers())
    # built without gradient checkpointing (the test builder's default): no layer replays anything
    assert entry["model"] == {"built_on": "cpu", "elementwise_kernels": "torch", "linear_attention_kernel": None,
                              "attention_length_bucket": 0, "layer_recompute": {"none": layers},
                              "recompute_tiers": []}
    assert entry["recompute"]["free_gib"] == pytest.approx(20.0) and entry["recompute"]["layers"] == layers
    assert json.loads(json.dumps(entry)) == entry  # as run.json holds it
    # a module without a model or a choice (a scripted one) records its host alone
    bare = host_description(SimpleNamespace(global_rank=0, local_rank=0, node_rank=0),
                            SimpleNamespace(device=torch.device("cpu")))
    assert "model" not in bare and "recompute" not in bare
