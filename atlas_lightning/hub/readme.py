"""The data root's README.md and FILES.txt, written by the closing publish (the report's data-root README, as the README's "On-disk layout" describes).

``render_readme`` builds the README from what is on disk (never from memory of the run): each
run's resolved config (``runs/<name>/<id>/config.json``, else ``artifacts/<name>/run.json``'s
``config``), the scalar fields of ``run.json``, the W&B ids under ``runs/<name>/``, the saved
steps under ``checkpoints/<name>/``, the last values of ``summary.json``, and the list of files
being published and left out. ``render_files_txt`` lists every published file with its size.

The card itself is ``huggingface_hub``'s: ``DatasetCard.from_template`` (``ModelCard`` for other
repo types) renders ``data_root_card.md``, the README's layout as a Jinja template, with the card
data (``pretty_name``, ``viewer: false``, the ``atlas-lightning`` tag) as its YAML front matter.
What this module adds is what the library cannot know: the facts read from the root, and
FILES.txt.

Who calls it: ``atlas_lightning.hub.publish.publish_data_root``. No network.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from atlas_lightning.env.terminal import TERMINAL_REASON_CODES
from atlas_lightning.store.checkpoints import checkpoint_step
from atlas_lightning.store.records import RECORD_FIELDS, TOKEN_ARRAY_FIELDS

#: First line of every generated README: ``publish`` rewrites a README that has it and leaves
#: any other (hand-written) README alone.
GENERATED_MARK = "<!-- written by `atlas-lightning publish`; edit freely after removing this line -->"
FILES_TXT_HEADERLESS_FORMAT = "<path>\\t<size in bytes>"
#: The README's layout (a Jinja template, rendered by ``huggingface_hub``'s card).
CARD_TEMPLATE = Path(__file__).with_name("data_root_card.md")
_KEY_METRICS = ("gpqa/overall/acc", "lcb/overall/acc", "critic/score/mean", "reward/objective",
                "reward/mapping_sum_error_max", "reward/mapped_slots_minus_events_max")
_REWARD_FIELDS = ("objective", "final_reward", "training_reward", "acc", "cost", "cost_total",
                  "explore_reward_1..8", "terminal_reward", "found_correct", "first_correct_k",
                  "submitted_after_correct", "terminal_reason_code", "submitted", "num_explores",
                  "num_explore_calls", "num_turns")
_FOLDER_NOTES = {
    "artifacts": "artifacts/<name>/: the run's manifest run.json, and under train/step_N/ and val/step_N/ one "
                 "JSON record a trajectory plus tensors.npz (per-token values, returns, advantages, masks, token "
                 "ids, log-probs) and manifest.json (every file's size and sha256); train_figures/ and val_figures/ "
                 "hold the figures logged to W&B and train_figures/terminal_reasons.json the stacked "
                 "terminal-reason history; nonfinite/step_N.json diagnoses a step with NaN/inf.",
    "checkpoints": "checkpoints/<name>/global_step_N/: actor/lora_adapter/ and critic/lora_adapter/ (PEFT "
                   "folders), the trainer state (only with publish --weights) and val_dumps/N.jsonl, verl's "
                   "validation dump.",
    "outputs": "outputs/<name>/: the configuration the run resolved and its log.",
    "logs": "logs/: the launch logs, one file a launch.",
    "wandb": "wandb/: the W&B run directories (offline runs can be synced with `wandb sync`).",
    "runs": "runs/<name>/<wandb id>/: the export (history.csv, config.json, summary.json).",
}


@dataclass
class PublishedFile:
    path: str  #: path in the repo (POSIX)
    size: int


@dataclass
class LeftOut:
    path: str
    size: int
    reason: str


@dataclass
class ReadmeInputs:
    """What the README describes. ``published`` excludes README.md and FILES.txt themselves."""

    root: Path
    repo_id: str
    repo_type: str
    endpoint: str
    published: Sequence[PublishedFile]
    left_out: Sequence[LeftOut] = ()
    weights: bool = False
    names: Sequence[str] = ()
    question: Optional[str] = None
    title: Optional[str] = None
    wandb: Mapping[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- reading the root


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _run_config(root: Path, name: str) -> dict:
    exports = sorted((root / "runs" / name).glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(exports):
        data = _read_json(path)
        if isinstance(data, dict) and data:
            return data
    run = _read_json(root / "artifacts" / name / "run.json")
    if isinstance(run, dict) and isinstance(run.get("config"), dict):
        return run["config"]
    return {}


def _get(config: Mapping, dotted: str) -> Any:
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _steps(root: Path, name: str) -> list[int]:
    out = []
    for child in (root / "checkpoints" / name).glob("global_step_*"):
        step = checkpoint_step(child)
        if step is not None and child.is_dir():
            out.append(step)
    return sorted(out)


def _wandb_runs(root: Path, name: str) -> list[dict]:
    """Each export id under ``runs/<name>/``: its kind (online/offline W&B, or W&B off) and summary."""
    out = []
    for folder in sorted((root / "runs" / name).glob("*/")):
        run_id = folder.name
        if run_id.startswith("."):
            continue
        if list((root / "wandb").glob(f"run-*-{run_id}")):
            kind = "online"
        elif list((root / "wandb").glob(f"offline-run-*-{run_id}")):
            kind = "offline"
        else:
            kind = "none"
        summary = _read_json(folder / "summary.json")
        out.append({"id": run_id, "kind": kind, "summary": summary if isinstance(summary, dict) else {}})
    return out


def discover_names(root: Path) -> list[str]:
    """Run names found under ``artifacts/``, ``checkpoints/``, ``outputs/`` and ``runs/``."""
    names = set()
    for top in ("artifacts", "checkpoints", "outputs", "runs"):
        folder = root / top
        if folder.is_dir():
            names.update(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    return sorted(names)


# ----------------------------------------------------------------------------- formatting


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def file_url(endpoint: str, repo_type: str, repo_id: str, kind: str, path: str) -> str:
    prefix = {"dataset": "datasets/", "space": "spaces/"}.get(repo_type, "")
    return f"{endpoint.rstrip('/')}/{prefix}{repo_id}/{kind}/main/{path}"


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def compact_tree(files: Iterable[PublishedFile], max_depth: int = 4) -> list[str]:
    """An indented tree of folders with file counts and sizes. Runs of numbered sibling folders
    (``step_1`` .. ``step_40``) collapse into one line; a folder's files are named when few."""
    tree: dict = {}
    for item in files:
        node = tree
        parts = item.path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part + "/", {})
        node[parts[-1]] = item.size

    def totals(node: dict) -> tuple[int, int]:
        n_files = size = 0
        for value in node.values():
            if isinstance(value, dict):
                c, s = totals(value)
                n_files, size = n_files + c, size + s
            else:
                n_files, size = n_files + 1, size + value
        return n_files, size

    lines: list[str] = []

    def walk(node: dict, depth: int) -> None:
        indent = "    " * depth
        folders = sorted(k for k, v in node.items() if isinstance(v, dict))
        groups: dict[str, list[str]] = defaultdict(list)
        for name in folders:
            match = _NUMBERED.match(name[:-1])
            groups[match.group(1) if match else name].append(name)
        for key in sorted(groups):
            members = groups[key]
            if len(members) > 3 and key.endswith(("_", "-")):
                numbers = sorted(int(_NUMBERED.match(m[:-1]).group(2)) for m in members)
                n_files = size = 0
                for member in members:
                    c, s = totals(node[member])
                    n_files, size = n_files + c, size + s
                lines.append(f"{indent}{key}N/  N = {numbers[0]}..{numbers[-1]} ({len(members)} folders; "
                             f"{count(n_files, 'file')}, {human_bytes(size)})")
                continue
            for name in members:
                n_files, size = totals(node[name])
                lines.append(f"{indent}{name}  ({count(n_files, 'file')}, {human_bytes(size)})")
                if depth + 1 < max_depth:
                    walk(node[name], depth + 1)
        leaves = sorted(k for k, v in node.items() if not isinstance(v, dict))
        if len(leaves) <= 6:
            lines.extend(f"{indent}{name}  ({human_bytes(node[name])})" for name in leaves)
        else:
            by_suffix: dict[str, int] = defaultdict(int)
            for name in leaves:
                by_suffix[Path(name).suffix or "(no suffix)"] += 1
            kinds = ", ".join(f"{n:,} {s}" for s, n in sorted(by_suffix.items()))
            lines.append(f"{indent}{len(leaves):,} files: {kinds} ({human_bytes(sum(node[n] for n in leaves))})")

    walk(tree, 0)
    return lines


# ----------------------------------------------------------------------------- the README


def _manifest_facts(run_json: Any) -> list[str]:
    """The few facts of ``run.json`` (written by ``ArtifactDumpCallback``) a reader wants first;
    unknown scalar fields are shown as they are."""
    if not isinstance(run_json, dict):
        return []
    facts = []
    if run_json.get("start_time"):
        facts.append(f"started {run_json['start_time']}")
    revision = run_json.get("code_revision")
    if isinstance(revision, dict):
        commit = revision.get("git_commit") or (f"package {revision['package_version']}"
                                                if revision.get("package_version") else None)
        if commit:
            facts.append(f"code {commit}" + (" (uncommitted changes)" if revision.get("git_dirty") else ""))
    elif isinstance(revision, str) and revision:
        facts.append(f"code {revision}")
    hosts = run_json.get("hosts")
    if isinstance(hosts, dict) and hosts.get("world_size"):
        names = ", ".join(hosts.get("hostnames") or [])
        facts.append(f"{hosts['world_size']} processes" + (f" on {names}" if names else ""))
    packages = run_json.get("packages")
    if isinstance(packages, dict):
        shown = [f"{k} {packages[k]}" for k in ("torch", "lightning", "vllm", "transformers", "peft") if packages.get(k)]
        if shown:
            facts.append(", ".join(shown))
    if isinstance(run_json.get("launches"), list) and len(run_json["launches"]) > 1:
        facts.append(f"{len(run_json['launches'])} launches")
    known = {"file_version", "name", "run_id", "start_time", "code_revision"}
    facts += [f"{k} {v}" for k, v in run_json.items()
              if k not in known and isinstance(v, (str, int, float)) and not isinstance(v, bool)]
    return facts


def _run_bullet(inputs: ReadmeInputs, name: str) -> str:
    root = inputs.root
    config = _run_config(root, name)
    parts = [f"**{name}**"]
    settings = []
    for label, key in (("model", "model.path"), ("questions a step", "algorithm.train_batch_size"),
                       ("samples a question", "rollout.n"), ("ppo_mini_batch_size", "algorithm.ppo_mini_batch_size"),
                       ("ppo_epochs", "algorithm.ppo_epochs"), ("layout", "layout.mode"), ("cards", "layout.gpus"),
                       ("steps", "trainer.total_steps"), ("validation every", "trainer.val_every"),
                       ("reward per dollar", "reward.cost_per_usd")):
        value = _get(config, key)
        if value is not None:
            settings.append(f"{label} {value}")
    if settings:
        parts.append(": " + ", ".join(settings) + ".")
    starts = [f"{label} `{value}`" for label, value in (
        ("actor adapter", _get(config, "model.actor_adapter")), ("critic adapter", _get(config, "model.critic_adapter")),
        ("initialised from", _get(config, "trainer.init_from"))) if value]
    if starts:
        parts.append(" Started from " + ", ".join(starts) + ".")
    facts = _manifest_facts(_read_json(root / "artifacts" / name / "run.json"))
    if facts:
        parts.append(f" Manifest (artifacts/{name}/run.json): " + "; ".join(facts) + ".")
    for run in _wandb_runs(root, name):
        entity = _get(config, "logger.entity") or inputs.wandb.get("entity")
        project = _get(config, "logger.project") or inputs.wandb.get("project")
        if run["kind"] == "online" and entity and project:
            where = f"W&B: https://wandb.ai/{entity}/{project}/runs/{run['id']}"
        elif run["kind"] == "offline":
            where = f"W&B: offline run {run['id']} (wandb/offline-run-*-{run['id']}/, `wandb sync` uploads it)"
        elif run["kind"] == "online":
            where = f"W&B: run {run['id']}"
        else:
            where = f"W&B off; export id {run['id']}"
        summary = run["summary"]
        shown = [f"{k} {summary[k]}" for k in _KEY_METRICS if k in summary]
        last = f", last logged step {summary['_step']}" if "_step" in summary else ""
        parts.append(f" {where}{last}" + (f" ({'; '.join(shown)})" if shown else "") + ".")
    steps = _steps(root, name)
    if steps:
        parts.append(f" Saved steps: {', '.join(map(str, steps))} (latest global_step_{steps[-1]}).")
    return "".join(parts)


def render_readme(inputs: ReadmeInputs) -> str:
    """The README's Markdown text: ``huggingface_hub``'s card (``DatasetCard``, or ``ModelCard``
    for other repo types) from ``data_root_card.md``, with this data root's facts."""
    from huggingface_hub import DatasetCard, DatasetCardData, ModelCard, ModelCardData

    names = list(inputs.names)
    title = inputs.title or f"ATLAS data root: {', '.join(names) if names else inputs.repo_id}"
    card, data = (DatasetCard, DatasetCardData) if inputs.repo_type == "dataset" else (ModelCard, ModelCardData)
    rendered = card.from_template(data(pretty_name=title, viewer=False, tags=["atlas-lightning"]),
                                  template_path=str(CARD_TEMPLATE), **_card_facts(inputs))
    return str(rendered).rstrip() + "\n"


def _card_facts(inputs: ReadmeInputs) -> dict:
    """What ``data_root_card.md`` fills in, computed from ``inputs`` and the root on disk."""
    published = {item.path for item in inputs.published}
    tops = {path.split("/", 1)[0] for path in published}
    by_reason: dict[str, list[LeftOut]] = defaultdict(list)
    for item in inputs.left_out:
        by_reason[item.reason].append(item)
    url = partial(file_url, inputs.endpoint, inputs.repo_type, inputs.repo_id, path="<path>")
    return {
        "mark": GENERATED_MARK, "repo": inputs.repo_id, "repo_type": inputs.repo_type, "weights": inputs.weights,
        "published_size": f"{count(len(published), 'file')}, {human_bytes(sum(i.size for i in inputs.published))}",
        "question": (inputs.question or "").strip(),
        "runs": [_run_bullet(inputs, name) for name in inputs.names],
        "folder_notes": [note for top, note in _FOLDER_NOTES.items() if top in tops],
        "files_txt_format": FILES_TXT_HEADERLESS_FORMAT,
        "tree": "\n".join(compact_tree(inputs.published) or ["(nothing)"]),
        "raw_url": url(kind="raw"), "resolve_url": url(kind="resolve"),
        "adapters": sorted({p.rsplit("/lora_adapter/", 1)[0] + "/lora_adapter" for p in published
                            if "/lora_adapter/" in p and p.startswith("checkpoints/")}),
        "record_fields": ", ".join(RECORD_FIELDS), "reward_fields": ", ".join(_REWARD_FIELDS),
        "token_arrays": ", ".join(TOKEN_ARRAY_FIELDS),
        "terminal_codes": ", ".join(f"{code} {reason}" for reason, code in TERMINAL_REASON_CODES.items()),
        "left_out": [f"{reason}: {count(len(items), 'file')}, {human_bytes(sum(i.size for i in items))}."
                     for reason, items in sorted(by_reason.items())],
        "inputs": _inputs_lines(inputs),
    }


def _inputs_lines(inputs: ReadmeInputs) -> list[str]:
    """Section 5's inputs: each run's base model, question data and starting adapters."""
    lines = []
    for name in inputs.names:
        config = _run_config(inputs.root, name)
        for label, key in (("base model", "model.path"), ("question data", "data.root"),
                           ("starting actor adapter", "model.actor_adapter"),
                           ("starting critic adapter", "model.critic_adapter"),
                           ("initialised from", "trainer.init_from")):
            value = _get(config, key)
            if value:
                lines.append(f"{name}: {label} `{value}`.")
    return lines


def render_files_txt(files: Iterable[PublishedFile]) -> str:
    """``path<TAB>size`` lines sorted by path, FILES.txt itself included with its own final size."""
    entries = {item.path: item.size for item in files if item.path != "FILES.txt"}
    size = 0
    for _ in range(10):  # the file's own line changes its size; a few rounds reach the fixed point
        entries["FILES.txt"] = size
        text = "".join(f"{path}\t{entries[path]}\n" for path in sorted(entries))
        if len(text.encode("utf-8")) == size:
            return text
        size = len(text.encode("utf-8"))
    raise AssertionError("FILES.txt size did not settle")
