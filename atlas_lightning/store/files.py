"""File helpers: JSON lines, folder fsync, a file's sha256, JSON-safe values. Single files are
written through ``atlas_lightning.store.atomic`` (temp file, fsync, rename, ordinary permissions)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from atlas_lightning.errors import quoted
from atlas_lightning.store.atomic import atomic_write, atomic_write_json  # noqa: F401  (re-exported)




def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """One compact JSON object a line (verl's dump format), ASCII-escaped, NaN refused."""
    lines = [json.dumps(row, ensure_ascii=True, allow_nan=False) for row in rows]
    return atomic_write(path, lambda handle: handle.write("".join(line + "\n" for line in lines)))


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename inside ``folder`` durable (best effort: not every platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (the checkpoint markers, the record-folder
    manifests and the demo builds' summaries all name files by it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json_object(path: str | os.PathLike, error: type[Exception], where: object) -> dict:
    """The JSON object in ``path``. Unreadable, not JSON, not UTF-8, or a JSON value other than an
    object: ``error("<where>: <file name> is not readable JSON (...)" / "holds a JSON list, not an
    object")``, so every loader names the folder and the file the same way."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{where}: {path.name} is not readable JSON ({quoted(f'{type(err).__name__}: {err}')})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: {path.name} holds a JSON {type(value).__name__}, not an object")
    return value


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"nan"``, ``"inf"``, ``"-inf"`` and numpy
    / torch scalars as plain numbers, so a diagnostic of a NaN step can still be written as JSON."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()  # numpy or torch scalar
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
