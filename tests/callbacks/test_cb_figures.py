"""FiguresCallback: the PNGs and terminal_reasons.json of README, "On-disk layout", their history across a
resume, and their cost."""

from __future__ import annotations

import json
import random
from pathlib import Path
from collections import Counter

import pytest

from atlas_lightning.reward.summary import step_summary
from atlas_lightning.callbacks.figures import TRAIN_FIGURES, VAL_FIGURES, FiguresCallback
from atlas_lightning.config import run_dirs
from atlas_lightning.env.terminal import TERMINAL_REASONS
from atlas_lightning.store.records import read_record

PNG = b"\x89PNG\r\n\x1a\n"


def _counts_on_disk(artifacts, partition, step):
    """Terminal reasons counted from the step's records, as a reader of the data root would."""
    folder = artifacts / partition / f"step_{step}"
    return Counter(read_record(p).episode["terminal_reason"] for p in folder.glob("*_*.json"))


def test_figures_and_terminal_reason_history(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    figures = h.callback(cfg, "figures", every_n_steps=3)
    h.fit(cfg, chat, [h.callback(cfg, "artifacts"), h.callback(cfg, "validation", val_every=2), figures])
    artifacts = run_dirs(cfg)["artifacts"]

    for folder, names in (("train_figures", TRAIN_FIGURES), ("val_figures", VAL_FIGURES)):
        files = sorted(p.name for p in (artifacts / folder).iterdir())
        assert files == sorted([f"{n}.png" for n in names] + ["terminal_reasons.json"])
        for name in names:
            assert (artifacts / folder / f"{name}.png").read_bytes()[:8] == PNG

    history = json.loads((artifacts / "train_figures" / "terminal_reasons.json").read_text())
    assert [s["step"] for s in history["steps"]] == [1, 2, 3, 4]
    seen = set()
    for entry in history["steps"]:
        on_disk = _counts_on_disk(artifacts, "train", entry["step"])
        assert {r: n for r, n in entry["counts"].items() if n} == dict(on_disk)
        assert entry["total"] == sum(on_disk.values()) == 6
        assert list(entry["counts"])[: len(TERMINAL_REASONS)] == list(TERMINAL_REASONS)
        seen |= set(on_disk)
    assert {"submitted", "no_tool_call", "malformed_call", "max_turns"} <= seen

    val = json.loads((artifacts / "val_figures" / "terminal_reasons.json").read_text())
    assert [s["step"] for s in val["steps"]] == [0, 2, 4]
    assert val["steps"][0]["counts"]["submitted"] == 4 and val["steps"][0]["counts"]["no_tool_call"] == 1
    assert figures.history["val"][-1]["views"]["gpqa/physics/acc"] == 0.5


def test_a_resumed_run_continues_the_curves(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    first = h.callback(cfg, "figures")
    module, dm = h.ScriptedModule(cfg), h.ScriptedDataModule(cfg, chat)
    trainer = h.make_trainer([first])
    dm.total_steps = 2  # the first launch stops after step 2
    trainer.fit(module, datamodule=dm)
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON: safe in any checkpoint

    second = h.callback(cfg, "figures")
    second.load_state_dict(state)
    dm = h.ScriptedDataModule(cfg, chat)
    dm.load_state_dict({"next_step": 3})
    h.make_trainer([second]).fit(h.ScriptedModule(cfg), datamodule=dm)

    history = json.loads((run_dirs(cfg)["artifacts"] / "train_figures" / "terminal_reasons.json").read_text())
    assert [s["step"] for s in history["steps"]] == [1, 2, 3, 4]
    assert [s["step"] for s in second.history["train"]] == [1, 2, 3, 4]


def test_a_step_seen_again_replaces_what_followed_it():
    figures = FiguresCallback(artifacts="artifacts")
    row = {"benchmark": "gpqa", "subsets": {}, "acc": 1.0, "objective": 1.0, "cost": 0.0, "cost_usd": 0.0,
           "explores": 0, "score": 1.0, "terminal_reason": "submitted"}
    for step in (1, 2, 3, 2):
        figures._add("train", step_summary(step, [row]))
    assert [s["step"] for s in figures.history["train"]] == [1, 2]


def test_a_figure_set_is_cheap(tmp_path):
    """40 steps of 1,024 trajectories: the figures are drawn from per-step summaries whose size
    does not grow with the trajectories of a step (what keeps a set cheap at the report's
    1,024 trajectories a step: the history a set draws from is the same as at 16), and every
    figure of each set is written. (No wall-clock bound: that is a benchmark's business.)"""
    import pickle

    reasons = ["submitted", "no_tool_call", "malformed_call", "max_turns"]

    def history(trajectories: int) -> FiguresCallback:
        rng = random.Random(0)
        figures = FiguresCallback(artifacts=tmp_path)
        for step in range(1, 41):
            rows = [{"benchmark": rng.choice(["gpqa", "lcb"]), "subsets": {"subset": rng.choice("ab")},
                     "acc": float(rng.random() < 0.5), "objective": rng.random(), "cost": rng.random() / 10,
                     "cost_usd": rng.random(), "explores": rng.randint(0, 8), "score": rng.random(),
                     "terminal_reason": rng.choice(reasons)} for _ in range(trajectories)]
            figures._add("train", step_summary(step, rows))
            if step % 5 == 0:
                summary = step_summary(step, rows[: max(1, trajectories // 4)])
                summary["views"] = {"gpqa/overall/acc": rng.random(), "gpqa/a/acc": rng.random(),
                                    "lcb/overall/acc": rng.random()}
                figures._add("val", summary)
        return figures

    large, small = history(1024), history(16)
    for partition in ("train", "val"):
        assert len(pickle.dumps(large.history[partition])) <= 1.1 * len(pickle.dumps(small.history[partition]))
        paths = large.draw(None, partition, tmp_path / partition, 40)
        assert len(paths) == len(TRAIN_FIGURES if partition == "train" else VAL_FIGURES)
        assert all(Path(path).is_file() and Path(path).stat().st_size > 0 for path in paths)


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"every_n_steps": 1.5}, {"dpi": 5}])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="FiguresCallback"):
        FiguresCallback(artifacts="artifacts", **kwargs)


def test_figures_reach_wandb(tmp_path, h, chat, monkeypatch):
    """With the project's W&B logger (offline here), every figure is logged as an image."""
    from atlas_lightning.loggers.wandb_logger import build_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb = pytest.importorskip("wandb")
    cfg = h.make_cfg(tmp_path, total_steps=2, extra=["logger.mode=offline"])
    try:
        trainer = h.make_trainer([h.callback(cfg, "validation", val_every=2), h.callback(cfg, "figures")],
                                 logger=build_loggers(cfg))
        trainer.fit(h.ScriptedModule(cfg), datamodule=h.ScriptedDataModule(cfg, chat))
    finally:
        wandb.finish()
    images = list((tmp_path / "wandb").rglob("media/images/*/*.png"))
    logged = Counter(f"{p.parent.name}/{p.name.rsplit('_', 2)[0]}" for p in images)
    expected = {f"train_figures/{n}": 2 for n in TRAIN_FIGURES}  # steps 1 and 2
    expected.update({f"val_figures/{n}": 2 for n in VAL_FIGURES})  # steps 0 and 2
    assert dict(logged) == expected


def test_the_separate_layout_adds_a_staleness_figure(tmp_path):
    """A step whose metrics carry the staleness histogram (the separate layout) adds
    ``staleness.png`` to the training figures; a synchronous step's metrics add nothing."""
    from atlas_lightning.callbacks.figures import staleness_summary

    assert staleness_summary({"rollout/staleness": 0.0, "critic/score/mean": 1.0}) is None
    figures = FiguresCallback(artifacts=tmp_path)
    row = {"benchmark": "gpqa", "subsets": {}, "acc": 1.0, "objective": 1.0, "cost": 0.0, "cost_usd": 0.0,
           "explores": 0, "score": 1.0, "terminal_reason": "submitted"}
    for step, (fresh, stale, dropped) in enumerate([(4, 0, 0), (0, 4, 0), (1, 2, 1)], start=1):
        summary = step_summary(step, [row])
        summary["staleness"] = staleness_summary({
            "rollout/staleness_hist/0": fresh, "rollout/staleness_hist/1": stale,
            "rollout/dropped_trajectories": dropped, "perf/trainer_idle_share": 0.1, "perf/engine_idle_share": 0.3})
        figures._add("train", summary)
    assert figures.history["train"][2]["staleness"] == {"trajectories": {"0": 1.0, "1": 2.0}, "dropped": 1.0,
                                                        "trainer_idle_share": 0.1, "engine_idle_share": 0.3}
    paths = figures.draw(None, "train", tmp_path / "train_figures", 3)
    assert sorted(Path(p).name for p in paths) == sorted(f"{n}.png" for n in TRAIN_FIGURES + ("staleness",))
    assert (tmp_path / "train_figures" / "staleness.png").read_bytes()[:8] == PNG
