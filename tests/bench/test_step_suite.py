"""``step_suite``'s kill-and-resume driver on CPU, with a stand-in for ``fit``: the SIGKILL comes
after the checkpoint, reaches the whole process group, the resumed run finishes, and the stage's
JSON holds the run's history, checkpoints and learning figure; a run that never checkpoints is
reported with its errors. (The stages themselves need the card: README, "On one H200".)"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from atlas_lightning.bench import step_suite
from atlas_lightning.bench.step_suite import Suite, kill_resume, run_summary

#: A stand-in for ``atlas-lightning fit name=N paths.root=R ...``: the first run completes the
#: step-1 checkpoint, starts a child in its process group and waits to be killed; the resumed run
#: writes step 2's checkpoint and a history, then exits 0. With ``fail=1`` it fails at once.
FAKE_FIT = textwrap.dedent("""
    import json, subprocess, sys, time
    from pathlib import Path
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    root, name = Path(args["paths.root"]), args["name"]
    if args.get("fail"):
        print("Traceback (most recent call last):\\nRuntimeError: no card", flush=True)
        sys.exit(1)
    def checkpoint(step):
        folder = root / "checkpoints" / name / f"global_step_{step}"
        (folder / "lightning").mkdir(parents=True)
        (folder / "lightning" / "state.ckpt").write_text("x")
        (folder / "checkpoint.json").write_text(json.dumps({"step": step}))
    if args.get("trainer.resume") != "auto":
        checkpoint(1)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (root / "child.pid").write_text(str(child.pid))
        print("step 2 under way", flush=True)
        time.sleep(60)
        sys.exit(3)
    checkpoint(2)
    history = root / "runs" / name / "r1" / "history.csv"
    history.parent.mkdir(parents=True)
    history.write_text("_step,timing_s/gen,memory/update_actor,other\\n1,2.5,3.0,9\\n2,2.0,,9\\n")
    print("resumed to step 2", flush=True)
""")


@pytest.fixture
def suite(tmp_path) -> Suite:
    fake = tmp_path / "fake_fit.py"
    fake.write_text(FAKE_FIT)
    out = tmp_path / "out"
    out.mkdir()
    return Suite(out=out, cache=tmp_path / "cache", runs=tmp_path / "runs", extra=[],
                 fit=[sys.executable, str(fake)], settle_s=0.2)


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.is_file() and "State:\tZ" not in status.read_text()


def test_kill_after_the_checkpoint_then_resume(suite):
    kill_resume(suite, "kr", "tiny-kr", 1, 60, ["experiment=h200-tiny"])
    summary = (suite.out / "summary.txt").read_text()
    assert "kr: killed during step 2" in summary and "kr: resumed run exit 0" in summary, summary
    assert "kr: done" in summary and "---" not in summary  # nothing failed
    assert not _alive(int((suite.runs / "kr" / "child.pid").read_text()))  # the SIGKILL reached the group
    log = (suite.out / "kr.log").read_text()
    assert log.index("step 2 under way") < log.index("=== SIGKILL; resume ===") < log.index("resumed to step 2")
    result = json.loads((suite.out / "kr.json").read_text())
    assert result["checkpoints"] == ["global_step_1", "global_step_2"]
    assert result["history"] == {"1": {"timing_s/gen": 2.5, "memory/update_actor": 3.0}, "2": {"timing_s/gen": 2.0}}
    assert result["lightning_state"] == {"global_step_1": ["state.ckpt"], "global_step_2": ["state.ckpt"]}
    assert result["validation_steps"] == [] and "learning" not in result


def test_a_run_without_its_checkpoint_is_reported_with_its_errors(suite):
    kill_resume(suite, "a", "tiny", 5, 60, ["fail=1"])
    summary = (suite.out / "summary.txt").read_text()
    assert "a: no step-5 checkpoint before the cap, or the run ended (exit 1)" in summary
    assert f"--- {suite.out / 'a.log'} (exit 1)" in summary and "RuntimeError: no card" in summary
    assert json.loads((suite.out / "a.json").read_text())["checkpoints"] == []


def test_run_summary_pairs_validation_by_question(tmp_path):
    for step, objectives in ((0, (0.0, 0.1, 0.2)), (5, (0.4, 0.6, 0.8))):
        folder = tmp_path / "artifacts" / "run" / "val" / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
        for i, objective in enumerate(objectives):
            reward = {"objective": objective, "acc": 1.0, "cost_total": 0.1, "num_explores": 1}
            (folder / f"q{i}.json").write_text(json.dumps({"question_id": f"q{i}", "reward": reward}))
    result = run_summary(tmp_path, "run")
    assert result["validation_steps"] == [0, 5]
    assert result["learning"]["paired_questions"] == 3
    assert result["learning"]["objective_gain"] == pytest.approx(0.5)


def test_unknown_stage_is_refused():
    with pytest.raises(SystemExit) as exit_:
        step_suite.parse_args(["c"])
    assert exit_.value.code == 2
    opts = step_suite.parse_args(["b", "kr", "--b-s", "370", "--kr-model", "tiny-model"])
    assert (opts.stages, opts.b_s, opts.kr_s, opts.kr_model) == (["b", "kr"], 370, 240, "tiny-model")


def test_the_hybrid_stages_run_the_step_benchmark_on_the_27b_checkpoint(tmp_path, monkeypatch):
    """Stages ``h`` and ``hm``: the step benchmark builds the 27B hybrid shape (16 layers by
    default) in its checkpoint format once, and runs fit with fla in the trainer, LoRA then
    merged sync, each under its own cap."""
    suite = Suite(out=tmp_path / "out", cache=tmp_path / "cache", runs=tmp_path / "runs", extra=[])
    suite.out.mkdir()
    ran = []
    monkeypatch.setattr(suite, "run", lambda command, log, cap_s: ran.append((command, log.name, cap_s)) or 0)
    opts = step_suite.parse_args(["h", "hm", "--h-layers", "24", "--h-extra", "trainer.total_steps=3"])
    step_suite.stage_h(suite, opts)
    step_suite.stage_hm(suite, opts)
    for (command, log, cap), sync in zip(ran, ("lora", "merged")):
        assert command[1:3] == ["-m", "atlas_lightning.bench.step"] and log == f"h-{sync}.log" and cap == 570
        build = command[command.index("--build"):command.index("--")]
        assert build == ["--build", "qwen3_6_27b", "--layers", "24", "--model-dir", "/tmp/qwen3_6_27b",
                         "--tokenizer-from", str(tmp_path / "cache" / "tiny-model")]
        overrides = command[command.index("--") + 1:]
        assert {"experiment=h200-8b", "model.path=/tmp/qwen3_6_27b", "model.linear_attention_kernel=fla",
                f"rollout.weight_sync={sync}", "logger.mode=disabled", "trainer.total_steps=3"} <= set(overrides)
        assert overrides[-1] == "trainer.total_steps=3"


def test_a_stage_override_may_set_the_step_benchmarks_own_options_and_a_bad_one_is_still_refused(tmp_path):
    """``--b-extra +callbacks.step_bench.profile_update_step=2`` is checked as stage ``b`` runs
    it, with the step benchmark's callback (its target) composed in: it passes; an option the
    callback does not take is still a config error naming the stage."""
    from atlas_lightning.config import ConfigError

    suite = Suite(out=tmp_path / "out", cache=tmp_path / "cache", runs=tmp_path / "runs", extra=[])
    step_suite.check_overrides(suite, step_suite.parse_args(
        ["b", "--b-extra", "+callbacks.step_bench.profile_update_step=2 trainer.total_steps=2"]))
    with pytest.raises(ConfigError, match="stage b"):
        step_suite.check_overrides(suite, step_suite.parse_args(["b", "--b-extra", "trainer.total_steps=-1"]))


def test_a_stage_run_dies_with_the_suite_that_started_it(tmp_path):
    """A suite SIGKILLed from outside (a device call's ``timeout -s KILL`` cap) takes its stage's
    run with it: the run sits in its own session, so that the suite's own cap reaches its whole
    group, and would otherwise keep its card for the next command."""
    import subprocess
    import time

    pid_file, log = tmp_path / "child.pid", tmp_path / "stage.log"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = tmp_path / "suite.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from atlas_lightning.bench.step_suite import Suite
        suite = Suite(out=Path({str(tmp_path)!r}), cache=Path("."), runs=Path("."), extra=[])
        suite.run([sys.executable, "-c", {child!r}], Path({str(log)!r}), 300)
    """))
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    assert _alive(pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the stage's run outlived its suite"
