"""Publishing a data root to the Hugging Face Hub (``atlas-lightning publish [--weights]``).

What goes (seed section 2): ``<root>/{artifacts,checkpoints,outputs,logs,wandb,runs}/`` and the
``README.md`` and ``FILES.txt`` this module writes into the root before uploading. Nothing else in
the root is sent. Never sent: symbolic links (W&B's ``latest-run`` and ``debug*.log`` links point
at folders that are sent anyway) and hidden files and folders (names starting with ``.``: the
temporary files of atomic writes, half-written ``.tmp-step_N-*`` folders).

Without ``weights`` these are left out too (and counted in the README's section 5):

- inside ``checkpoints/<name>/global_step_N/``, every folder except ``val_dumps/``: the actor and
  critic adapters, the Lightning/optimizer state, whatever else the checkpoint callback keeps;
- anywhere, files ending ``.safetensors``, ``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.distcp``.

README.md: a README in the root that does not start with ``hub_readme.GENERATED_MARK`` was written
by a person and is published as it is; otherwise it is (re)generated. FILES.txt is always
regenerated: every published file with its size.

Errors: ``ValueError`` for bad arguments (naming them); ``HubPublishError`` naming the repo (never
the token) when the Hub fails for good; ``ConfigError`` from ``publish_from_config`` when
``hub.repo_id`` is unset.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from omegaconf import DictConfig

from atlas_lightning.hub.client import HubPublishError, HubUploader, check_repo_id
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
from atlas_lightning.config import ConfigError, run_dirs

log = logging.getLogger(__name__)

TOP_LEVEL_FOLDERS = ("artifacts", "checkpoints", "outputs", "logs", "wandb", "runs")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".distcp")
_STEP_SUBFOLDER = re.compile(r"^checkpoints/[^/]+/global_step_\d+/(?P<sub>[^/]+)/")
_KEPT_STEP_SUBFOLDERS = ("val_dumps",)


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
    return None


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
    """Write README.md and FILES.txt into ``root``, then send the data root to ``repo_id``.

    Args:
        root: the data root (``paths.root``).
        repo_id: ``<owner>/<name>``; created (``private``) if missing.
        weights: also send adapters, trainer states and weight files.
        endpoint, token: the Hub (None: ``HF_ENDPOINT`` or huggingface.co; ``HF_TOKEN`` or saved login).
        name: the run the README puts first (None: every run found in the root, sorted).
        retries, backoff_s: extra attempts on transient errors and the first wait (doubling).
        question: the README's "Question." paragraph (omitted when None).
        use_xet: see ``HubUploader`` (None: use Xet only when the endpoint offers it).

    Returns ``{"repo_id", "repo_type", "endpoint", "url", "commits", "files", "bytes",
    "left_out", "left_out_bytes", "weights", "readme"}`` (``readme``: "generated" or "kept").
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"publish: data root {root} is not a folder")
    check_repo_id(repo_id, repo_type)
    uploader = HubUploader(repo_id, repo_type=repo_type, endpoint=endpoint, token=token, private=private,
                           retries=retries, backoff_s=backoff_s, use_xet=use_xet)
    selection = select_files(root, weights=weights)
    names = discover_names(root)
    if name is not None:
        names = [name] + [n for n in names if n != name]

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
    url = uploader.ensure_repo()
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


def publish_from_config(cfg: DictConfig, weights: bool = False) -> int:
    """The ``publish`` verb: the data root ``paths.root`` to ``hub.repo_id`` (required) on
    ``hub.endpoint``. Prints the result as JSON; returns 0, or 1 with the error on stderr when
    the Hub refused (the message names the repo, never the token)."""
    repo_id = cfg.hub.repo_id
    if not repo_id:
        raise ConfigError("hub.repo_id is not set: add hub.repo_id=<owner>/<name> to publish the data root")
    try:
        check_repo_id(repo_id, cfg.hub.repo_type)
    except ValueError as err:
        raise ConfigError(f"hub.{err}") from None
    try:
        result = publish_data_root(
            run_dirs(cfg)["root"], repo_id, repo_type=cfg.hub.repo_type, weights=weights,
            endpoint=cfg.hub.endpoint, private=cfg.hub.private, name=cfg.name,
            question=cfg.hub.description,
        )
    except HubPublishError as err:
        print(f"atlas-lightning publish: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0
