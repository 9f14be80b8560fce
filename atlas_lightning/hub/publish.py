"""Publishing a data root to the Hugging Face Hub (``atlas-lightning publish [--weights]``).

What goes (README, "On-disk layout"): ``<root>/{artifacts,checkpoints,outputs,logs,wandb,runs}/`` and the
``README.md`` and ``FILES.txt`` this module writes into the root before uploading. Nothing else in
the root is sent. Never sent: symbolic links (W&B's ``latest-run`` and ``debug*.log`` links point
at folders that are sent anyway) and hidden files and folders (names starting with ``.``: the
temporary files of atomic writes, half-written ``.tmp-step_N-*`` folders).

Without ``weights`` the publish is the reading copy (README, "On-disk layout"); these are left out too
(and counted in the README's section 5):

- inside ``checkpoints/<name>/global_step_N/``, every folder except ``val_dumps/``: the actor and
  critic adapters, the Lightning/optimizer state, whatever else the checkpoint callback keeps;
- anywhere, files ending ``.safetensors``, ``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.distcp``;
- every step folder's ``tensors.npz`` (``artifacts/<name>/<partition>/step_N/``: per-token arrays);

and the trajectory records of those step folders are sent without their per-token arrays
(``records.strip_token_arrays``: ``prompt_ids``, ``response_ids``, ``response_mask``,
``response_logprobs``), from stripped copies made in a temporary folder (the root is never
changed); the step's ``manifest.json`` is sent rewritten to match what was sent (sizes and
sha256 of the stripped records, ``tensors.npz`` dropped, a ``reading_copy`` note saying so).
With ``weights`` everything is sent as it is on disk.

README.md: a README in the root that does not start with ``hub_readme.GENERATED_MARK`` was written
by a person and is published as it is; otherwise it is (re)generated. FILES.txt is always
regenerated: every published file with its size.

Order: the repo is created first (``HubUploader.ensure_repo``), README.md and FILES.txt are
written into the root only after that (atomically), then everything is uploaded; a refused token,
an endpoint that is no Hub or a Hub that cannot be reached therefore leaves the root as it was.
The transfer itself is ``huggingface_hub``'s (``client``); this module decides what is sent (the
layout above, the reading copy) and writes the two files.

Errors: ``ValueError`` for bad arguments (naming them); ``HubPublishError`` naming the repo (never
the token) when the Hub fails for good; ``ConfigError`` from ``publish_from_config`` when
``hub.repo_id`` is unset. The verb's exit codes: 2 for what the Hub refuses (``HubRefusedError``:
the token, 401 or 403; another 4xx; an endpoint that is no Hub), the user's to fix; 1 for a Hub
that could not be reached or kept failing after the retries (a transient fault: the same publish
run again sends what is missing), or a transfer that failed otherwise; one line each.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from omegaconf import DictConfig

from atlas_lightning.hub.client import HubPublishError, HubRefusedError, HubUploader, check_repo_id
from atlas_lightning.hub.readme import (
    GENERATED_MARK,
    LeftOut,
    PublishedFile,
    ReadmeInputs,
    discover_names,
    render_files_txt,
    render_readme,
)
from atlas_lightning.store.atomic import atomic_write_text
from atlas_lightning.store.records import MANIFEST_NAME, TENSORS_NAME, TOKEN_ARRAY_FIELDS, strip_token_arrays
from atlas_lightning.config import ConfigError

log = logging.getLogger(__name__)

TOP_LEVEL_FOLDERS = ("artifacts", "checkpoints", "outputs", "logs", "wandb", "runs")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".distcp")
_STEP_SUBFOLDER = re.compile(r"^checkpoints/[^/]+/global_step_\d+/(?P<sub>[^/]+)/")
_KEPT_STEP_SUBFOLDERS = ("val_dumps",)
#: A file directly inside a step folder of records: ``artifacts/<name>/<partition>/step_N/<file>``.
_STEP_FILE = re.compile(r"^artifacts/[^/]+/[^/]+/step_\d+/(?P<file>[^/]+)$")
TENSORS_REASON = "artifacts/*/*/step_N/tensors.npz (per-token arrays)"


@dataclass
class Selection:
    """Files under the data root: ``published`` (path in repo, local path, size), ``left_out``."""

    published: list[tuple[str, Path, int]]
    left_out: list[LeftOut]


def weight_reason(path: str) -> Optional[str]:
    """Why ``path`` (relative, POSIX) is left out of a publish without weights, or None."""
    match = _STEP_SUBFOLDER.match(path)
    if match and match.group("sub") not in _KEPT_STEP_SUBFOLDERS:
        return f"checkpoints/*/global_step_N/{match.group('sub')}/ (weights or trainer state)"
    if path.endswith(WEIGHT_SUFFIXES):
        return f"*{Path(path).suffix} files (weights)"
    step_file = _STEP_FILE.match(path)
    if step_file and step_file.group("file") == TENSORS_NAME:
        return TENSORS_REASON
    return None


def is_step_record(path: str) -> bool:
    """``path`` (relative, POSIX) is a trajectory record of a step folder."""
    match = _STEP_FILE.match(path)
    return bool(match) and match.group("file").endswith(".json") and match.group("file") != MANIFEST_NAME


def reading_copy(selection: Selection, staging: Path) -> Selection:
    """The reading copy of ``selection`` (a selection without weights): each step record that
    carries per-token arrays replaced by a stripped copy written under ``staging``, and each
    step manifest of the same folders rewritten to list what is sent (module doc). Files are
    read from the root and never changed there."""
    published: list[tuple[str, Path, int]] = []
    changed: dict[str, dict[str, tuple[int, str]]] = {}  # step folder -> {file: (bytes, sha256)}
    manifests: list[tuple[str, Path]] = []
    for rel, local, size in selection.published:
        folder, _, name = rel.rpartition("/")
        if is_step_record(rel):
            text = local.read_text(encoding="utf-8")
            if any(f'"{field}"' in text for field in TOKEN_ARRAY_FIELDS):
                stripped = strip_token_arrays(text, where=f"record {local}")
                if stripped != text:
                    local = _stage(staging, rel, stripped)
                    size = local.stat().st_size
                    changed.setdefault(folder, {})[name] = (size, hashlib.sha256(stripped.encode()).hexdigest())
        elif _STEP_FILE.match(rel) and name == MANIFEST_NAME:
            manifests.append((rel, local))
            continue
        published.append((rel, local, size))
    dropped = {item.path.rpartition("/")[0] for item in selection.left_out if item.reason == TENSORS_REASON}
    for rel, local in manifests:
        folder = rel.rpartition("/")[0]
        text = local.read_text(encoding="utf-8")
        rewritten = _reading_copy_manifest(text, changed.get(folder, {}), TENSORS_NAME if folder in dropped else None)
        if rewritten is not None:
            local = _stage(staging, rel, rewritten)
        published.append((rel, local, local.stat().st_size))
    published.sort(key=lambda item: item[0])
    return Selection(published, list(selection.left_out))


def _stage(staging: Path, rel: str, text: str) -> Path:
    path = staging / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _reading_copy_manifest(text: str, changed: dict[str, tuple[int, str]], dropped: Optional[str]) -> Optional[str]:
    """A step manifest (``records.write_manifest``'s format) rewritten for the reading copy;
    None when nothing changed or it is not in that format (then it is sent as it is)."""
    if not changed and dropped is None:
        return None
    try:
        manifest = json.loads(text)
        entries = manifest["files"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "path" in e for e in entries):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    kept = []
    for entry in entries:
        if entry["path"] == dropped:
            continue
        if entry["path"] in changed:
            entry = {**entry, "bytes": changed[entry["path"]][0], "sha256": changed[entry["path"]][1]}
        kept.append(entry)
    manifest["files"] = kept
    if isinstance(manifest.get("counts"), dict):
        manifest["counts"] = {**manifest["counts"], "files": len(kept), "bytes": sum(int(e.get("bytes", 0)) for e in kept)}
    manifest["reading_copy"] = {
        "token_arrays": f"stripped from the records ({', '.join(TOKEN_ARRAY_FIELDS)}); sizes and sha256 are the "
                        f"stripped files'",
        "left_out": [dropped] if dropped else [],
        "full_copy": "publish --weights sends the step as written",
    }
    return json.dumps(manifest, indent=1, ensure_ascii=True, allow_nan=False) + "\n"


def select_files(root: Union[str, os.PathLike], weights: bool = False) -> Selection:
    """Walk the published folders of ``root``; sorted by path. README.md/FILES.txt excluded."""
    root = Path(root)
    published: list[tuple[str, Path, int]] = []
    left_out: list[LeftOut] = []
    for top in TOP_LEVEL_FOLDERS:
        folder = root / top
        if not folder.is_dir() or folder.is_symlink():
            continue
        for dirpath, dirnames, filenames in os.walk(folder):
            # Prune hidden and linked folders in place so os.walk never enters them.
            dirnames[:] = sorted(d for d in dirnames
                                 if not d.startswith(".") and not os.path.islink(os.path.join(dirpath, d)))
            for filename in sorted(filenames):
                local = Path(dirpath) / filename
                if filename.startswith(".") or local.is_symlink():
                    continue
                rel = local.relative_to(root).as_posix()
                size = local.stat().st_size
                reason = None if weights else weight_reason(rel)
                if reason:
                    left_out.append(LeftOut(rel, size, reason))
                else:
                    published.append((rel, local, size))
    published.sort(key=lambda item: item[0])
    return Selection(published, left_out)


def _readme_is_generated(path: Path) -> bool:
    if not path.exists():
        return True
    with open(path, encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096)
    return GENERATED_MARK in head


def publish_data_root(
    root: Union[str, os.PathLike],
    repo_id: str,
    *,
    repo_type: str = "dataset",
    weights: bool = False,
    endpoint: Optional[str] = None,
    token: Optional[str] = None,
    private: bool = True,
    name: Optional[str] = None,
    retries: int = 3,
    backoff_s: float = 2.0,
    question: Optional[str] = None,
    use_xet: Optional[bool] = None,
) -> dict:
    """Create ``repo_id`` if needed (a refused token or endpoint stops here: ``HubRefusedError``), write
    README.md and FILES.txt into ``root``, then send the data root to ``repo_id``.

    Args:
        root: the data root (``paths.root``).
        repo_id: ``<owner>/<name>``; created (``private``) if missing.
        weights: also send adapters, trainer states and weight files.
        endpoint, token: the Hub (None: ``HF_ENDPOINT`` or huggingface.co; ``HF_TOKEN`` or saved login).
        name: the run the README puts first (None: every run found in the root, sorted).
        retries, backoff_s: extra attempts on transient errors and the first wait (doubling).
        question: the "Question." paragraph of the README (omitted when None).
        use_xet: see ``HubUploader`` (None: use Xet only when the endpoint offers it).

    Returns ``{"repo_id", "repo_type", "endpoint", "url", "commits", "files", "bytes",
    "left_out", "left_out_bytes", "weights", "readme"}`` (``readme``: "generated" or "kept").
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"publish: data root {root} is not a folder")
    check_repo_id(repo_id, repo_type)
    if weights:
        verify_published_checkpoints(root)
    uploader = HubUploader(repo_id, repo_type=repo_type, endpoint=endpoint, token=token, private=private,
                           retries=retries, backoff_s=backoff_s, use_xet=use_xet)
    with tempfile.TemporaryDirectory(prefix="atlas-reading-copy-") as staging:
        selection = select_files(root, weights=weights)
        if not weights:
            selection = reading_copy(selection, Path(staging))
        return _publish(root, uploader, selection, repo_id=repo_id, repo_type=repo_type, weights=weights, name=name,
                        question=question)


def verify_published_checkpoints(root: Path) -> None:
    """Every finished checkpoint under ``root/checkpoints`` (a ``global_step_N`` folder with its
    ``checkpoint.json``) still matches its marker (``store.checkpoints.verify_checkpoint``: files,
    sizes, sha256) before its weights are published: a damaged one is refused naming the folder
    (``CheckpointError``, exit 2), before the repo is touched. Folders without a marker are sent as
    they are, as before (a save that did not finish is named by the README's file list alone)."""
    from atlas_lightning.store.checkpoints import MARKER, checkpoint_step, verify_checkpoint

    for marker in sorted((root / "checkpoints").glob(f"*/global_step_*/{MARKER}")):
        if checkpoint_step(marker.parent) is not None and not marker.parent.is_symlink():
            verify_checkpoint(marker.parent)


def _publish(root: Path, uploader: HubUploader, selection: Selection, *, repo_id: str, repo_type: str,
             weights: bool, name: Optional[str], question: Optional[str]) -> dict:
    """README.md and FILES.txt, then the upload (``publish_data_root``'s second half)."""
    names = discover_names(root)
    if name is not None:
        names = [name] + [n for n in names if n != name]

    # the repo first: a refused token (or a missing repo that cannot be made) stops the publish
    # before README.md and FILES.txt are written into the root
    url = uploader.ensure_repo()
    readme = root / "README.md"
    readme_state = "kept"
    if _readme_is_generated(readme):
        readme_state = "generated"
        text = render_readme(ReadmeInputs(
            root=root, repo_id=repo_id, repo_type=repo_type, endpoint=uploader.endpoint,
            published=[PublishedFile(p, s) for p, _, s in selection.published],
            left_out=selection.left_out, weights=weights, names=names, question=question))
        atomic_write_text(readme, text)
    listed = [PublishedFile(p, s) for p, _, s in selection.published]
    listed.append(PublishedFile("README.md", readme.stat().st_size))
    atomic_write_text(root / "FILES.txt", render_files_txt(listed))

    files = [(p, local) for p, local, _ in selection.published]
    files += [("README.md", readme), ("FILES.txt", root / "FILES.txt")]
    log.info("publishing %d files (%d left out) from %s to %s", len(files), len(selection.left_out), root, uploader.where)
    what = "data root" + (" with weights" if weights else "")
    commits = uploader.upload(files, f"Publish {what}" + (f" ({name})" if name else ""))
    return {
        "repo_id": repo_id,
        "repo_type": repo_type,
        "endpoint": uploader.endpoint,
        "url": url,
        "commits": commits,
        "files": len(files),
        "bytes": sum(local.stat().st_size for _, local in files),
        "left_out": len(selection.left_out),
        "left_out_bytes": sum(item.size for item in selection.left_out),
        "weights": weights,
        "readme": readme_state,
    }


def check_hub_repo(cfg: DictConfig) -> str:
    """``hub.repo_id``, set and of the Hub's form; ``ConfigError`` naming the key otherwise."""
    repo_id = cfg.hub.repo_id
    if not repo_id:
        raise ConfigError("hub.repo_id is not set: add hub.repo_id=<owner>/<name> to publish the data root")
    try:
        check_repo_id(repo_id, cfg.hub.repo_type)
    except ValueError as err:
        raise ConfigError(f"hub.{err}") from None
    return repo_id


def publish_from_config(cfg: DictConfig, weights: bool = False) -> int:
    """The ``publish`` verb: the data root ``paths.root`` to ``hub.repo_id`` (required) on
    ``hub.endpoint``. Prints the result as JSON; returns 0, or 1 with one line on stderr when the
    Hub could not be reached or failed otherwise (module doc: exit codes). What the Hub refuses
    raises ``HubRefusedError`` (exit 2), before anything is written into the root when it is
    refused at the first call (the token, the repo, the endpoint)."""
    repo_id = check_hub_repo(cfg)
    try:
        result = publish_data_root(
            Path(cfg.paths.root), repo_id, repo_type=cfg.hub.repo_type, weights=weights,
            endpoint=cfg.hub.endpoint, private=cfg.hub.private, name=cfg.name,
            question=cfg.hub.description,
        )
    except HubRefusedError:
        raise  # the user's to fix (a token, the repo, hub.endpoint): the CLI names it and exits 2
    except HubPublishError as err:
        again = "; run the same publish again later (what was sent is not sent twice)" if err.transient else ""
        print(f"atlas-lightning publish: {err}{again}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0
