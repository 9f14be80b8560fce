"""The whole RL step on one card (README, "On one H200"): ``atlas-lightning fit`` with FSDP2 at
world 1 and an in-process vLLM engine that sleeps through each update, in stages.

    atlas-lightning bench step-suite STAGE [STAGE ...] [--out /tmp/out] [--cache DIR] [--runs /tmp/runs]
    python -m atlas_lightning.bench.step_suite b kr --b-s 370 --kr-model tiny-model --b-extra trainer.total_steps=1

Each stage runs under its own time cap (``--a-s``, ``--kr-s``, ``--merged-s``, ``--b-s``, seconds);
a failed stage never stops the next, and every stage writes what it measured to ``--out`` as it goes:

* ``a``: ``fit experiment=h200-tiny`` (LoRA sync, 32 x 32 a step, validation at 0, 5, 10); SIGKILL
  once the step-``--a-kill-at`` checkpoint is complete, then ``trainer.resume=auto`` to step 10; the
  learning figure (validation objective 10 against 0, paired by question: ``learning.py``) ->
  ``a.json``, ``a.log``;
* ``kr``: merged sync (sleep level 2) at a smaller batch (``--kr-n`` samples a question, the model
  ``--kr-model`` of the cache): SIGKILL after the step-1 checkpoint, resume to step 2 -> ``kr.json``,
  ``kr.log``;
* ``merged``: the same with ``rollout.weight_sync=merged``, 2 steps, through the step benchmark
  (``step.py``, its plain-vLLM comparison included) -> ``merged/step_bench.*``, ``merged.log``;
* ``b``: the step benchmark on a Qwen3-8B-shaped model built on the card (``experiment=h200-8b``)
  -> ``b/step_bench.json``, ``b/step_bench.md``, ``b.log`` (``--b-extra``: more overrides).
* ``h`` / ``hm``: the step benchmark on the Qwen3.6-27B hybrid shape, its first ``--h-layers``
  layers built on the card into ``--h-model-dir`` in its real checkpoint format (once: the stages
  share it), at ``experiment=h200-8b``'s batch and budgets with flash-linear-attention in the
  trainer (``model.linear_attention_kernel=fla``), LoRA sync (``h``) or merged sync (``hm``) ->
  ``h-lora/`` or ``h-merged/`` (``step_bench.*``), ``h-lora.log`` / ``h-merged.log``
  (``--h-extra``: more overrides).

``summary.txt`` gathers the versions, the card, each stage's outcome and, for a stage that failed,
its errors and the end of its log. Needs on the card: vLLM and its dependencies, hydra-core,
omegaconf and antlr4 importable (PYTHONPATH is passed on), the built assets under ``--cache``
(sample-data, tiny-model, tiny-orchestrator). No W&B (``logger.mode=disabled``). ``--extra``:
overrides appended to every fit (a CPU dry run: ``--extra "trainer.accelerator=cpu ..."``). Run from
a checkout, the top-level ``callbacks/`` and ``conf/`` are linked into the package first (an
installed package has them).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from atlas_lightning.child_process import dying_with_parent
from atlas_lightning.errors import InputError
from atlas_lightning.run.exit_codes import exit_code
from atlas_lightning.store.learning_curve import read_step, summarize, val_steps
from atlas_lightning.store.checkpoints import MARKER, checkpoint_step, is_complete, step_dir
from atlas_lightning.store.atomic import atomic_write_text

PROGRAM = "atlas-lightning bench step-suite"
STAGES = ("a", "kr", "merged", "b", "h", "hm")
#: The stages that run the step benchmark (``step.py``): its callback's overrides join their own.
STEP_BENCH_STAGES = ("merged", "b", "h", "hm")
#: the experiment each stage's fit composes on
STAGE_EXPERIMENTS = {"a": "h200-tiny", "kr": "h200-tiny", "merged": "h200-tiny", "b": "h200-8b", "h": "h200-8b",
                     "hm": "h200-8b"}
#: the history columns a stage's JSON keeps (the phases' seconds and peaks, rollout, validation)
HISTORY_PREFIXES = ("timing_s/", "memory/", "rollout/", "perf/", "val/", "critic/score", "actor/", "response_length")
#: a log longer than this keeps its end only (vLLM is verbose)
LOG_BYTES = 8_000_000


@dataclass
class Suite:
    """Where the stages write, and how they start ``fit``; ``note`` and ``failed`` fill ``summary.txt``."""

    out: Path
    cache: Path
    runs: Path
    extra: list[str]
    fit: list[str] = field(default_factory=lambda: [sys.executable, "-m", "atlas_lightning.cli", "fit"])
    #: seconds between a complete checkpoint and the SIGKILL: the next step is under way by then
    settle_s: float = 5.0
    started: float = field(default_factory=time.monotonic)

    @property
    def common(self) -> list[str]:
        """The overrides of every fit: no W&B, the cache of built assets, then ``--extra``."""
        return ["logger.mode=disabled", f"paths.cache={self.cache}", *self.extra]

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
                    ATLAS_LIGHTNING_CACHE=str(self.cache))

    def note(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:.0f}s] {message}"
        print(line, flush=True)
        with (self.out / "summary.txt").open("a") as handle:
            handle.write(line + "\n")

    def failed(self, log: Path, code: int) -> None:
        """A stage that failed: its error lines, then the end of its log, into the summary."""
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        errors = [line for line in lines if any(m in line for m in ("Error", "error:", "Traceback", "Killed", "OOM"))]
        text = [f"--- {log} (exit {code}): errors, then the end of the log", *errors[-15:], *lines[-25:]]
        with (self.out / "summary.txt").open("a") as handle:
            handle.write("".join(line[:400] + "\n" for line in text))

    def start(self, command: list[str], log: Path, *, append: bool = False) -> subprocess.Popen:
        """``command`` in its own process group (a SIGKILL reaches vLLM's children too), output to
        ``log``; SIGKILLed too if the suite itself dies (``child_process.dying_with_parent``: a
        suite killed by an outer cap left its ``fit`` holding the card)."""
        with log.open("a" if append else "w") as handle:
            return subprocess.Popen(dying_with_parent(command, signal.SIGKILL), stdout=handle,
                                    stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def run(self, command: list[str], log: Path, cap_s: float, *, append: bool = False) -> int:
        """``command`` to its end or SIGKILLed at ``cap_s`` seconds; its exit code."""
        process = self.start(command, log, append=append)
        try:
            return process.wait(timeout=max(cap_s, 0))
        except subprocess.TimeoutExpired:
            kill_group(process)
            return process.wait()


#: How long ``kill_group`` waits for the killed group's processes to be gone.
GROUP_EXIT_S = 30.0


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s group, then wait (up to ``GROUP_EXIT_S``) until none of its processes
    runs: the signal is delivered asynchronously, and a process in uninterruptible sleep (loading
    its code under load, a card's engine releasing memory) dies only when it leaves it, so a
    resume started at once could run beside the killed run's last processes."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own
        return
    deadline = time.monotonic() + GROUP_EXIT_S
    while _group_running(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, waiting to be reaped, does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # it ended while being read
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def kill_resume(suite: Suite, label: str, name: str, at: int, cap_s: float, overrides: list[str]) -> None:
    """``fit`` run ``name``; SIGKILL its process group ``suite.settle_s`` after the step-``at``
    checkpoint is complete (the next step is under way); ``fit`` again with ``trainer.resume=auto``,
    within ``cap_s`` in all.
    ``<label>.json``: the run's history, checkpoints and, with two validations or more, the learning
    figure (``run_summary``)."""
    root, log = suite.runs / label, suite.out / f"{label}.log"
    shutil.rmtree(root, ignore_errors=True)  # a fresh run: fit refuses to start afresh over an earlier one
    marker = step_dir(root / "checkpoints" / name, at) / MARKER
    deadline = time.monotonic() + cap_s
    command = [*suite.fit, f"name={name}", f"paths.root={root}", *overrides]
    suite.note(f"{label}: fit {name} ({' '.join(overrides)}), SIGKILL after the step-{at} checkpoint")
    process = suite.start(command, log)
    while not marker.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    if marker.is_file() and process.poll() is None:
        time.sleep(suite.settle_s)
        kill_group(process)
        process.wait()
        suite.note(f"{label}: killed during step {at + 1} (pid {process.pid})")
        with log.open("a") as handle:
            handle.write("=== SIGKILL; resume ===\n")
        code = suite.run([*command, "trainer.resume=auto"], log, deadline - time.monotonic(), append=True)
        suite.note(f"{label}: resumed run exit {code}")
        if code:
            suite.failed(log, code)
    else:
        kill_group(process)
        code = process.wait()
        suite.note(f"{label}: no step-{at} checkpoint before the cap, or the run ended (exit {code})")
        suite.failed(log, code)
    result = run_summary(root, name)
    atomic_write_text(suite.out / f"{label}.json", json.dumps(result, indent=1) + "\n")
    with log.open("a") as handle:
        handle.write("learning: " + json.dumps(result.get("learning", {}), indent=1)[:3000] + "\n")
    suite.note(f"{label}: done")


def run_summary(root: Path, name: str) -> dict:
    """What a run under ``root`` left: validation steps, the learning figure (two validations or
    more), the history's phase, memory, rollout and validation columns by step, the complete
    checkpoints and the first files of each one's Lightning state."""
    result: dict = {"run": name}
    steps = val_steps(root / "artifacts" / name)
    result["validation_steps"] = list(steps)
    if len(steps) >= 2:
        result["learning"] = summarize({step: read_step(folder) for step, folder in steps.items()})
    history: dict[int, dict] = {}
    for path in sorted((root / "runs" / name).glob("*/history.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                history.setdefault(int(row["_step"]), {}).update(
                    {key: float(value) for key, value in row.items() if value not in ("", None)
                     and (key.startswith(HISTORY_PREFIXES) or key.endswith(("/objective", "/acc")))})
    result["history"] = history
    checkpoints = root / "checkpoints" / name
    folders = [p for p in checkpoints.iterdir() if checkpoint_step(p) is not None] if checkpoints.is_dir() else []
    result["checkpoints"] = sorted(p.name for p in folders if is_complete(p))
    result["lightning_state"] = {p.name: sorted(q.name for q in (p / "lightning").iterdir())[:6]
                                 for p in folders if (p / "lightning").is_dir()}
    return result


def stage_a(suite: Suite, opts: argparse.Namespace) -> None:
    kill_resume(suite, "a", "h200-tiny", opts.a_kill_at, opts.a_s,
                [f"experiment={STAGE_EXPERIMENTS['a']}", *suite.common])


def stage_kr(suite: Suite, opts: argparse.Namespace) -> None:
    """Merged sync (sleep level 2), SIGKILL after step 1, resume to step 2, at a smaller batch."""
    kill_resume(suite, "kr", "h200-tiny-kr", 1, opts.kr_s, [
        f"experiment={STAGE_EXPERIMENTS['kr']}", *suite.common, f"model.path={suite.cache / opts.kr_model}",
        "rollout.weight_sync=merged", "trainer.total_steps=2", "trainer.save_every=1", "trainer.val_every=0",
        "trainer.val_before_train=false", "callbacks.validation.val_on_last_step=false", f"rollout.n={opts.kr_n}"])


def _step_bench(suite: Suite, label: str, cap_s: float, bench_args: list[str], overrides: list[str]) -> None:
    """The step benchmark (``step.py``) into ``--out/<label>/``, its output into ``<label>.log``."""
    log = suite.out / f"{label}.log"
    shutil.rmtree(suite.runs / label, ignore_errors=True)  # the stage's runs folder: a fresh run each time
    command = [sys.executable, "-m", "atlas_lightning.bench.step", "--out", str(suite.out / label), *bench_args,
               "--", *overrides]
    code = suite.run(command, log, cap_s)
    suite.note(f"{label}: exit {code}")
    if code:
        suite.failed(log, code)


def stage_merged(suite: Suite, opts: argparse.Namespace) -> None:
    suite.note("merged: fit h200-tiny with rollout.weight_sync=merged, 2 steps, step benchmark")
    _step_bench(suite, "merged", opts.merged_s, [], [
        f"experiment={STAGE_EXPERIMENTS['merged']}", "name=h200-tiny-merged", f"paths.root={suite.runs / 'merged'}",
        *suite.common, "rollout.weight_sync=merged", "trainer.total_steps=2", "trainer.val_every=0",
        "trainer.val_before_train=false", "trainer.save_every=0"])


def stage_b(suite: Suite, opts: argparse.Namespace) -> None:
    suite.note("b: Qwen3-8B shape, step benchmark")
    _step_bench(suite, "b", opts.b_s,
                ["--build", "dense8b", "--model-dir", str(opts.model_dir), "--tokenizer-from",
                 str(suite.cache / "tiny-model")],
                [f"experiment={STAGE_EXPERIMENTS['b']}", f"model.path={opts.model_dir}",
                 f"paths.root={suite.runs / 'b'}", *suite.common, *shlex.split(opts.b_extra)])


def _stage_hybrid(suite: Suite, opts: argparse.Namespace, sync: str, cap_s: float) -> None:
    label = f"h-{sync}"
    suite.note(f"{label}: Qwen3.6-27B hybrid shape, {opts.h_layers} layers, {sync} sync, fla, step benchmark")
    _step_bench(suite, label, cap_s,
                ["--build", "qwen3_6_27b", "--layers", str(opts.h_layers), "--model-dir", str(opts.h_model_dir),
                 "--tokenizer-from", str(suite.cache / "tiny-model")],
                [f"experiment={STAGE_EXPERIMENTS['h']}", f"name=h200-27b-{sync}", f"model.path={opts.h_model_dir}",
                 "model.linear_attention_kernel=fla", f"rollout.weight_sync={sync}", f"paths.root={suite.runs / label}",
                 *suite.common, *shlex.split(opts.h_extra)])


def stage_h(suite: Suite, opts: argparse.Namespace) -> None:
    _stage_hybrid(suite, opts, "lora", opts.h_s)


def stage_hm(suite: Suite, opts: argparse.Namespace) -> None:
    _stage_hybrid(suite, opts, "merged", opts.hm_s)


def link_checkout_packages() -> None:
    """Uninstalled, the package's ``callbacks/`` and ``conf/`` are the checkout's top-level folders
    (pyproject's package-dir): link them into the package so that ``fit`` imports them. Installed
    (editable too), they import already and nothing is linked."""
    from importlib.util import find_spec

    package = Path(__file__).resolve().parents[1]
    for name in ("callbacks", "conf"):
        linkable = not (package / name).exists() and (package.parent / name).is_dir()
        if linkable and find_spec(f"atlas_lightning.{name}") is None:
            (package / name).symlink_to(Path("..") / name)


def environment() -> list[str]:
    """The summary's first lines: package versions and the card."""
    from importlib import metadata

    versions = []
    for package in ("torch", "vllm", "transformers", "peft", "lightning", "hydra-core"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    try:
        card = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        card = f"nvidia-smi: {err}"
    return [" ".join(versions), card]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    p.add_argument("stages", nargs="+", choices=STAGES, metavar="STAGE", help=f"of {', '.join(STAGES)}, in order")
    p.add_argument("--out", type=Path, default=Path("/tmp/out"), help="what each stage measured, summary.txt")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "ATLAS_LIGHTNING_CACHE", Path.home() / ".cache" / "atlas-lightning")), help="the built assets")
    p.add_argument("--runs", type=Path, default=Path("/tmp/runs"), help="the runs' paths.root, one folder a stage")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/dense8b"), help="stage b: the built 8B-shaped model")
    p.add_argument("--h-model-dir", type=Path, default=Path("/tmp/qwen3_6_27b"),
                   help="stages h, hm: the built 27B-shaped hybrid")
    p.add_argument("--h-layers", type=int, default=16, help="stages h, hm: its first N decoder layers")
    p.add_argument("--h-extra", default="", help="stages h, hm: more overrides")
    for stage, cap in zip(STAGES, (480, 240, 240, 540, 570, 570)):
        p.add_argument(f"--{stage}-s", type=float, default=cap, help=f"stage {stage}'s time cap, seconds")
    p.add_argument("--a-kill-at", type=int, default=5, help="stage a: SIGKILL after this step's checkpoint")
    p.add_argument("--kr-n", type=int, default=8, help="stage kr: samples a question")
    p.add_argument("--kr-model", default="tiny-orchestrator", help="stage kr: the model folder under --cache")
    p.add_argument("--b-extra", default="", help="stage b: more overrides (e.g. trainer.total_steps=1)")
    p.add_argument("--extra", default="", help="overrides appended to every fit")
    return p.parse_args(argv)


def split_overrides(option: str, text: str) -> list[str]:
    """``text`` (the value of ``option``) split as a shell would; ``InputError`` naming the option otherwise."""
    try:
        return shlex.split(text)
    except ValueError as err:  # an unclosed quote
        raise InputError(f"{option} {text!r}: {err}") from None


def check_overrides(suite: Suite, opts: argparse.Namespace) -> None:
    """The user's overrides (``--extra``, ``--b-extra``, ``--h-extra``) composed on each chosen
    stage's experiment with the suite's common overrides, and the step benchmark's own where the
    stage runs it (so that ``+callbacks.step_bench.KEY=...`` sets its callback's options): a
    ``ConfigError`` naming the options and the key before anything is written or started (each
    stage's ``fit`` would refuse them, one by one)."""
    from atlas_lightning.config import ConfigError, compose

    from .step import bench_overrides

    own = {"b": ("--b-extra", opts.b_extra), "h": ("--h-extra", opts.h_extra), "hm": ("--h-extra", opts.h_extra)}
    for stage in opts.stages:
        option, text = own.get(stage, (None, ""))
        more = split_overrides(option, text) if option else []
        if stage in STEP_BENCH_STAGES:
            more += bench_overrides(suite.out / stage, 1, None, None)
        try:
            compose([f"experiment={STAGE_EXPERIMENTS[stage]}", *suite.common, *more])
        except ConfigError as err:
            named = "--extra" + (f", {option}" if option else "")
            raise ConfigError(f"stage {stage} ({named}): {err}") from None


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return exit_code(PROGRAM, lambda: run_stages(opts))


def run_stages(opts: argparse.Namespace) -> int:
    """The overrides checked, then each stage in order; ``summary.txt`` and the step reports printed."""
    suite = Suite(out=opts.out, cache=opts.cache, runs=opts.runs, extra=split_overrides("--extra", opts.extra))
    link_checkout_packages()  # before the check: compose reads the package's conf/
    check_overrides(suite, opts)
    suite.out.mkdir(parents=True, exist_ok=True)
    suite.runs.mkdir(parents=True, exist_ok=True)
    for line in environment():
        suite.note(line)
    for stage in opts.stages:
        {"a": stage_a, "kr": stage_kr, "merged": stage_merged, "b": stage_b, "h": stage_h,
         "hm": stage_hm}[stage](suite, opts)
    for log in suite.out.glob("*.log"):
        if log.stat().st_size > LOG_BYTES:
            with log.open("rb") as handle:
                handle.seek(-LOG_BYTES, os.SEEK_END)
                tail = handle.read()
            log.write_bytes(tail)
    print((suite.out / "summary.txt").read_text())
    for report in sorted(suite.out.glob("*/step_bench.md")):
        print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
