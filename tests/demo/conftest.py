"""Fixtures of the SFT warm-start tests: the tiny model's chat format, sample questions, and the
warm-started model itself (``orchestrator_dir``).

The warm-started model (``DEFAULT_RECIPE``, seed 0: what ``make demo`` builds) takes about 13 CPU
minutes to build. When a selected test needs it, the build starts in a child process as soon as
collection ends (``background_build.py``: lowest priority, a second torch thread whenever the
other tests leave a core idle) while the other tests run, and the tests that need it are moved
to the end of the run. It goes into pytest's cache under a key of the code and library versions
that make it: later runs reuse it. The thread count does not change the bytes (see
``background_build.py``); the key names the pacing all the same.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_PACKAGE = Path(__file__).resolve().parents[2] / "atlas_lightning"
#: What the built model depends on: its code (demo builders, runtime, chat format) and the libraries.
_SOURCES = ("demo/demos.py", "demo/tiny_orchestrator.py", "demo/tiny_model.py", "demo/tiny_tokenizer.py",
            "demo/tiny_corpus.py", "demo/sample.py", "demo/sample_texts.py", "questions", "rollout/chat.py",
            "rollout/agent_loop.py", "rollout/engine.py", "rollout/engines/hf_engine.py", "env", "reward")
#: The builder's torch threads: one, two while a core is idle (``background_build.IdleCorePacer``).
BUILD_THREADS = "paced-1-2"
#: The builder the suite runs (``atlas-lightning data tiny-orchestrator --seed 0``, paced).
_BUILDER = Path(__file__).with_name("background_build.py")
#: How long the test waiting for the build waits at most (the build is ~13 CPU minutes).
BUILD_TIMEOUT_S = 3600
_FIXTURE = "orchestrator_dir"


def build_key() -> str:
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256()
    for name in _SOURCES:
        path = _PACKAGE / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(_PACKAGE).as_posix().encode() + b"\0" + file.read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__} {tokenizers.__version__} "
                  f"threads={BUILD_THREADS}".encode())
    return digest.hexdigest()[:16]


class _Build:
    """The orchestrator's folder, and the child process building it (None once it exists)."""

    def __init__(self, config: pytest.Config) -> None:
        key = f"tiny-orchestrator-{build_key()}"
        if getattr(config, "cache", None) is not None:  # the cache plugin: reused across runs
            cache = config.cache.mkdir(key)
            for stale in cache.parent.glob("tiny-orchestrator-*"):  # builds of older code
                if stale != cache:
                    shutil.rmtree(stale, ignore_errors=True)
        else:  # -p no:cacheprovider: this run only
            cache = Path(tempfile.mkdtemp(prefix=f"{key}-"))
        self.folder = cache / "model"
        self.log = cache / "build.log"
        self.process: subprocess.Popen | None = None
        if not (self.folder / "sft_summary.json").is_file():
            env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
            # A waiting thread of the two spins briefly (OpenMP's default) instead of sleeping at once
            # (the suite's PASSIVE): 0.49 s a step on two threads against 0.63 (1.0 and 0.98 CPU-s).
            env.pop("OMP_WAIT_POLICY", None)
            with self.log.open("w") as log:
                # the build makes the seed's tiny model itself, the same bytes as tiny_model_dir
                self.process = subprocess.Popen(
                    [sys.executable, str(_BUILDER), str(self.folder)], stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=env)

    def wait(self) -> Path:
        if self.process is not None:
            try:
                code = self.process.wait(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"the tiny orchestrator's build took over {BUILD_TIMEOUT_S} s; log: {self.log}")
            tail = self.log.read_text(errors="replace")[-4000:]
            assert code == 0, f"the tiny orchestrator's build failed (exit {code}):\n{tail}"
            self.process = None
        assert (self.folder / "sft_summary.json").is_file(), f"no build in {self.folder}"
        return self.folder

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # its clean-up runs: no staging folder left
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_BUILD_KEY = pytest.StashKey[_Build]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Start the build in the background if a selected test needs it; run those tests last."""
    needing = [item for item in items if _FIXTURE in getattr(item, "fixturenames", ())]
    if not needing or _BUILD_KEY in config.stash or config.option.collectonly:
        return
    items[:] = [item for item in items if _FIXTURE not in getattr(item, "fixturenames", ())] + needing
    config.stash[_BUILD_KEY] = _Build(config)


def pytest_unconfigure(config):
    build = config.stash.get(_BUILD_KEY, None)
    if build is not None:
        build.stop()  # an interrupted run leaves no builder behind


@pytest.fixture(scope="session")
def orchestrator_dir(request) -> Path:
    build = request.config.stash.get(_BUILD_KEY, None)
    if build is None:  # selected in a way the hook did not see: build now, in the foreground
        build = request.config.stash[_BUILD_KEY] = _Build(request.config)
    return build.wait()


@pytest.fixture(scope="session")
def chat(tiny_tokenizer):
    from atlas_lightning.rollout.chat import ChatFormat

    return ChatFormat(tiny_tokenizer)


@pytest.fixture(scope="session")
def train_questions():
    from atlas_lightning.demo.tiny_orchestrator import sample_questions

    return sample_questions("train")
