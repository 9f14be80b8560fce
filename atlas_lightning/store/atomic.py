"""Atomic file writes: a temporary file in the target's folder, flushed and fsynced, then
``os.replace``d into place, so a reader sees the old file or the new one, never half of one.
The result gets the ordinary permissions of a new file (``0o666`` less the umask), not
``mkstemp``'s ``0o600``: these files are published and read by others.

Pure Python (no torch, no Lightning): the records, the run export, checkpoints, the callbacks
and ``atlas-lightning publish`` all write through here.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def _default_mode() -> int:
    # The umask can only be read by setting it; do it once, at import, while single-threaded.
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _default_mode()
#: A new folder's ordinary permissions (``0o777`` less the umask), not ``mkdtemp``'s ``0o700``.
FOLDER_MODE = FILE_MODE | ((FILE_MODE & 0o444) >> 2)


def give_ordinary_modes(folder: str | os.PathLike) -> None:
    """``folder``, every folder and every file below it get a new file's ordinary permissions
    (``FOLDER_MODE``, ``FILE_MODE``): some writers that are not ours make files their owner alone
    may read (safetensors' ``save_file``, and transformers' ``save_pretrained`` through it: ``0o600``),
    and a folder built aside may be ``mkdtemp``'s. Call it on a folder built aside, before it
    moves into place. Links are left as they are."""
    for root, folders, files in os.walk(folder):
        os.chmod(root, FOLDER_MODE)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = False) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it into place.
    Creates the folder. Text is UTF-8 with newlines written as given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, FILE_MODE)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda handle: handle.write(text))


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int | None = 1) -> Path:
    """ASCII-escaped JSON (a lone surrogate in model text cannot break it); NaN refused."""
    text = json.dumps(data, indent=indent, ensure_ascii=True, allow_nan=False)
    return atomic_write_text(path, text + "\n")
