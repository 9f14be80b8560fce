"""Uploading each saved checkpoint's adapters and validation dumps to the Hub during training.

``HubCheckpointCallback`` implements ``on_checkpoint_saved(trainer, step_dir, step)``, which the
checkpoint callback calls on every ``RLCallback`` (``base.py``) once ``checkpoints/<name>/global_step_N/``
is complete. It sends ``actor/lora_adapter/``, ``critic/lora_adapter/`` and ``val_dumps/`` of that
folder to the same paths in the repo (``checkpoints/<name>/global_step_N/...``), in one commit.
Rank 0 only; the other ranks return at once (nothing here is collective).

Failure policy (training never dies for the Hub):

- uploads run on one background thread, in step order, so rank 0 does not stall the other ranks
  (which wait in the next collective) for the minutes a large adapter takes; ``on_fit_end`` and
  ``teardown`` wait for the queue to drain;
- a transient error is retried (``retries``, exponential backoff from ``backoff_s``); if it still
  fails, a warning names the step and the repo, and the step is tried again after the next saved
  checkpoint and once more at the end of fit;
- a permanent error (bad token, no rights, unknown repo, refused commit) warns once and turns
  the uploads off for the rest of the run (``atlas-lightning publish --weights`` can send them later);
- every warning is a line on the console (above the progress bar) as well as in the run's log, and
  at the end of fit one line says what was not sent and why, just before the run's closing lines
  (a token the Hub refuses, or an endpoint that is no Hub, is refused before the run starts:
  ``run/environment.check_machine``);
- ``state_dict`` keeps the steps uploaded and still pending, so a resumed run resends what is
  missing; it never holds the token (which comes from ``HF_TOKEN`` or the saved login).

The files are read when the upload runs: a checkpoint pruned before then fails as a transient
upload would (a warning), training goes on.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.config import redacted_text
from atlas_lightning.hub.client import HubPublishError, HubUploader, check_repo_id, check_retries

log = logging.getLogger(__name__)

#: The parts of a step folder this callback sends, relative to the step folder.
UPLOADED_PARTS = ("actor/lora_adapter", "critic/lora_adapter", "val_dumps")


def step_files(step_dir: Path) -> list[tuple[str, Path]]:
    """``(path in repo, local path)`` of the uploaded parts of ``checkpoints/<name>/global_step_N``,
    sorted. Hidden files and links are skipped, as in the closing publish."""
    step_dir = Path(step_dir)
    prefix = f"checkpoints/{step_dir.parent.name}/{step_dir.name}"
    out = []
    for part in UPLOADED_PARTS:
        folder = step_dir / part
        if not folder.is_dir():
            continue
        for local in sorted(folder.rglob("*")):
            rel = local.relative_to(step_dir)
            if local.is_file() and not local.is_symlink() and not any(p.startswith(".") for p in rel.parts):
                out.append((f"{prefix}/{rel.as_posix()}", local))
    return out


class HubCheckpointCallback(RLCallback):
    """Args:
        repo_id, repo_type, endpoint, private: the repository (``cfg.hub``).
        every_n_steps: upload only steps divisible by it (None: every saved step).
        retries, backoff_s: see ``HubUploader``.
        background: upload on a worker thread (default); False uploads inline (tests, debugging).
        enabled: False (``hub.publish_checkpoints=false``, the default): the callback does nothing.
    """

    def __init__(self, repo_id: Optional[str] = None, repo_type: str = "dataset", endpoint: Optional[str] = None,
                 private: bool = True, every_n_steps: Optional[int] = None, retries: int = 3,
                 backoff_s: float = 2.0, background: bool = True, enabled: bool = True):
        self.enabled = enabled
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps <= 0):
            raise ValueError(f"HubCheckpointCallback: every_n_steps={every_n_steps!r} must be a positive int or None")
        try:  # checked here, where pre-flight builds the callback, not when the uploader is first built mid-run
            check_retries(retries, backoff_s)
        except ValueError as err:
            raise ValueError(f"HubCheckpointCallback: {err}") from None
        if enabled and not repo_id:
            raise ValueError("HubCheckpointCallback: repo_id is required (hub.repo_id)")
        if repo_id:
            check_repo_id(repo_id, repo_type)
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.endpoint = endpoint
        self.private = private
        self.every_n_steps = every_n_steps
        self.retries = retries
        self.backoff_s = backoff_s
        self.background = background
        self.uploaded_steps: list[int] = []
        #: step -> step folder, for steps whose upload failed and will be tried again.
        self.pending: dict[int, str] = {}
        self.disabled_reason: Optional[str] = None
        self._last_error = ""
        self._last_try = False
        self._uploader: Optional[HubUploader] = None
        self._queue: "queue.Queue[Optional[tuple[int, Path]]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the checkpoint callback's hook

    def on_checkpoint_saved(self, trainer: Any, step_dir: Any, step: int) -> None:
        if not self.enabled or not getattr(trainer, "is_global_zero", True) or self.disabled_reason:
            return
        if self.every_n_steps and step % self.every_n_steps:
            return
        with self._lock:
            retry = sorted(self.pending.items())
        for old_step, old_dir in retry:
            if old_step != step:
                self._submit(old_step, Path(old_dir))
        self._submit(step, Path(step_dir))

    # ------------------------------------------------------------------ Lightning hooks

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer, "is_global_zero", True) and not self.disabled_reason:
            self.wait()
            with self._lock:
                retry = sorted(self.pending.items())
            self._last_try = True  # what fails now is said once, by the closing line
            for step, step_dir in retry:  # one last try for steps that failed on the way
                self._submit(step, Path(step_dir))
        self.wait()
        if self.enabled and getattr(trainer, "is_global_zero", True):
            line = self.closing_line()
            if line:
                _warn(line)

    def closing_line(self) -> Optional[str]:
        """What the uploads left unsent and why, or None when nothing failed."""
        with self._lock:
            pending, sent = sorted(self.pending), sorted(self.uploaded_steps)
        later = "`atlas-lightning publish --weights` sends the checkpoints later"
        if self.disabled_reason:
            return f"Hub checkpoint uploads were turned off (steps sent: {len(sent)}): {self.disabled_reason}; {later}"
        if pending:
            steps = ", ".join(f"global_step_{step}" for step in pending)
            return f"Hub checkpoint uploads: {steps} not sent ({self._last_error}); {later}"
        return None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.wait()

    def state_dict(self) -> dict:
        with self._lock:
            return {"uploaded_steps": list(self.uploaded_steps), "pending": dict(self.pending)}

    def load_state_dict(self, state_dict: dict) -> None:
        with self._lock:
            self.uploaded_steps = [int(s) for s in state_dict.get("uploaded_steps", [])]
            self.pending = {int(k): str(v) for k, v in state_dict.get("pending", {}).items()}

    # ------------------------------------------------------------------ uploads

    def wait(self) -> None:
        """Block until every queued upload has finished (successfully or not)."""
        if self._worker is not None:
            self._queue.join()

    def _submit(self, step: int, step_dir: Path) -> None:
        if not self.background:
            self._upload(step, step_dir)
            return
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="hub-checkpoint-upload", daemon=True)
            self._worker.start()
        self._queue.put((step, step_dir))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._upload(*item)
            finally:
                self._queue.task_done()

    def _upload(self, step: int, step_dir: Path) -> None:
        """Upload one step; never raises (the policy in the module docstring)."""
        if self.disabled_reason:
            return
        try:
            if self._uploader is None:
                uploader = HubUploader(self.repo_id, repo_type=self.repo_type, endpoint=self.endpoint,
                                       private=self.private, retries=self.retries, backoff_s=self.backoff_s)
                uploader.ensure_repo()
                self._uploader = uploader  # only once the repo surely exists
            files = step_files(step_dir)
            if not files:
                log.warning("Hub upload of step %d: %s holds no adapters or val_dumps; nothing sent", step, step_dir)
            else:
                self._uploader.upload(files, f"Checkpoint global_step_{step}")
            with self._lock:
                self.pending.pop(step, None)
                if step not in self.uploaded_steps:
                    self.uploaded_steps.append(step)
        except HubPublishError as err:
            if err.transient:
                with self._lock:
                    self.pending[step] = str(step_dir)
                self._last_error = str(err)
                _warn(f"Hub upload of global_step_{step} failed; it will be tried again after the next "
                      f"checkpoint: {err}", console=not self._last_try)
            else:
                self.disabled_reason = str(err)
                _warn(f"Hub uploads turned off for the rest of this run (global_step_{step}): {err}")
        except Exception as err:  # a local problem (a file pruned meanwhile, ...): retry later
            text = f"{type(err).__name__}: {err}"
            if self._uploader is not None:
                text = self._uploader.redact(text)
            with self._lock:
                self.pending[step] = str(step_dir)
            self._last_error = text
            _warn(f"Hub upload of global_step_{step} failed; it will be tried again: {text}",
                  console=not self._last_try)


def _warn(line: str, console: bool = True) -> None:
    """``line`` as a warning in the run's log and (``console``) on the console, above the progress
    bar (tqdm's ``write`` keeps the bar whole, from the upload thread too)."""
    from tqdm import tqdm

    log.warning("%s", line)
    if console:
        tqdm.write(f"atlas-lightning: warning: {redacted_text(line)}", file=sys.stderr)
