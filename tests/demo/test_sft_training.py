"""The SFT loop: targets, loss, batch order, schedule, and the build (layout, atomicity, determinism)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from atlas_lightning.demo.demos import Demo, build_demos
from atlas_lightning.demo.tiny_model import MODEL_FILES
from atlas_lightning.demo.tiny_orchestrator import (
    COST_PER_USD,
    SUMMARY_FILE,
    TINY_CPU_LIMITS,
    TINY_CPU_RUNTIME,
    SFTRecipe,
    batch_order,
    build_tiny_orchestrator,
    collate,
    demo_loss,
    learning_rate,
    summarize_episodes,
)
from atlas_lightning.env.episode import Episode

TINY_RECIPE = SFTRecipe(demos_per_question=1, train_questions=2, steps=3, batch_size=2, warmup_steps=1,
                        eval_questions=1, val_loss_questions=1)


def _demo(ids, mask, prompt_length=1):
    return Demo("q", "gpqa", 0, 0, 0, "last", "A", 0, 0.0, prompt_length, tuple(ids), tuple(mask))


def test_collate_targets_are_next_tokens_where_trained_only():
    demos = [_demo([5, 6, 7, 8, 9], [0, 0, 1, 0, 1]), _demo([11, 12, 13], [0, 1, 1])]
    input_ids, targets = collate(demos, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]]
    # Position t predicts token t+1, and only tokens with mask 1 are predicted.
    assert targets.tolist() == [[-100, 7, -100, 9], [12, 13, -100, -100]]


def test_demo_loss_equals_transformers_causal_lm_loss(tiny_model_dir, chat, train_questions):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    demos = build_demos(train_questions[:1] + train_questions[-1:], chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME,
                        per_question=1, seed=0)
    input_ids, targets = collate(demos, pad_id=chat.tokenizer.pad_token_id)
    labels = torch.full_like(input_ids, -100)
    for row, demo in enumerate(demos):  # transformers shifts the labels itself
        ids, mask = torch.tensor(demo.input_ids), torch.tensor(demo.loss_mask, dtype=torch.bool)
        labels[row, : len(ids)] = torch.where(mask, ids, torch.full_like(ids, -100))
    with torch.no_grad():
        reference = model(input_ids=input_ids, labels=labels).loss
        ours = demo_loss(model, input_ids, targets)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    assert 5.0 < ours.item() < 10.0  # a random model over a 2,048-token vocabulary: about ln(2048) = 7.6


def test_batch_order_covers_every_demo_once_an_epoch_in_batches_of_similar_length():
    lengths = [(i * 37) % 101 + 500 for i in range(64)]
    order = batch_order(lengths, batch_size=4, steps=32, seed=0)  # 2 epochs of 2 windows of 8 batches
    assert order == batch_order(lengths, batch_size=4, steps=32, seed=0)
    assert order != batch_order(lengths, batch_size=4, steps=32, seed=1)
    assert len(order) == 32 and all(len(b) == 4 for b in order)
    assert sorted(i for batch in order[:16] for i in batch) == list(range(64))  # the first epoch
    assert sorted(i for batch in order[16:] for i in batch) == list(range(64))  # the second
    assert order[:16] != order[16:]
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in order) / len(order)
    assert spread < 30, spread  # random batches of 4 from 500..600 spread about 60
    assert len(batch_order(lengths, batch_size=4, steps=5, seed=0)) == 5
    with pytest.raises(ValueError, match="no demonstrations"):
        batch_order([], 4, 1, 0)
    with pytest.raises(ValueError, match="batch_size=0"):
        batch_order(lengths, 0, 1, 0)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    recipe = SFTRecipe(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert learning_rate(0, recipe) == pytest.approx(1e-4)
    assert learning_rate(9, recipe) == pytest.approx(1e-3)
    assert learning_rate(55, recipe) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert learning_rate(100, recipe) == pytest.approx(1e-4)
    assert all(learning_rate(s, recipe) >= learning_rate(s + 1, recipe) for s in range(10, 100))


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", -1), ("lr", 0.0), ("lr", float("nan")),
                                          ("train_questions", 0), ("min_lr_ratio", 1.5), ("warmup_steps", -1),
                                          ("val_loss_questions", 0)])
def test_recipe_refuses_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=f"SFTRecipe.{field}"):
        SFTRecipe(**{field: value})


def test_tiny_cpu_limits_are_the_composed_experiment(tmp_path):
    from atlas_lightning.config import compose

    cfg = compose(["experiment=tiny-cpu", f"paths.cache={tmp_path}"])
    r = cfg.rollout
    limits = TINY_CPU_LIMITS
    assert (limits.max_response_length, limits.max_tokens_per_turn, limits.max_model_len) == (
        r.max_response_length, r.max_tokens_per_turn, r.max_model_len)
    assert (TINY_CPU_RUNTIME.max_explores, TINY_CPU_RUNTIME.max_turns) == (r.max_explores, r.max_turns)
    assert COST_PER_USD == cfg.reward.cost_per_usd


def test_summarize_episodes_counts_reasons_explores_and_objective(train_questions):
    gpqa = next(q for q in train_questions if q.benchmark == "gpqa")
    call = '<tool_call>{"name": "explore", "arguments": {}}</tool_call>'
    submitted = Episode(gpqa, 0, TINY_CPU_RUNTIME)
    submitted.on_assistant_turn(call, 0, 5)
    submitted.on_tool_response_tokens(5, 9)
    submitted.on_assistant_turn(call, 9, 14)
    submitted.on_tool_response_tokens(14, 20)
    answer = '<tool_call>{"name": "submit", "arguments": {"answer": "%s"}}</tool_call>' % gpqa.ground_truth
    submitted.on_assistant_turn(answer, 20, 25)
    silent = Episode(gpqa, 1, TINY_CPU_RUNTIME)
    silent.on_assistant_turn("I will not call a tool.", 0, 6)
    summary = summarize_episodes([submitted.to_record_episode(), silent.to_record_episode()], cost_per_usd=0.5)

    spent = sum(gpqa.candidates[i].cost_usd for i in submitted.permutation[:2])
    assert summary["episodes"] == 2
    assert summary["terminal_reasons"] == {"submitted": 1, "no_tool_call": 1}
    assert summary["explores"] == {"0": 1, "2": 1}
    assert summary["acc"] == 0.5
    assert summary["cost_usd"] == pytest.approx(spent / 2)
    assert summary["objective"] == pytest.approx((1 - 0.5 * spent) / 2)
    assert summary["by_benchmark"]["gpqa"]["mean_explores"] == 1.0
    with pytest.raises(ValueError, match="no episodes"):
        summarize_episodes([])


def test_build_is_byte_identical_for_a_seed_and_replaces_the_old_folder(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "orchestrator"
    first = build_tiny_orchestrator(out, seed=0, base=None, recipe=TINY_RECIPE)
    weights = (out / "model.safetensors").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted([*MODEL_FILES, SUMMARY_FILE])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert weights != (tiny_model_dir / "model.safetensors").read_bytes()  # it trained
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["eval"]["greedy"]["episodes"] == 2 and summary["eval"]["sampled"]["episodes"] == 2

    (out / "stray.txt").write_text("from an older build")
    # base=None built the seed's tiny model, so starting from the same model folder is the same build;
    # the quick evaluation only reads the trained model (left out here: the HF decoding is the slow part).
    second = build_tiny_orchestrator(out, seed=0, base=tiny_model_dir, recipe=replace(TINY_RECIPE, eval_questions=0))
    assert (out / "model.safetensors").read_bytes() == weights
    assert not (out / "stray.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["orchestrator"]  # no staging folder left behind
    assert first["files"] == second["files"] and first["final_loss"] == second["final_loss"]

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["steps"] == 3 and summary["demos"]["count"] == 4 and summary["base"] == str(tiny_model_dir)
    assert summary["final_loss"] < summary["first_loss"]
    assert set(summary["eval"]) == {"val_demo_loss"}
    AutoModelForCausalLM.from_pretrained(out)  # loads as a Hugging Face model


def test_failed_build_leaves_the_existing_folder_alone(tmp_path, tiny_model_dir):
    out = tmp_path / "orchestrator"
    out.mkdir()
    (out / "config.json").write_text("old")
    broken = tmp_path / "broken-base"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        build_tiny_orchestrator(out, seed=0, base=broken, recipe=TINY_RECIPE)
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken-base", "orchestrator"]
