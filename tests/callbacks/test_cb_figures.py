"""FiguresCallback: the PNGs and terminal_reasons.json of README, "On-disk layout", their history across a
resume, and their cost."""

from __future__ import annotations

import json
import random
from pathlib import Path
from collections import Counter

import pytest

from atlas_lightning.reward.summary import step_summary
from atlas_lightning.callbacks.figures import FiguresCallback
from atlas_lightning.callbacks.plots import TRAIN_FIGURES, VAL_FIGURES
from atlas_lightning.config import run_dirs
from atlas_lightning.env.terminal import TERMINAL_REASONS
from atlas_lightning.store.records import read_record

PNG = b"\x89PNG\r\n\x1a\n"


def _counts_on_disk(artifacts, partition, step):
    """Terminal reasons counted from the step's records, as a reader of the data root would."""
    folder = artifacts / partition / f"step_{step}"
    return Counter(read_record(p).episode["terminal_reason"] for p in folder.glob("*_*.json"))


@pytest.mark.parametrize("background", [False, True], ids=["in the step", "in the background"])
def test_figures_and_terminal_reason_history(tmp_path, h, chat, background):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    figures = h.callback(cfg, "figures", every_n_steps=3, background=background)
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


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"every_n_steps": 1.5}, {"dpi": 5}, {"background": 1},
                                    {"background": "yes"}])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="FiguresCallback"):
        FiguresCallback(artifacts="artifacts", **kwargs)


@pytest.mark.parametrize("background", [False, True], ids=["in the step", "in the background"])
def test_figures_reach_wandb(tmp_path, h, chat, monkeypatch, background):
    """With the project's W&B logger (offline here), every figure is logged as an image."""
    from atlas_lightning.loggers.wandb_logger import build_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb = pytest.importorskip("wandb")
    cfg = h.make_cfg(tmp_path, total_steps=2, extra=["logger.mode=offline"])
    try:
        trainer = h.make_trainer([h.callback(cfg, "validation", val_every=2),
                                  h.callback(cfg, "figures", background=background)], logger=build_loggers(cfg))
        trainer.fit(h.ScriptedModule(cfg), datamodule=h.ScriptedDataModule(cfg, chat))
    finally:
        wandb.finish()
    images = list((tmp_path / "wandb").rglob("media/images/*/*.png"))
    logged = Counter(f"{p.parent.name}/{p.name.rsplit('_', 2)[0]}" for p in images)
    expected = {f"train_figures/{n}": 2 for n in TRAIN_FIGURES}  # steps 1 and 2
    expected.update({f"val_figures/{n}": 2 for n in VAL_FIGURES})  # steps 0 and 2
    assert dict(logged) == expected


def test_background_images_are_logged_before_the_next_steps_metrics(tmp_path, h, chat, monkeypatch):
    """W&B drops a row logged below a step it already has: a step's figures drawn in the
    background are logged at their own step, before the next step logs its metrics."""
    import atlas_lightning.callbacks.figures as figures_module

    logged = []
    monkeypatch.setattr(figures_module, "log_image", lambda trainer, key, path, step: logged.append((step, key)))

    class LoggingModule(h.ScriptedModule):
        """Logs each step's metrics at the step, as ``PPOModule.training_step`` does."""

        def training_step(self, batch, batch_idx):
            output = super().training_step(batch, batch_idx)
            logged.append((batch.step, "metrics"))
            return output

    cfg = h.make_cfg(tmp_path, total_steps=3)
    figures = h.callback(cfg, "figures", background=True)
    h.make_trainer([figures]).fit(LoggingModule(cfg), datamodule=h.ScriptedDataModule(cfg, chat))
    steps = [step for step, _ in logged]
    assert steps == sorted(steps)
    assert Counter(steps) == {step: 1 + len(TRAIN_FIGURES) for step in (1, 2, 3)}


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


def _history(steps: int = 3) -> list[dict]:
    figures = FiguresCallback(artifacts="unused")
    row = {"benchmark": "gpqa", "subsets": {}, "acc": 1.0, "objective": 1.0, "cost": 0.0, "cost_usd": 0.25,
           "explores": 2, "score": 1.0, "terminal_reason": "submitted"}
    for step in range(1, steps + 1):
        figures._add("train", step_summary(step, [row, {**row, "acc": 0.0, "terminal_reason": "max_turns"}]))
    return figures.history["train"]


def test_the_background_process_draws_what_the_step_would(tmp_path):
    """The spawned process writes byte for byte the PNGs the run's own process writes."""
    from atlas_lightning.callbacks.drawing import BackgroundDrawing
    from atlas_lightning.callbacks.plots import draw_partition

    history = _history()
    here = draw_partition(history, "train", tmp_path / "here", 80)
    drawing = BackgroundDrawing()
    try:
        drawing.start()  # as the callback's setup does: the process starts before the first drawing
        child = drawing._child
        assert child.poll() is None and drawing.pending_step is None
        drawing.start()
        drawing.submit(3, history, "train", tmp_path / "there", 80)
        assert drawing._child is child and drawing.pending_step == 3
        step, there = drawing.wait()
    finally:
        drawing.close()
    assert step == 3 and drawing.pending_step is None and drawing.wait() is None
    assert [p.name for p in there] == [p.name for p in here] == [f"{n}.png" for n in TRAIN_FIGURES]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(here, there))


def test_a_dead_drawing_process_loses_no_figure(tmp_path, caplog):
    """The drawing process killed: the pending figures and every later set are drawn in the run's
    own process, with one warning."""
    import os
    import signal

    from atlas_lightning.callbacks.drawing import BackgroundDrawing

    drawing = BackgroundDrawing()
    try:
        drawing.submit(1, _history(1), "train", tmp_path / "one", 80)
        drawing.wait()
        os.kill(drawing._child.pid, signal.SIGKILL)
        for step in (2, 3):
            drawing.submit(step, _history(step), "train", tmp_path / str(step), 80)
            assert drawing.wait()[0] == step
            assert all((tmp_path / str(step) / f"{n}.png").read_bytes()[:8] == PNG for n in TRAIN_FIGURES)
    finally:
        drawing.close()
    assert sum("drawing process is gone" in r.getMessage() for r in caplog.records) == 1


def test_a_drawing_process_that_cannot_start_loses_no_figure(tmp_path, monkeypatch, caplog):
    """No interpreter to start the child with: the figures are drawn in the run's own process,
    with one warning."""
    from atlas_lightning.callbacks.drawing import BackgroundDrawing

    monkeypatch.setattr("sys.executable", str(tmp_path / "no-python"))
    drawing = BackgroundDrawing()
    drawing.start()
    drawing.submit(2, _history(2), "train", tmp_path, 80)
    assert drawing.wait()[0] == 2 and drawing._broken
    drawing.close()
    assert all((tmp_path / f"{n}.png").read_bytes()[:8] == PNG for n in TRAIN_FIGURES)
    assert sum("drawing process is gone" in r.getMessage() for r in caplog.records) == 1


def test_ctrl_c_leaves_the_drawing_to_the_run(tmp_path):
    """Ctrl-C reaches the whole process group: the drawing process goes on, and the run (which
    waits for it after the interrupt) gets its figures."""
    import os
    import signal

    from atlas_lightning.callbacks.drawing import BackgroundDrawing

    drawing = BackgroundDrawing()
    try:
        drawing.submit(1, _history(1), "train", tmp_path / "one", 80)
        drawing.wait()
        drawing.submit(2, _history(40), "train", tmp_path / "two", 80)
        os.kill(drawing._child.pid, signal.SIGINT)
        assert drawing.wait()[0] == 2 and not drawing._broken
    finally:
        drawing.close()
    assert all((tmp_path / "two" / f"{n}.png").read_bytes()[:8] == PNG for n in TRAIN_FIGURES)


def test_a_drawing_that_fails_fails_where_it_is_waited_for(tmp_path):
    """A bug in a figure (here a history without its means) is raised by ``wait``, as drawing in
    the step would raise it."""
    from atlas_lightning.callbacks.drawing import BackgroundDrawing

    broken = [{k: v for k, v in h.items() if k != "mean"} for h in _history()]
    drawing = BackgroundDrawing()
    try:
        drawing.submit(3, broken, "train", tmp_path, 80)
        with pytest.raises(KeyError, match="mean"):
            drawing.wait()
    finally:
        drawing.close()


def test_auto_draws_in_the_step_on_a_cpu(tmp_path, h, chat):
    """``background: auto`` (the configured default) keeps the drawing in the step when training
    on a CPU, where a second process would take the training's cores."""
    cfg = h.make_cfg(tmp_path, total_steps=1)
    figures = h.callback(cfg, "figures")
    assert figures.background == "auto"
    h.fit(cfg, chat, [figures])
    assert figures._drawing is None and figures._in_background is False
    assert (run_dirs(cfg)["artifacts"] / "train_figures" / "reward.png").read_bytes()[:8] == PNG
