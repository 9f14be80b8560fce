"""Did the policy learn? The validation records a run wrote (``artifacts/<name>/val/step_N/``),
read back question by question, and the paired test of the last validation against the first.

Per validation step: the means over questions of each question's mean over its trajectories of
the objective (``acc - lambda * dollars``, the reward breakdown's ``objective``), accuracy,
dollars and explores. The test is paired: for every question validated at both steps, the
objective at the last step minus the objective at the first; the mean difference, its standard
error (sample standard deviation of the differences / sqrt(questions)) and ``z`` = mean / SE.

Who calls it: the ``fit`` verb's closing summary (one line: the gain and its SE), and the
learning benchmark (``bench/learning.py``: several seeds, a table).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

#: The per-question means a step summary holds, from each record's reward breakdown.
FIELDS = {"objective": "objective", "acc": "acc", "cost_usd": "cost_total", "explores": "num_explores"}


def val_steps(artifacts: str | Path) -> dict[int, Path]:
    """``{N: artifacts/val/step_N}`` of every complete validation step folder (its manifest written), in order."""
    folder = Path(artifacts) / "val"
    steps = {}
    for step_dir in folder.glob("step_*") if folder.is_dir() else ():
        if step_dir.name[5:].isdigit() and (step_dir / "manifest.json").is_file():
            steps[int(step_dir.name[5:])] = step_dir
    return dict(sorted(steps.items()))


def read_step(step_dir: Path) -> dict[str, dict]:
    """question_id -> the mean over its trajectories of each of ``FIELDS``."""
    per_question: dict[str, list[dict]] = {}
    for path in sorted(step_dir.glob("*.json")):
        if path.name == "manifest.json":
            continue
        reward = json.loads(path.read_text(encoding="utf-8"))
        per_question.setdefault(reward["question_id"], []).append(
            {ours: float(reward["reward"][field]) for ours, field in FIELDS.items()})
    if not per_question:
        raise ValueError(f"{step_dir}: no trajectory records")
    return {qid: {key: statistics.fmean(r[key] for r in rows) for key in FIELDS} for qid, rows in per_question.items()}


def summarize(steps: dict[int, dict[str, dict]]) -> dict:
    """Per-step means (``curve``) and the paired last-vs-first test (module doc)."""
    curve = {step: {key: statistics.fmean(q[key] for q in questions.values()) for key in FIELDS}
             | {"questions": len(questions)} for step, questions in steps.items()}
    first, last = min(steps), max(steps)
    common = sorted(set(steps[first]) & set(steps[last]))
    diffs = [steps[last][q]["objective"] - steps[first][q]["objective"] for q in common]
    mean = statistics.fmean(diffs) if diffs else float("nan")
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {"curve": curve, "first_step": first, "last_step": last, "paired_questions": len(common),
            "objective_gain": mean, "gain_se": se, "z": mean / se if se and se > 0 else float("nan")}


def learning_line(artifacts: str | Path) -> Optional[str]:
    """One line for a person: the validation objective at the first and last validated steps and
    the paired gain with its SE; None with fewer than two validated steps."""
    steps = val_steps(artifacts)
    if len(steps) < 2:
        return None
    result = summarize({step: read_step(folder) for step, folder in steps.items()})
    curve, first, last = result["curve"], result["first_step"], result["last_step"]
    verdict = "learned" if result["z"] > 3 else "no clear change" if abs(result["z"]) <= 3 else "got worse"
    return (f"validation objective {curve[first]['objective']:+.3f} at step {first} -> {curve[last]['objective']:+.3f} "
            f"at step {last}: gain {result['objective_gain']:+.3f} +- {result['gain_se']:.3f} (paired SE over "
            f"{result['paired_questions']} questions, z {result['z']:.1f}): {verdict}")
