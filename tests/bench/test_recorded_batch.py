"""The batch benchmark replaying a batch ``fit`` trained on (``bench/recorded_batch.py``): the step
folder read back as ``PPOModule`` packs it, the run's update shape, the update's optimizer steps and
loss divisors, and refusals of folders it cannot replay (exit 2, nothing run)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from atlas_lightning.bench import update_bench
from atlas_lightning.bench.batch import ActorUpdate
from atlas_lightning.bench.recorded_batch import RecordedBatchError, read_recorded_batch
from atlas_lightning.bench.workload import recorded_ppo_inputs
from atlas_lightning.config import compose
from atlas_lightning.env import Episode
from atlas_lightning.ppo.module import _contiguous_chunks
from atlas_lightning.reward import score_episode
from atlas_lightning.store.records import build_record
from atlas_lightning.store.step_folder import write_step_folder
from atlas_lightning.callbacks.artifacts import ArtifactDumpCallback

#: (prompt tokens, generated tokens a turn, tool-response tokens) of each trajectory
SHAPES = [(30, 20, 40), (12, 8, 100), (50, 33, 9), (7, 60, 60), (25, 5, 5), (40, 44, 12)]


def _record(build, index: int, prompt: int, turn: int, tool: int, high_id: int):
    question = build.question()
    episode = Episode(question, 0)
    episode.on_prompt_tokens(prompt)
    build.run(episode, [build.call("explore"), build.call("submit", {"answer": "B"})], turn_len=turn,
              response_len=tool)
    mask = np.array([1] * turn + [0] * tool + [1] * turn, dtype=np.int8)
    rng = np.random.default_rng(index)
    arrays = dict(prompt_ids=rng.integers(0, high_id, prompt), response_ids=rng.integers(0, high_id, len(mask)),
                  response_mask=mask)
    return build_record(episode.to_record_episode(), score_episode(episode.to_record_episode(), 0.1), run_id="run",
                        partition="train", global_steps=1, uid=f"u{index}", session_id="s0",
                        ground_truth=question.ground_truth, **arrays)


def write_run(tmp_path, build, *, world: int = 1, high_id: int = 512, algorithm: dict | None = None,
              resolved: dict | None = None):
    """A run's artifacts as ``fit`` writes them: ``run.json`` (``ArtifactDumpCallback``; ``resolved``:
    rank 0's model entry, ``ActorCritic.resolved_keys``) and ``train/step_1`` (``write_step_folder``)
    of SHAPES' trajectories; the step folder."""
    algorithm = {"train_batch_size": 6, "ppo_mini_batch_size": 2, "ppo_epochs": 2,
                 "ppo_max_token_len_per_gpu": 400, **(algorithm or {})}
    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", "name=run", "model.head_dtype=float32",
                   "model.lora.rank=4", "model.logprob_chunk_tokens=96",
                   *(f"algorithm.{key}={value}" for key, value in algorithm.items())])
    artifacts = tmp_path / "artifacts" / "run"
    ArtifactDumpCallback(artifacts, "run", config=OmegaConf.to_container(cfg, resolve=True)).write_run_json(
        [{"hostname": "h", "rank": r, **({"model": resolved} if resolved and r == 0 else {})} for r in range(world)],
        world)
    records = [_record(build, i, *shape, high_id) for i, shape in enumerate(SHAPES)]
    return write_step_folder(artifacts / "train", 1, records), records


def test_the_step_reads_back_as_the_module_packs_it(tmp_path, build):
    folder, records = write_run(tmp_path, build)
    batch = read_recorded_batch(folder)
    assert len(batch.sequences) == len(SHAPES)
    for record, sequence, prompt, mask in zip(records, batch.sequences, batch.prompt_lengths, batch.response_masks):
        np.testing.assert_array_equal(sequence, np.concatenate([record.prompt_ids, record.response_ids]))
        assert prompt == len(record.prompt_ids)
        np.testing.assert_array_equal(mask, record.response_mask.astype(np.float32))
    assert (batch.epochs, batch.mini_batches, batch.budget, batch.world_size) == (2, 3, 400, 1)
    assert batch.model_keys["head_dtype"] == "float32" and batch.model_keys["lora"]["rank"] == 4
    assert batch.mini_batch_indices() == _contiguous_chunks(len(SHAPES), 3) == [[0, 1], [2, 3], [4, 5]]


def test_of_two_ranks_one_card_updates_the_first_half(tmp_path, build):
    folder, records = write_run(tmp_path, build, world=2)
    batch = read_recorded_batch(folder)
    assert batch.world_size == 2 and len(batch.sequences) == 3
    np.testing.assert_array_equal(batch.sequences[2], np.concatenate([records[2].prompt_ids, records[2].response_ids]))


def test_the_update_steps_once_a_mini_batch_an_epoch_each_over_its_own_tokens(tmp_path, build, monkeypatch):
    """``ActorUpdate`` as ``PPOModule._update``: every micro-step's loss divisor is its own
    mini-batch's loss tokens, and one optimizer step follows each mini-batch, every epoch."""
    from atlas_lightning.bench import batch as batch_module

    folder, _ = write_run(tmp_path, build)
    recorded = read_recorded_batch(folder)
    inputs = recorded_ppo_inputs(recorded, torch.device("cpu"))
    seen = []
    monkeypatch.setattr(batch_module, "_micro_step", lambda runner, inputs, indices, total: seen.append(
        (tuple(indices), total)))
    monkeypatch.setattr(batch_module, "_actor_parameters", lambda runner: [torch.nn.Parameter(torch.zeros(2))])
    minis = [[[0], [1]], [[2, 3]], [[4, 5]]]
    update = ActorUpdate(type("Runner", (), {"device": torch.device("cpu")})(), inputs, minis, epochs=2)
    steps = []
    monkeypatch.setattr(update, "_step", lambda: steps.append(len(seen)))
    update()
    loss_tokens = [float(sum(recorded.response_masks[i].sum() for i in chunk)) for chunk in ([0, 1], [2, 3], [4, 5])]
    expected = [((0,), loss_tokens[0]), ((1,), loss_tokens[0]), ((2, 3), loss_tokens[1]), ((4, 5), loss_tokens[2])]
    assert seen == expected * 2
    assert steps == [2, 3, 4, 6, 7, 8]
    assert update.tokens == 2 * sum(len(s) for s in recorded.sequences)


def test_the_tiny_bench_replays_the_recorded_batch(tmp_path, build):
    folder, _ = write_run(tmp_path, build)
    out = tmp_path / "bench.json"
    assert update_bench.main(["--tiny", "--models", "tiny", "--sweep-layers", "0", "--sections", "batch",
                              "--paths", "ours", "--batch-from", str(folder), "--out", str(out)]) == 0
    batch = json.loads(out.read_text())["models"]["tiny"]["batch"]
    recorded = read_recorded_batch(folder)
    assert batch["source"] == str(folder) and batch["sequences"] == len(SHAPES)
    assert batch["real_tokens"] == sum(len(s) for s in recorded.sequences)
    assert batch["loss_tokens"] == sum(int(m.sum()) for m in recorded.response_masks)
    update = batch["ours"]["update"]
    assert (update["epochs"], update["mini_batches"]) == (2, 3)
    assert update["tokens_per_s"] == pytest.approx(2 * batch["real_tokens"] / update["seconds"])
    assert all(tokens <= 400 for tokens in update["micro_batch_tokens"])
    assert batch["ours"]["attempts"][0]["budget"] == 400
    settings = json.loads(out.read_text())["settings"]
    assert (settings["rank"], settings["chunk"]) == (4, 96)  # the run's LoRA rank and chunk


@pytest.mark.parametrize("elementwise, unlike", [("torch", {}), ("liger", {"elementwise_kernels": ["torch", "liger"]})])
def test_a_replay_says_where_its_kernels_resolved_otherwise_than_the_runs(tmp_path, build, elementwise, unlike):
    """The run recorded what its model's ``auto`` keys became; a replay here (a CPU: torch's
    kernels) that resolves otherwise says so in its entry, and nothing where they agree."""
    folder, _ = write_run(tmp_path, build, resolved={"elementwise_kernels": elementwise, "linear_attention_kernel": None,
                                                     "attention_length_bucket": 0})
    out = tmp_path / "bench.json"
    assert update_bench.main(["--tiny", "--models", "tiny", "--sweep-layers", "0", "--sections", "batch",
                              "--paths", "ours", "--batch-from", str(folder), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["models"]["tiny"]["batch"]["ours"]["resolved_unlike_the_run"] == unlike


def test_the_benchmark_builds_the_runs_model_keys(tmp_path, build, monkeypatch):
    """Our path's model config is the recorded run's (head dtype, LoRA, chunk, kernels), not the
    benchmark's defaults."""
    folder, _ = write_run(tmp_path, build)
    args = update_bench.parse_args(["--tiny", "--models", "tiny", "--batch-from", str(folder)])
    built = []
    monkeypatch.setattr(update_bench, "OursRunner", lambda model_cfg, *a, **k: built.append(model_cfg))
    update_bench.Bench(args)._ours(update_bench.shape_by_name("tiny"), 1, None)
    (model_cfg,) = built
    assert model_cfg.head_dtype == "float32" and model_cfg.lora.rank == 4 and model_cfg.logprob_chunk_tokens == 96
    assert model_cfg.dtype == read_recorded_batch(folder).model_keys["dtype"]
    assert model_cfg.elementwise_kernels == read_recorded_batch(folder).model_keys["elementwise_kernels"]
    # an explicit --elementwise-kernels still sets ours (update_suite's dense-torch step)
    args = update_bench.parse_args(["--tiny", "--models", "tiny", "--batch-from", str(folder),
                                    "--elementwise-kernels", "torch"])
    update_bench.Bench(args)._ours(update_bench.shape_by_name("tiny"), 1, None)
    assert built[-1].elementwise_kernels == "torch" and built[-1].head_dtype == "float32"


@pytest.mark.parametrize("damage, named", [
    ("no tensors", "tensors.npz: not found"),
    ("no run.json", "run.json: not found"),
    ("no epochs", "lacks a positive whole ppo_epochs"),
    ("no head dtype", "config.model lacks head_dtype"),
    ("mini-batch not dividing", "ppo_mini_batch_size 4 does not divide train_batch_size 6"),
    ("other vocabulary", "token id 9"),
])
def test_a_folder_it_cannot_replay_exits_2_naming_it(tmp_path, build, capsys, damage, named):
    folder, _ = write_run(tmp_path, build, high_id=10_000 if damage == "other vocabulary" else 512)
    run_json = folder.parent.parent / "run.json"
    if damage == "no tensors":
        (folder / "tensors.npz").unlink()
    elif damage == "no run.json":
        run_json.unlink()
    elif damage in ("no epochs", "mini-batch not dividing", "no head dtype"):
        run = json.loads(run_json.read_text())
        if damage == "no epochs":
            del run["config"]["algorithm"]["ppo_epochs"]
        elif damage == "no head dtype":
            del run["config"]["model"]["head_dtype"]
        else:
            run["config"]["algorithm"]["ppo_mini_batch_size"] = 4
        run_json.write_text(json.dumps(run))
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exit_:
        update_bench.main(["--tiny", "--models", "tiny", "--sections", "batch", "--batch-from", str(folder),
                           "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-from" in err and named in err and "Traceback" not in err
    assert not out.exists()
    if damage != "other vocabulary":
        with pytest.raises(RecordedBatchError, match=named.split(":")[0]):
            read_recorded_batch(folder)
