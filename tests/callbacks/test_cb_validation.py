"""ValidationCallback: when it runs, its metrics against hand-computed values, verl's dump, the
val/step_N records, and that it leaves training's random draws alone."""

from __future__ import annotations

import json
import random

import lightning as L
import pytest
import torch

from atlas_lightning.reward.summary import view_metrics
from atlas_lightning.callbacks.validation import DUMP_KEYS, ValidationCallback, dump_rows
from atlas_lightning.config import run_dirs
from atlas_lightning.store.records import read_record, verify_manifest

# Hand-computed from cb_harness.VAL_SCRIPTS with lambda = 0.1 points a dollar:
# gv1 acc 1, $0.2, 1 explore; gv2 acc 0; gv3 acc 1, $1.5, 2 explores (physics: gv1, gv2; chemistry: gv3);
# lv1 acc 1, $0.9, 2 explores (easy); lv2 no tool call (hard).
EXPECTED = {
    "gpqa/overall/acc": 2 / 3, "gpqa/overall/cost_usd": 1.7 / 3, "gpqa/overall/cost": 0.17 / 3,
    "gpqa/overall/objective": (0.98 + 0.0 + 0.85) / 3, "gpqa/overall/explores": 1.0,
    "gpqa/physics/acc": 0.5, "gpqa/physics/objective": 0.49, "gpqa/physics/cost_usd": 0.1, "gpqa/physics/explores": 0.5,
    "gpqa/chemistry/acc": 1.0, "gpqa/chemistry/objective": 0.85, "gpqa/chemistry/cost": 0.15,
    "lcb/overall/acc": 0.5, "lcb/overall/objective": 0.455, "lcb/overall/cost_usd": 0.45, "lcb/overall/explores": 1.0,
    "lcb/easy/acc": 1.0, "lcb/easy/cost_usd": 0.9, "lcb/hard/acc": 0.0, "lcb/hard/explores": 0.0,
    "val/reward/acc": 0.6, "val/trajectories": 5.0, "val/terminal/submitted": 0.8, "val/terminal/no_tool_call": 0.2,
}
EXPECTED_ACC = {"gpqa-gv1": 1, "gpqa-gv2": 0, "gpqa-gv3": 1, "lcb-lv1": 1, "lcb-lv2": 0}


#: The folder and name arguments, for tests that write nothing.
FOLDERS = {"artifacts": "artifacts", "checkpoints": "checkpoints", "run_id": "run"}


def _val_logs(module):
    return {step: metrics for step, metrics in module.logged if "gpqa/overall/acc" in metrics}


def test_validation_runs_before_training_every_n_steps_and_at_the_last(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=3)
    _, module, dm = h.fit(cfg, chat, [h.callback(cfg, "validation", val_every=2)])
    assert dm.val_calls == [0, 2, 3]
    logs = _val_logs(module)
    assert sorted(logs) == [0, 2, 3]
    for metrics in logs.values():
        for key, value in EXPECTED.items():
            assert metrics[key] == pytest.approx(value, abs=1e-9), key
        assert metrics["timing_s/testing"] > 0
        assert not any(k.startswith("gpqa/easy") or k.startswith("lcb/physics") for k in metrics)

    dirs = run_dirs(cfg)
    assert sorted(p.name for p in dirs["checkpoints"].iterdir()) == ["global_step_0", "global_step_2", "global_step_3"]
    questions = {q.question_id: q for q in h.VAL_QUESTIONS}
    for step in (0, 2, 3):
        lines = (dirs["checkpoints"] / f"global_step_{step}" / "val_dumps" / f"{step}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert sorted(row["uid"] for row in rows) == sorted(EXPECTED_ACC)
        for row in rows:
            qid = row["uid"].split("-", 1)[1]
            assert set(DUMP_KEYS) <= set(row)
            assert row["step"] == step and row["gts"] == questions[qid].ground_truth
            assert row["acc"] == EXPECTED_ACC[row["uid"]]
            assert row["score"] == row["training_reward"] == row["final_reward"]
            assert f"{qid}: " in row["input"] and "<|im_start|>" not in row["input"]
            if h.VAL_SCRIPTS[qid][-1].startswith("S:"):
                assert '"name": "submit"' in row["output"]
            if "E" in h.VAL_SCRIPTS[qid]:
                assert "<tool_response>" in row["output"]  # tool responses are part of the response

        folder = dirs["artifacts"] / "val" / f"step_{step}"
        assert verify_manifest(folder) == []
        records = [read_record(p) for p in sorted(folder.glob("*_*.json"))]
        assert len(records) == 5
        for record in records:  # the four per-token arrays, as long as the token counts say
            counts = record.episode["token_counts"]
            assert len(record.prompt_ids) == counts["prompt"] > 0
            assert len(record.response_ids) == len(record.response_logprobs) == counts["response"] > 0
            assert int(record.response_mask.sum()) == counts["generated"]
        assert all(r.partition == "val" and r.global_steps == step for r in records)
        assert {r.uid: r.reward["acc"] for r in records} == EXPECTED_ACC


def test_validation_leaves_training_random_draws_alone(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=3)
    # The harness's validation rollout does draw from the global RNGs (as an engine may) ...
    dm = h.ScriptedDataModule(cfg, chat)
    state = (random.getstate(), torch.get_rng_state())
    dm.validation_rollout(0)
    assert random.getstate() != state[0] and not torch.equal(torch.get_rng_state(), state[1])

    draws = []
    for callbacks in ([], [h.callback(cfg, "validation", val_every=1)]):
        L.seed_everything(123, verbose=False)
        _, module, dm = h.fit(cfg, chat, callbacks)
        draws.append(module.draws)
    # ... yet training draws exactly what it draws without validation.
    assert dm.val_calls == [0, 1, 2, 3]
    assert draws[0] == draws[1] and len(draws[0]) == 3


def test_no_step_0_when_disabled_or_resumed(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=2)
    _, _, dm = h.fit(cfg, chat, [h.callback(cfg, "validation", val_every=2, val_before_train=False)])
    assert dm.val_calls == [2]

    resumed = h.callback(cfg, "validation", val_every=5, val_on_last_step=False)
    resumed.load_state_dict({"validated": [0]})
    _, _, dm = h.fit(cfg, chat, [resumed])
    assert dm.val_calls == []
    assert resumed.state_dict() == {"validated": [0]}


def test_should_validate():
    callback = ValidationCallback(**FOLDERS, val_every=5)
    assert [s for s in range(1, 41) if callback.should_validate(s, 40)] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [s for s in range(1, 13) if callback.should_validate(s, 12)] == [5, 10, 12]
    assert [s for s in range(1, 13) if ValidationCallback(**FOLDERS, val_every=0).should_validate(s, 12)] == [12]


@pytest.mark.parametrize("value", [-1, 2.5, "5", True])
def test_bad_val_every_is_refused(value):
    with pytest.raises(ValueError, match="val_every must be an int >= 0"):
        ValidationCallback(**FOLDERS, val_every=value)


def test_subset_views_are_named_without_ambiguity():
    def row(bench, subsets, acc):
        return {"benchmark": bench, "subsets": subsets, "acc": acc, "objective": acc, "cost": 0.0, "cost_usd": 0.0,
                "explores": 0}

    metrics = view_metrics([
        row("gpqa", {"subset": "a", "domain": "a"}, 1.0),
        row("gpqa", {"subset": "b/c", "domain": "overall"}, 0.0),
        row("gpqa", {"subset": "b/c", "domain": ""}, 0.0),
    ])
    views = sorted({k.split("/")[1] for k in metrics})
    assert views == ["b_c", "domain=a", "domain=overall", "overall", "subset=a"]
    assert metrics["gpqa/b_c/acc"] == 0.0 and metrics["gpqa/subset=a/acc"] == 1.0
    assert metrics["gpqa/overall/acc"] == pytest.approx(1 / 3)


def test_the_dump_needs_token_ids(tmp_path, h, chat):
    records = h.ScriptedDataModule(h.make_cfg(tmp_path), chat).validation_rollout(5).records
    rows = dump_rows(records, chat.tokenizer, 5)
    assert [row["uid"] for row in rows] == [r.uid for r in records]
    records[1].response_ids = None
    with pytest.raises(ValueError, match=f"validation step 5: trajectory {records[1].uid}/n000 has no prompt_ids"):
        dump_rows(records, chat.tokenizer, 5)
