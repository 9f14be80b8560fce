"""The run export: ``runs/<name>/<run id>/{history.csv, config.json, summary.json}`` (README, "On-disk layout").

``RunExportLogger`` is a Lightning ``Logger`` that writes the same three files W&B's export
would, without asking W&B: the files exist for offline and disabled runs too, and no network
is needed to read a run's curves.

- ``history.csv``: one row per RL step (``_step``), columns ``_step``, ``_runtime`` (seconds since
  this process's logger started), ``_timestamp`` (Unix seconds of the row's last write), then one
  column per metric name in first-seen order (names are kept verbatim: ``actor/pg_loss``). Several calls at the same step
  (training metrics, then validation metrics after the update) fill one row. An empty cell: the
  metric was not logged at that step. Non-finite values are written ``nan``, ``inf``, ``-inf``.
- ``summary.json``: every metric's last logged value (by RL step), plus ``_step`` (the largest RL
  step logged). Non-finite values are the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no NaN).
- ``config.json``: the resolved run configuration given at construction, written as fit starts
  (Lightning's ``save``); a run refused before that (W&B's start failing) leaves no export folder.

Every file is rewritten whole and atomically (temporary file in the same folder, then
``os.replace``) after each ``log_metrics`` call: a reader never sees a torn file, and a run killed
mid-step keeps every earlier row. A logger pointed at an existing folder (a resumed run with the
same id) reads ``history.csv`` back and continues it; one it cannot read whole is refused
(``HistoryError``, by file and line) and never rewritten, and ``run/facts.py`` refuses it at the
start of a run that continues that id.

Who calls it: ``atlas_lightning.loggers.wandb_logger.build_loggers`` creates it; the module calls
``log_metrics(metrics, step=rl_step)`` on every logger. Only rank 0 writes (Lightning's
``rank_zero_only``); elsewhere every method is a no-op.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from atlas_lightning.errors import InputError, quoted
from atlas_lightning.store.atomic import atomic_write_text

HISTORY_NAME = "history.csv"
SUMMARY_NAME = "summary.json"
CONFIG_NAME = "config.json"
#: Columns that are not metrics, in this order at the front of ``history.csv``.
RESERVED_COLUMNS = ("_step", "_runtime", "_timestamp")


class HistoryError(InputError):
    """A run's ``history.csv`` that cannot be read back; names the file and the line."""


def read_history(path: Path) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """``history.csv`` as ``RunExportLogger`` wrote it: its metric columns in order and its rows
    by RL step. ``HistoryError`` naming the file and line where it cannot be read (a run that
    continues this id would otherwise rewrite the file without the rows it lost)."""
    columns: list[str] = []
    rows: dict[int, dict[str, Any]] = {}
    line = 1
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = reader.fieldnames or []
            if not header or header[0] != "_step":
                raise HistoryError(f"{path}: not a run export history (its first column must be _step, got "
                                   f"{header[:1]}); repair it or move it away")
            columns = [name for name in header if name not in RESERVED_COLUMNS]
            for line, raw in enumerate(reader, start=2):
                if None in raw or any(cell is None for cell in raw.values()):
                    raise ValueError(f"{len(header)} columns expected")
                row: dict[str, Any] = {"_step": int(raw["_step"])}
                row.update((name, float(cell)) for name, cell in raw.items() if name != "_step" and cell != "")
                rows.setdefault(row["_step"], {}).update(row)
    except HistoryError:
        raise
    except (OSError, csv.Error, UnicodeDecodeError, TypeError, ValueError) as err:
        raise HistoryError(f"{path}, line {line}: unreadable ({quoted(str(err))}); repair it or move it away") from None
    return columns, rows


def _as_float(name: str, value: Any) -> float:
    """A metric value as a float; torch/numpy scalars welcome, anything else is an error."""
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, (int, float)):  # bool is an int: True/False log as 1.0/0.0
        raise TypeError(f"metric {name!r}: value {value!r} ({type(value).__name__}) is not a number")
    return float(value)


def _csv_cell(value: Optional[float]) -> str:
    if value is None:
        return ""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _json_value(value: float) -> Union[float, str]:
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


class RunExportLogger(Logger):
    """Writes ``<runs_dir>/<run_id>/{history.csv, summary.json, config.json}``.

    Args:
        runs_dir: ``runs/<name>`` of the run (``paths.runs``).
        run_id: the W&B run id, or a generated ``offline-...`` id when W&B is disabled; a safe
            file-name component.
        config: the resolved configuration (a plain JSON-able dict) written to ``config.json``.
    """

    def __init__(self, runs_dir: Union[str, os.PathLike], run_id: str, config: Optional[Mapping[str, Any]] = None):
        super().__init__()
        if not run_id or "/" in run_id or run_id in (".", "..") or run_id.startswith("."):
            raise ValueError(f"RunExportLogger: run_id={run_id!r} is not a usable folder name")
        self._runs_dir = Path(runs_dir)
        self._run_id = run_id
        self._config = dict(config or {})
        self._started = time.time()
        self._columns: list[str] = []
        self._rows: dict[int, dict[str, Any]] = {}
        self._loaded = False
        self._wrote = False

    # ------------------------------------------------------------------ Lightning's Logger API

    @property
    def name(self) -> str:
        return self._runs_dir.name

    @property
    def version(self) -> str:
        return self._run_id

    @property
    def root_dir(self) -> str:
        return str(self._runs_dir)

    @property
    def save_dir(self) -> str:
        return str(self._runs_dir)

    @property
    def log_dir(self) -> Path:
        """``runs/<name>/<run id>``: where the three files live."""
        return self._runs_dir / self._run_id

    @property
    def experiment(self) -> "RunExportLogger":
        return self

    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        """The run's config is the resolved configuration given at construction; module hparams
        are not exported separately. Writes ``config.json`` if not yet written."""
        self._write_config()

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        """Record ``metrics`` at RL step ``step`` (required: the export is indexed by it) and
        rewrite the three files. Raises ``TypeError``/``ValueError`` naming the bad metric."""
        if step is None or isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"RunExportLogger.log_metrics: step={step!r} must be the RL step (an int >= 0)")
        self._load_existing()
        values = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or name in RESERVED_COLUMNS:
                raise ValueError(f"RunExportLogger.log_metrics: metric name {name!r} is empty, not a string or reserved")
            values[name] = _as_float(name, value)
        now = time.time()
        row = self._rows.setdefault(step, {"_step": step})
        row["_runtime"] = now - self._started
        row["_timestamp"] = now
        for name, value in values.items():
            if name not in self._columns:
                self._columns.append(name)
            row[name] = value
        self._write_all()

    @rank_zero_only
    def save(self) -> None:
        """Lightning calls this at fit start and on checkpoints: make sure ``config.json`` exists."""
        self._write_config()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """The files brought up to date; a run that failed before this logger wrote anything (a
        refusal at the trainer's set-up, before Lightning's ``save``: W&B's start) writes none."""
        if status != "success" and not self._wrote:
            return
        if self._rows and self._loaded:  # never rewrite a history that could not be read back
            self._write_all()
        else:
            self._write_config()

    # ------------------------------------------------------------------ reading back

    def history(self) -> list[dict[str, Any]]:
        """The rows in RL-step order (what ``history.csv`` holds), as dicts."""
        self._load_existing()
        return [dict(self._rows[step]) for step in sorted(self._rows)]

    def summary(self) -> dict[str, Any]:
        """Each metric's last value by RL step, plus ``_step``."""
        self._load_existing()
        out: dict[str, Any] = {}
        for step in sorted(self._rows):
            for name, value in self._rows[step].items():
                if name not in RESERVED_COLUMNS:
                    out[name] = _json_value(value)
        if self._rows:
            out["_step"] = max(self._rows)
        return out

    # ------------------------------------------------------------------ files

    def _load_existing(self) -> None:
        """Continue an existing ``history.csv`` (a resumed run logging into the same id). Taken
        whole or not at all: an unreadable file raises ``HistoryError`` and stays as it is."""
        if self._loaded:
            return
        path = self.log_dir / HISTORY_NAME
        if path.exists():
            self._columns, self._rows = read_history(path)
        self._loaded = True

    def _write_config(self) -> None:
        self._wrote = True
        path = self.log_dir / CONFIG_NAME
        if not path.exists():
            atomic_write_text(path, json.dumps(self._config, indent=2, sort_keys=False, default=str) + "\n")

    def _write_all(self) -> None:
        self._write_config()
        header = list(RESERVED_COLUMNS) + self._columns
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(header)
        for step in sorted(self._rows):
            row = self._rows[step]
            writer.writerow([str(step)] + [_csv_cell(row.get(name)) for name in header[1:]])
        atomic_write_text(self.log_dir / HISTORY_NAME, buffer.getvalue())
        atomic_write_text(self.log_dir / SUMMARY_NAME, json.dumps(self.summary(), indent=2) + "\n")
