"""Shared fixtures. Tests run on CPU; multi-process tests use gloo.

Expensive artefacts (the tiny model, the sample data, a vLLM engine) are built once per test
session into a temporary folder: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# vLLM's CPU backend reads these at import; set them before any test imports vllm.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Idle OpenMP threads sleep instead of spinning. The suite may share two cores with the background
# build of the tiny orchestrator (``--full-build``, tests/orchestrator_build.py); spinning threads of one process then
# burn the core another needs: the kill-and-resume test took 199 s and 206 CPU-s beside the build,
# 71 s and 72 CPU-s with this (61 s alone). Read when torch first loads OpenMP: set before any
# test imports torch, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test reads the user's built assets (``make demo``'s ~/.cache/atlas-lightning): the config's
# ``paths.cache`` (``${ATLAS_LIGHTNING_CACHE}``) is an empty folder of this session (each xdist worker
# its own), so a test that needs the tiny model, the sample or the orchestrator takes its fixture
# (``tiny_model_dir``, ``sample_data_dir``, ``orchestrator_dir``) rather than passing where
# ``make demo`` ran and failing where it did not. Set whatever the shell says; every process a test
# starts inherits it; removed when the session ends (``pytest_unconfigure``).
TEST_CACHE = tempfile.mkdtemp(prefix="atlas-lightning-test-cache-")
os.environ["ATLAS_LIGHTNING_CACHE"] = TEST_CACHE

#: What torch.distributed reads to rendezvous, and Lightning and vLLM write into os.environ.
_RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                         "NODE_RANK", "GROUP_RANK")


# -- the tiny orchestrator: shipped, and rebuilt on request (tests/orchestrator_build.py) ----

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import orchestrator_build  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--full-build", action="store_true", default=False,
                     help="also run the tests marked full_build: the whole ~13 CPU-minute rebuild of the shipped "
                          "tiny orchestrator, compared with its shipped losses (make verify-demo-model)")
    parser.addoption("--e2e", action="store_true", default=False,
                     help="also run the tests marked e2e: the long end-to-end runs (launches killed and resumed, "
                          "a vLLM server, several ranks; make test-e2e)")


def pytest_configure(config):
    orchestrator_build.start_early(config)  # while the suite is collected, when it will be wanted


def _file_weight(items) -> dict[str, tuple[int, int]]:
    """Per test file: 0 if it has a ``slow`` test, 1 if one starts engines or processes, else 2;
    then the most tests first. A file of many short fits (the checkpoint verification's 83 cases,
    a few seconds each) took minutes; sorted by its markers alone it started last and ran alone
    at the suite's end."""
    weight: dict[str, int] = {}
    count: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        mine = 0 if item.get_closest_marker("slow") else (
            1 if item.get_closest_marker("vllm") or item.get_closest_marker("multiprocess") else 2)
        weight[file] = min(mine, weight.get(file, 2))
        count[file] = count.get(file, 0) + 1
    return {file: (weight[file], -count[file]) for file in weight}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    # Opt-in tests, deselected unless asked for. The long end-to-end runs (about half an hour of
    # worker time together on two cores) are left to `make test-e2e` so that `make test`, what CI runs, stays
    # inside CI's 15 minutes on a slower machine: each of their stops, resumes, layouts and
    # variants is also tested in one process, one launch or one variant in the default suite.
    for marker, option in (("full_build", "full_build"), ("e2e", "e2e")):
        if not config.getoption(option):
            skipped = [item for item in items if item.get_closest_marker(marker)]
            if skipped:
                config.hook.pytest_deselected(items=skipped)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]
    # The longest files first (a stable sort: a file's tests keep their order): `make test` hands
    # whole files to two workers in this order (pytest-xdist, --dist loadfile
    # --no-loadscope-reorder), and a long file started last would leave the other core idle at
    # the end.
    weight = _file_weight(items)
    items.sort(key=lambda item: weight[item.nodeid.split("::")[0]])
    orchestrator_build.after_collection(config, items)


def pytest_unconfigure(config):
    orchestrator_build.stop(config)
    shutil.rmtree(TEST_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def orchestrator_dir(tmp_path_factory):
    """The warm-started tiny model's folder as ``make demo`` installs it (the shipped bytes,
    ``demo/shipped_model.py``; ``tests/demo/test_shipped_model.py`` checks the build makes them)."""
    from atlas_lightning.demo.shipped_model import install_shipped_model

    out = tmp_path_factory.mktemp("orchestrator") / "model"
    install_shipped_model(out)
    return out


@pytest.fixture(scope="session")
def built_orchestrator_dir(request):
    """The tiny orchestrator built anew by this run (``--full-build`` only), once its build is done."""
    return orchestrator_build.built_folder(request.config)


@pytest.fixture(autouse=True)
def rendezvous_environment_per_test():
    """Each test ends with the rendezvous variables it began with. A test that runs Lightning
    in this process leaves ``MASTER_PORT`` set; a later test's child processes would inherit it
    and try to listen on a port a process group of this one may still hold (EADDRINUSE)."""
    saved = {name: os.environ.get(name) for name in _RENDEZVOUS_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def same_signal_handlers_per_test():
    """Each test ends with the SIGINT and SIGTERM handlers it began with. Lightning answers a
    ``KeyboardInterrupt`` inside ``fit`` by ignoring SIGINT for the rest of the process (its
    ``_call_and_handle_interrupt``); a later test in the same worker that counts on Ctrl-C
    would then see nothing."""
    import signal

    saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in saved.items():
        if handler is not None and signal.getsignal(number) is not handler:
            signal.signal(number, handler)


@pytest.fixture(autouse=True)
def same_global_random_state_per_test():
    """Each test starts from the same state of Python's, numpy's and torch's global generators,
    whatever ran before it in its worker. Which tests share a worker changes from run to run
    (pytest-xdist hands out files as workers free up), so a test drawing from a global generator
    would otherwise see different numbers each run: one drew its output gradient that way, and its
    float32 bound held for most draws and failed in CI for one."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from atlas_lightning.demo.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "tiny-model"
    build_tiny_model(out, seed=0)
    return out


@pytest.fixture(scope="session")
def sample_data_dir(tmp_path_factory):
    from atlas_lightning.demo.sample import build_sample

    out = tmp_path_factory.mktemp("sample") / "sample-data"
    build_sample(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_engine_args(tiny_model_dir):
    """``EngineArgs`` of the embedded default's engine (``experiment=tiny-cpu``: float32, 2,048
    tokens, eager, LoRA rank 8, seed 0) on the tiny model; keyword changes replace fields:
    ``tiny_engine_args(lora_rank=None)``."""
    from dataclasses import replace

    from atlas_lightning.config import compose
    from atlas_lightning.rollout.engines.args import EngineArgs

    base = EngineArgs.from_config(compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}"]))
    return lambda **changes: replace(base, **changes)


@pytest.fixture(scope="session")
def vllm_engine(tiny_engine_args):
    """One in-process vLLM engine with LoRA enabled, shared by the tests that need it."""
    pytest.importorskip("vllm")
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_engine_args())
    yield engine
    engine.close()


# -- tiny random base models of several architectures (models/ and bench/ tests) ----------


@pytest.fixture(scope="session")
def qwen3_base(tmp_path_factory) -> str:
    """Attention-only Qwen3: hidden 64, 2 layers, head_dim 32, vocab 128, untied head."""
    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm

    return str(save_tiny_causal_lm(tmp_path_factory.mktemp("qwen3"), arch="qwen3"))


@pytest.fixture(scope="session")
def qwen3_tied_base(tmp_path_factory) -> str:
    """As ``qwen3_base`` but with the lm_head tied to the embeddings, other weights."""
    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm

    folder = tmp_path_factory.mktemp("qwen3_tied")
    return str(save_tiny_causal_lm(folder, arch="qwen3", tie_word_embeddings=True, seed=1))


@pytest.fixture(scope="session")
def qwen3_5_base(tmp_path_factory) -> str:
    """Hybrid Qwen3.5 (linear + full attention), saved in the VLM checkpoint layout."""
    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm

    return str(save_tiny_causal_lm(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5"))


def randomize_adapters(model, seed: int = 1234, scale: float = 0.1) -> None:
    """LoRA B starts at zero (adapter = no-op); give all adapter weights non-zero values."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.actor_parameters() + model.critic_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


@pytest.fixture
def randomize():
    return randomize_adapters


# -- FSDP2 worker runs on gloo -------------------------------------------------------------


def run_fsdp_worker(world_size: int, arch: str, dims: dict, tmp_path, timeout: int) -> tuple[dict, float]:
    """``tests/models/fsdp_worker.py`` at ``world_size`` ranks (forked by ``tests/forked_ranks.py``,
    torchrun's variables) on a tiny ``arch`` base of ``dims``; (the report its rank 0 wrote, wall seconds)."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path

    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm

    here = Path(__file__).resolve().parent
    worker = here / "models" / "fsdp_worker.py"
    base = save_tiny_causal_lm(tmp_path / "base", arch=arch, **dims)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(here / "forked_ranks.py"), str(world_size), str(worker), str(base), str(out)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "report.json").read_text()), time.perf_counter() - started


@pytest.fixture
def fsdp_worker():
    return run_fsdp_worker


# -- questions, tool-call texts and a driver with fake offsets (env/, reward/, store/ tests) --------


def make_question(benchmark="gpqa", costs=(0.12, 0.5, 0.003, 0.0), correct=(False, True, False, False),
                  answers=None, permutations=((0, 1, 2, 3),), ground_truth="B", question_id="q-1"):
    from atlas_lightning.questions.schema import Candidate, Question

    if answers is None:
        answers = [("ABCD"[i % 4] if benchmark == "gpqa" else f"def solve():\n    return {i}\n") for i in range(len(costs))]
    candidates = tuple(
        Candidate(answer=a, approach=f"approach {i}", confidence=0.5 + 0.05 * i, cost_usd=c, is_correct=ok,
                  solver_model=f"solver-{i}")
        for i, (a, c, ok) in enumerate(zip(answers, costs, correct))
    )
    return Question(question_id=question_id, benchmark=benchmark, problem="What is it?\n(A) 1 (B) 2 (C) 3 (D) 4",
                    ground_truth=ground_truth, candidates=candidates, permutations=tuple(permutations))


def call(name, arguments=None):
    body = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def run_turns(episode, texts, turn_len=5, response_len=7, gap=0):
    """Feed ``texts`` as consecutive turns, each ``turn_len`` tokens, responses ``response_len``
    tokens; returns the replies. Stops early when the episode ends."""
    replies, cursor = [], 0
    for text in texts:
        start, end = cursor + gap, cursor + gap + turn_len
        reply = episode.on_assistant_turn(text, start, end)
        replies.append(reply)
        if reply is None:
            break
        episode.on_tool_response_tokens(end, end + response_len)
        cursor = end + response_len
    return replies


@pytest.fixture
def cfg_of(tmp_path, sample_data_dir, tiny_model_dir):
    """``cfg_of(*overrides)``: a run's config on the tiny model (a whole base: the start-up checks
    read its weights) and the sample data, under ``tmp_path``."""
    from atlas_lightning.config import compose

    def make(*overrides):
        return compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", "name=run", f"model.path={tiny_model_dir}",
                        f"data.root={sample_data_dir}", *overrides])
    return make


@pytest.fixture(scope="session")
def build():
    """Builders of the runtime, reward and records tests: ``build.question(...)``, ``build.call(name,
    arguments)``, ``build.run(episode, texts)``."""
    return SimpleNamespace(question=make_question, call=call, run=run_turns)


def write_fake_model_folder(folder, tensors=("w",)) -> "Path":
    """A folder that passes the model-folder check without a loadable model (config.json naming
    qwen3, a one-word tokenizer, one ``model.safetensors`` holding ``tensors``): for tests of what
    the checks refuse before any model is read."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    Tokenizer(WordLevel({"a": 0}, unk_token="a")).save(str(folder / "tokenizer.json"))
    write_fake_safetensors(folder / "model.safetensors", tensors)
    return folder


def write_fake_safetensors(file, tensors) -> None:
    """A safetensors file whose header names ``tensors`` (two float32 each, zeros)."""
    import json

    header = json.dumps({name: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]}
                         for i, name in enumerate(tensors)}).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * (8 * len(tensors)))
