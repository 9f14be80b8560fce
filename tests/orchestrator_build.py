"""The tiny orchestrator (the SFT warm start ``make demo`` trains from), built beside the tests.

Only with ``pytest --full-build`` (``make verify-demo-model``): the default suite checks the
build by replaying its first steps against the shipped trajectory
(``tests/demo/test_shipped_model.py``), and its tests use the shipped model (``orchestrator_dir``).
The test suite's hooks and the ``built_orchestrator_dir`` fixture (``tests/conftest.py``) call this
module. The build (``DEFAULT_RECIPE``, seed 0: the weights ``make demo`` installs) takes about
13 CPU minutes. It runs in a child process while the other tests run, and the tests that need it
run last:

* it starts before collection (``start_early``) when the run's paths include ``tests/demo``
  (the whole suite, say), else once collection shows a selected test needs it; it is stopped
  when none does (``after_collection``);
* it goes into pytest's cache under a key of the code, the libraries and the builder's
  arguments that make it (``build_key``): later runs reuse it;
* it builds without the greedy and sampled check after training (``--eval-questions 0``): no
  test reads that part of its summary, and the weights never depend on it (~40 CPU-s saved).

Why two threads at the lowest priority: the build and the other tests (~10 CPU minutes) are each
nearly as long as CI may take on two cores, and the tests often leave a core idle in short spells
(one-threaded Python, a server starting). At priority 19 the build yields a core to any test at
once; with two threads it fills every idle spell, because a build thread that finds its core
taken is moved to the idle one while its partner sleeps at the barrier (``OMP_WAIT_POLICY=PASSIVE``,
set by ``tests/conftest.py`` and inherited). Measured over 25 steps: 0.55 s a step with both cores
free, 0.84 with a busy process beside it (one thread: 0.98 and 0.93); spinning threads
(``GOMP_SPINCOUNT=20000``) took 2.4 s a step beside it. On the machine that made the shipped
model one thread gave the same bytes as two (model.safetensors sha256 ``1dbf870b...``, the model
the README's learning figures were measured on); on another CPU (AVX-512 with AMX, 2026-12-06)
the bytes differ in the last bits whatever the threads, so the build is compared with the
shipped one by its losses and weights within tolerances (``tests/demo/test_shipped_model.py``).
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

_TESTS = Path(__file__).resolve().parent
_PACKAGE = _TESTS.parent / "atlas_lightning"
#: What the built model depends on: its code (demo builders, runtime, chat format) and the libraries.
_SOURCES = ("demo/demos.py", "demo/tiny_orchestrator.py", "demo/tiny_model.py", "demo/tiny_tokenizer.py",
            "demo/tiny_corpus.py", "demo/sample.py", "demo/sample_texts.py", "questions", "rollout/chat.py",
            "rollout/agent_loop.py", "rollout/engine.py", "rollout/engines/hf_engine.py", "env", "reward",
            "config.py")  # config.py: the loop's limits (LoopLimits) the demonstrations must fit
#: The builder's torch threads (see the module doc).
BUILD_THREADS = 2
#: The builder's command-line arguments after ``--out`` (base: none, the build makes the seed's
#: tiny model itself, the same bytes as the ``tiny_model_dir`` fixture's).
BUILD_ARGS = ("--seed", "0", "--eval-questions", "0")
#: How long the test waiting for the build waits at most.
BUILD_TIMEOUT_S = 3600
#: The fixture that hands the built folder to a test.
FIXTURE = "built_orchestrator_dir"


def build_key() -> str:
    """16 hex digits of the sources, library versions, threads and arguments that make the build."""
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256()
    for name in _SOURCES:
        path = _PACKAGE / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(_PACKAGE).as_posix().encode() + b"\0" + file.read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__} {tokenizers.__version__} "
                  f"threads={BUILD_THREADS} args={' '.join(BUILD_ARGS)}".encode())
    return digest.hexdigest()[:16]


class OrchestratorBuild:
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
        self._temporary = getattr(config, "cache", None) is None
        self._cache = cache
        self.folder = cache / "model"
        self.log = cache / "build.log"
        self.process: subprocess.Popen | None = None
        if not (self.folder / "sft_summary.json").is_file():
            threads = str(BUILD_THREADS)
            env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
            with self.log.open("w") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "atlas_lightning.cli", "data", "tiny-orchestrator", "--out", str(self.folder),
                     *BUILD_ARGS], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
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
        """End an unfinished build (its own clean-up runs: no staging folder left); a run without
        pytest's cache then leaves no folder of it behind either."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if self._temporary:
                shutil.rmtree(self._cache, ignore_errors=True)
        self.process = None


_STASH = pytest.StashKey[OrchestratorBuild]()


def start_early(config: pytest.Config) -> None:
    """Before collection (``pytest_configure``): start the build when the run's paths include
    ``tests/demo`` (the folder or one above it), so that it runs while the suite is collected."""
    if config.option.collectonly or _STASH in config.stash or not config.getoption("full_build"):
        return
    demo = _TESTS / "demo"
    for arg in config.args:
        path = Path(str(arg).split("::")[0]).resolve()
        if path == demo or path in demo.parents:
            config.stash[_STASH] = OrchestratorBuild(config)
            return


def after_collection(config: pytest.Config, items: list) -> None:
    """After collection: the tests that need the build run last, and the build runs (started
    now if it was not) only if a selected test needs it."""
    needing = [item for item in items if FIXTURE in getattr(item, "fixturenames", ())]
    if config.option.collectonly:
        return
    if not needing:
        if _STASH in config.stash:  # started early, then deselected (-k, -m): not wanted
            config.stash[_STASH].stop()
            del config.stash[_STASH]
        return
    items[:] = [item for item in items if FIXTURE not in getattr(item, "fixturenames", ())] + needing
    if _STASH not in config.stash:
        config.stash[_STASH] = OrchestratorBuild(config)


def built_folder(config: pytest.Config) -> Path:
    """The ``orchestrator_dir`` fixture: the built folder, waiting for the build (or building it
    now, in the foreground, when the test was selected in a way the hooks did not see)."""
    if _STASH not in config.stash:
        config.stash[_STASH] = OrchestratorBuild(config)
    return config.stash[_STASH].wait()


def stop(config: pytest.Config) -> None:
    """``pytest_unconfigure``: an interrupted run leaves no builder behind."""
    build = config.stash.get(_STASH, None)
    if build is not None:
        build.stop()
