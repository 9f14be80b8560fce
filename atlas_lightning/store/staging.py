"""Folders built aside and moved into place whole, and what a killed build leaves aside.

A build that takes minutes (``atlas-lightning data tiny-orchestrator``, the other ``data`` verbs)
writes into a staging folder beside its destination and moves the result into place at the end,
so the destination is never a half-built folder. A build killed part-way (Ctrl-C twice, SIGKILL,
the machine's out-of-memory killer, a power cut) cannot remove its staging folder; the next
build removes it (``staging_folder``), and never the staging folder of a build still running:

- ``<parent>/.<name>.staging-<random>/`` holds ``.lock``, on which its build keeps an exclusive
  ``flock`` until it ends. The kernel releases the lock when the process ends, however it ends,
  so a staging folder whose lock can be taken belongs to no living build. The lock file is made
  under another name and renamed to ``.lock`` once locked: a ``.lock`` is never seen unlocked
  while its build lives. A folder without ``.lock`` (a build killed in the instant between making
  the folder and locking it, or one of an older version) is left alone.
- The name starts with a dot and is never ``name``: nothing that reads ``<parent>/<name>`` can
  take a staging folder, half-built or not, for the built one.

``replace_folder`` moves the built folder into place by one rename; an existing destination is
first moved into the staging folder, so at every moment ``<parent>/<name>`` is either the old
folder, or the complete new one, or (for an instant, and after a kill in that instant) absent;
never a mix. What a kill in that instant set aside goes with the staging folder.

Who calls it: ``demo/tiny_orchestrator.build_tiny_orchestrator``, the CLI's ``data`` verbs
(``cli._replacing_nothing``). Linux and macOS (``fcntl``); pure Python.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from atlas_lightning.store.atomic import give_ordinary_modes

#: The lock file of a staging folder (module doc).
LOCK_FILE = ".lock"
_SUFFIX = ".staging-"


def _prefix(name: str) -> str:
    return f".{name}{_SUFFIX}"


def staging_folders(parent: Path, name: str) -> list[Path]:
    """The staging folders of ``name`` under ``parent`` (a build's own and leftovers), sorted."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if p.name.startswith(_prefix(name)) and p.is_dir())


def remove_leftovers(parent: Path, name: str) -> list[Path]:
    """Remove every staging folder of ``name`` under ``parent`` that no running build holds (its
    ``.lock`` can be locked: module doc); returns those removed. A folder without ``.lock``, or
    whose lock a build holds, is left as it is."""
    removed = []
    for folder in staging_folders(parent, name):
        try:
            handle = open(folder / LOCK_FILE, "rb")
        except OSError:  # no lock file: being made this instant, or not ours to judge
            continue
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a running build holds it
                continue
            shutil.rmtree(folder, ignore_errors=True)  # under our lock: no other build takes it meanwhile
        if not folder.exists():
            removed.append(folder)
    return removed


@contextmanager
def staging_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new staging folder for a build of ``<parent>/<name>`` (module doc), locked while the
    ``with`` block runs and removed when it ends, whatever it holds then; the staging folders
    killed builds of ``name`` left under ``parent`` are removed first (``remove_leftovers``).
    ``parent`` is made if missing. The folder holds ``.lock``: build in a folder below it."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parent, name)
    folder = Path(tempfile.mkdtemp(prefix=_prefix(name), dir=parent))
    try:
        unlocked = folder / f"{LOCK_FILE}.new"
        with open(unlocked, "wb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # held until the block ends (the handle closes)
            os.rename(unlocked, folder / LOCK_FILE)
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def replace_folder(built: Path, out: Path, staging: Path) -> None:
    """Rename the folder ``built`` (inside ``staging``, on ``out``'s file system) to ``out``; an
    existing ``out`` is first moved into ``staging`` (removed with it), so ``out`` is the old
    folder or the new one, never a mix (module doc). ``NotADirectoryError`` when ``out`` is a file.
    What ``built`` holds gets a new file's ordinary permissions first (``atomic.give_ordinary_modes``:
    safetensors' files are ``0o600``)."""
    give_ordinary_modes(built)
    if out.exists():
        if not out.is_dir():
            raise NotADirectoryError(f"{out} exists and is not a folder")
        os.rename(out, staging / "replaced")  # a link to a folder is moved, not what it points at
    os.rename(built, out)
