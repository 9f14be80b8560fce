"""Atomic text writes shared by the run export and the publish step (no torch/Lightning import,
so ``atlas-lightning publish`` starts fast)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union


def atomic_write_text(path: Union[str, os.PathLike], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and
    ``os.replace``; creates the folder. A reader sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path
