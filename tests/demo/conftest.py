"""Fixtures of the SFT warm-start tests: the tiny model's chat format, sample questions, and the
warm-started model itself (``orchestrator_dir``).

The warm-started model (``DEFAULT_RECIPE``, seed 0: what ``make demo`` builds) takes about 13 CPU
minutes to build. When a selected test needs it, the build starts in a child process as soon as
collection ends, at the lowest CPU priority on two threads, while the other tests run, and the
tests that need it are moved to the end of the run. It goes into pytest's cache under a key of
the code and library versions that make it: later runs reuse it. One thread gives the same bytes
as two (``BUILD_THREADS``), and the key holds the builder's thread count all the same.

Why two threads at the lowest priority: the build (~13 CPU minutes) and the other tests (~11)
are each nearly as long as CI may take on two cores, and the tests often leave a core idle in
short spells (one-threaded Python, a server starting). At priority 19 the build yields a core to
any test at once; with two threads it fills every idle spell, because a build thread that finds
its core taken is moved to the idle one while its partner sleeps at the barrier
(``OMP_WAIT_POLICY=PASSIVE``, set by ``tests/conftest.py`` and inherited). Measured over 25
steps: 0.55 s a step with both cores free, 0.84 with a busy process beside it (one thread: 0.98
and 0.93); spinning threads (``GOMP_SPINCOUNT=20000``) took 2.4 s a step beside it.
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
#: The builder's torch threads. Two give the same bytes as one (the build's kernels reduce in a fixed
#: order whatever the thread count: the same model.safetensors, sha256 1dbf870b..., either way).
BUILD_THREADS = 2
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
            threads = str(BUILD_THREADS)
            env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
            with self.log.open("w") as log:
                # base=None: the build makes the seed's tiny model itself, the same bytes as tiny_model_dir
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "atlas_lightning.cli", "data", "tiny-orchestrator", "--seed", "0",
                     "--out", str(self.folder)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env)
            # The lowest priority: a test that wants a core gets it; the build takes what the tests
            # leave idle. Set before the build's torch makes its threads, which inherit it.
            os.setpriority(os.PRIO_PROCESS, self.process.pid, 19)

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
