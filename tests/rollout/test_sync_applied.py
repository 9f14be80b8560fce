"""The proof that the engine applies what it was sent (``rollout/sync_probe.py``), through the real
weight sync (as the PPO module builds it), a real trainer and the real in-process vLLM engine,
for both sync kinds:

* clean syncs pass at the report's actor lr 1e-6 and at the tiny run's 2e-3, with residuals far
  below the limit (the false-alarm margin): every sync decided by the marked check (the default),
  or, with the norm rule alone, once the update's movement is measurable;
* an engine that holds the adapter (its worker's digest is true) and applies none, vLLM's
  silent failure on some hybrids, is refused at the starting sync, before any training; through
  ``atlas-lightning fit`` it exits 2 naming the cause, with no step run (the transformers reference
  engine ignoring it in ``make test``, the vLLM engine in ``make test-e2e``);
* an engine that reports what it was sent and keeps serving what it had is refused by the
  movement alone (the absolute probe switched off), with a residual of about the whole expected
  movement (4x the limit): at its first stale sync by the marked check, at both learning rates;
  by the norm rule alone once the update's movement is measurable.

Each case prints its figures (``-s``); the bench README quotes them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest
import torch

from atlas_lightning.config import compose
from atlas_lightning.rollout.digest import digest_named
from atlas_lightning.rollout.engine import SyncReport
from atlas_lightning.rollout.engines.adapter_folder import adapter_folder_digest
from atlas_lightning.rollout.sync_probe import RESIDUAL_LIMIT, StartingCheckError, WeightSyncError
from tests.e2e_variants import first_variant_in_make_test

pytestmark = pytest.mark.vllm

PROBE = list(range(20, 120))
#: The absolute probe (``rollout.logprob_gap_factor``) out of the way: the movement alone decides.
NO_ABSOLUTE_PROBE = ["rollout.logprob_gap_factor=1e9", "rollout.max_logprob_gap=100"]


def _vllm_engine_class():
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine


def _lying_class():
    class LyingEngine(_vllm_engine_class()):
        """Reports what it was sent (as a server reports its folder, or the tensors its loader
        took) and keeps serving what it had."""

        def set_adapter(self, adapter):
            digest = adapter_folder_digest(adapter.folder)
            return SyncReport(tensor_count=len(digest), digest=digest, held="the adapter folder",
                              form={"kind": "lora", "dtype": None, "scale_b": False})

        def load_merged(self, weights, version):
            tensors = list(weights.tensors())
            return SyncReport(tensor_count=len(tensors), digest=digest_named(tensors),
                              held="received by the engine's weight loader", form={"kind": "tensors"})

    return LyingEngine


def _ignoring_class():
    class AdapterIgnoringEngine(_vllm_engine_class()):
        """Loads and holds every adapter it is sent (the worker's digest is the adapter's) and
        applies none: requests and probes reach the base."""

        def prompt_logprobs(self, token_ids):
            lora, self._lora = self._lora, None
            try:
                return super().prompt_logprobs(token_ids)
            finally:
                self._lora = lora

    return AdapterIgnoringEngine


@contextmanager
def _behaving_as(engine, cls):
    kept, engine.__class__ = engine.__class__, cls
    try:
        yield engine
    finally:
        engine.__class__ = kept


@pytest.fixture
def engine(vllm_engine, tiny_model_dir):
    """The shared engine, given back serving the bare base (merged syncs replace its weights)."""
    yield vllm_engine
    from atlas_lightning.models.weights import merged_weights
    from tests.model_builds import actor_critic

    vllm_engine.set_adapter(None)
    fresh = actor_critic(str(tiny_model_dir), {"rank": 8, "alpha": 16}, dtype="float32")  # B = 0: merged = base
    vllm_engine.load_weights(iter(merged_weights(fresh, "actor")))


def _trainer(tiny_model_dir, tmp_path, kind, *overrides):
    from atlas_lightning.ppo.module import PPOModule

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}", "name=applied",
                   f"rollout.weight_sync={kind}", *overrides])
    module = PPOModule(cfg)
    module.configure_model()
    return module


def _serving(engine):
    from types import SimpleNamespace

    return SimpleNamespace(engine=engine, probe_token_ids=lambda: PROBE, weights_version=None)


def _update(module, optimizer) -> None:
    """One AdamW step of the actor on a fixed sequence (each factor moves by about the lr)."""
    from atlas_lightning.models.packing import pack_sequences

    log_probs, _ = module.model.actor_forward(pack_sequences([torch.tensor(PROBE[::-1])], [10]),
                                              temperature=1.0, compute_entropy=False)
    optimizer.zero_grad()
    (-log_probs.sum()).backward()
    optimizer.step()


@pytest.mark.parametrize("kind", ["lora", "merged"])
@pytest.mark.parametrize("marked_every, lr, updates", [(1, 1e-6, 3), (1, 2e-3, 2), (0, 1e-6, 5)],
                         ids=["marked-lr1e-6", "marked-lr2e-3", "norm-rule-lr1e-6"])
def test_clean_syncs_pass_far_below_the_limit(engine, tiny_model_dir, tmp_path, kind, lr, updates, marked_every):
    """With the marked check every sync is decided at once; with the norm rule alone (0) at lr
    1e-6 the movement decides once it is measurable (here by v5)."""
    module = _trainer(tiny_model_dir, tmp_path, kind, f"rollout.marked_check_every={marked_every}")
    sync, serving = module.weight_sync, _serving(engine)
    start = sync.sync(module.model, serving, version=0)
    ratios = [start["rollout/applied_residual_ratio"]]
    optimizer = torch.optim.AdamW(module.model.actor_parameters(), lr=lr)
    for version in range(1, updates + 1):
        _update(module, optimizer)
        sync.sync(module.model, serving, version=version)
        moved = sync.movement.last
        print(f"{kind} lr {lr:g} marked every {marked_every} v{version}: movement {moved.expected / moved.noise:.3g} "
              f"noises, residual ratio {moved.ratio:.3g}, measurable {moved.measurable}")
        assert sync.movement.engine_unmoved_syncs == 0
        if marked_every:
            assert sync.movement.unverified_syncs == 0 and sync.movement.reference.version == version
        if moved.measurable or marked_every:
            ratios.append(moved.ratio)
    assert sync.movement.unverified_syncs == 0 and len(ratios) >= 2  # the updates' movement was decided
    print(f"{kind} lr {lr:g} marked every {marked_every}: largest residual ratio {max(ratios):.3g}, false-alarm "
          f"margin {RESIDUAL_LIMIT / max(ratios):.3g}x")
    assert max(ratios) < RESIDUAL_LIMIT / 4


def test_an_engine_that_ignores_the_adapter_is_refused_at_the_starting_sync(engine, tiny_model_dir, tmp_path):
    module = _trainer(tiny_model_dir, tmp_path, "lora")
    with _behaving_as(engine, _ignoring_class()), pytest.raises(StartingCheckError) as info:
        module.weight_sync.sync(module.model, _serving(engine), version=0)
    message = str(info.value)
    assert message.startswith("weight sync v0, starting check: with the marked adapter ")
    assert "the engine ignores the adapter it holds" in message and "refusing to train" in message
    moved = module.weight_sync.movement.last
    print(f"ignored adapter at the start: residual ratio {moved.ratio:.3g} ({moved.ratio / RESIDUAL_LIMIT:.3g}x "
          f"the limit), movement {moved.expected / moved.noise:.3g} noises")
    assert moved.ratio > 0.9


@pytest.mark.parametrize("kind", ["lora", "merged"])
@pytest.mark.parametrize("marked_every, lr", [(1, 1e-6), (1, 2e-3), (0, 1e-6)],
                         ids=["marked-lr1e-6", "marked-lr2e-3", "norm-rule-lr1e-6"])
def test_a_lying_engine_is_refused_by_the_movement_alone(engine, tiny_model_dir, tmp_path, kind, lr, marked_every):
    """Refused at its first stale sync by the marked check, whatever the learning rate; by the
    norm rule alone (0) once the update's movement is measurable (at lr 1e-6: v5)."""
    module = _trainer(tiny_model_dir, tmp_path, kind, *NO_ABSOLUTE_PROBE, f"rollout.marked_check_every={marked_every}")
    sync, serving = module.weight_sync, _serving(engine)
    sync.sync(module.model, serving, version=0)
    optimizer = torch.optim.AdamW(module.model.actor_parameters(), lr=lr)
    refused_at = None
    with _behaving_as(engine, _lying_class()):
        for version in range(1, 12):
            _update(module, optimizer)
            try:
                sync.sync(module.model, serving, version=version)
            except WeightSyncError as err:
                refused_at, message = version, str(err)
                break
    moved = sync.movement.last
    print(f"lying {kind} engine at lr {lr:g}, marked every {marked_every}: refused at v{refused_at}, residual "
          f"ratio {moved.ratio:.3g} ({moved.ratio / RESIDUAL_LIMIT:.3g}x the limit), movement "
          f"{moved.expected / moved.noise:.3g} noises; {sync.movement.engine_unmoved_syncs} syncs with the "
          f"engine's probe unchanged")
    assert refused_at is not None and moved.ratio > 0.9
    assert ("serves one it held before" if kind == "lora" else "does not serve the merged weights") in message
    if marked_every:
        assert refused_at == 1 and message.startswith("weight sync v1, marked check: with the marked adapter (")
        return
    # the engine serves what it had: its probe is the last one to the bit at every sync, counted
    # at once even where the norm rule waits for the movement to grow
    assert sync.movement.engine_unmoved_syncs == refused_at
    assert "since the verified v0 the trainer's probe log-probs moved" in message


#: Engines that hold every adapter they are sent and apply none (vLLM's silent failure on some
#: hybrids), as ``rollout.engine`` plugins: the transformers reference engine's in ``make test``, the
#: in-process vLLM engine's in ``make test-e2e`` (its start-up in a child process is most of the
#: case's two minutes on two cores; the refusal through ``fit`` does not depend on the engine, and
#: vLLM's ignoring engine is refused at the starting sync in this process above).
_PLUGINS = {
    "hf": '''
"""The transformers reference engine, holding every adapter it is sent and applying none."""
from atlas_lightning.rollout.engines.hf_engine import HFEngine
from atlas_lightning.rollout.factory import hf_engine


class AdapterIgnoringEngine(HFEngine):
    def _unadapted(self, call):
        if not hasattr(self.model, "disable_adapter"):  # the bare base: nothing to ignore
            return call()
        with self.model.disable_adapter():
            return call()

    def _decode(self, request):
        return self._unadapted(lambda: HFEngine._decode(self, request))

    def prompt_logprobs(self, token_ids):
        return self._unadapted(lambda: HFEngine.prompt_logprobs(self, token_ids))


def make_engine(cfg, *, rank, local_rank, world_size):
    engine = hf_engine(cfg, rank=rank, local_rank=local_rank, world_size=world_size)
    engine.__class__ = AdapterIgnoringEngine
    return engine
''',
    "vllm": '''
"""The in-process vLLM engine, holding every adapter it is sent and applying none."""
from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine
from atlas_lightning.rollout.factory import vllm_engine


class AdapterIgnoringEngine(VLLMEngine):
    def _unadapted(self, call):
        lora, self._lora = self._lora, None
        try:
            return call()
        finally:
            self._lora = lora

    def submit(self, request):
        return self._unadapted(lambda: VLLMEngine.submit(self, request))

    def prompt_logprobs(self, token_ids):
        return self._unadapted(lambda: VLLMEngine.prompt_logprobs(self, token_ids))


def make_engine(cfg, *, rank, local_rank, world_size):
    engine = vllm_engine(cfg, rank=rank, local_rank=local_rank, world_size=world_size)
    engine.__class__ = AdapterIgnoringEngine
    return engine
''',
}


@pytest.mark.slow
@pytest.mark.parametrize("engine_kind", first_variant_in_make_test(list(_PLUGINS)))
def test_fit_with_an_engine_that_ignores_the_adapter_exits_2_before_any_step(tiny_model_dir, sample_data_dir,
                                                                              tmp_path, engine_kind):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "ignoring_engine.py").write_text(textwrap.dedent(_PLUGINS[engine_kind]))
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", "name=ignored",
               f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={tmp_path}",
               "rollout.engine=ignoring_engine.make_engine", "trainer.total_steps=1", "trainer.val_before_train=false",
               "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "logger.mode=disabled"]
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 2, result.stderr[-4000:]
    assert "atlas-lightning fit: weight sync v0, starting check: with the marked adapter" in result.stderr
    assert "the engine ignores the adapter it holds" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("checkpoints/ignored/global_step_*"))  # no step ran


def test_a_starting_adapter_named_as_verl_exports_it_is_proven_with_and_without_it(engine, tiny_model_dir,
                                                                                   tmp_path):
    """``model.actor_adapter`` from a folder named as verl exported the report's (PEFT over
    ``AutoModelForCausalLM``: ``base_model.model.model.layers...``): the move from the base to it
    is judged at the start; an engine that ignores it is refused there, before the absolute probe."""
    from safetensors import safe_open

    from atlas_lightning.rollout.sync import export_actor_adapter

    donor = _trainer(tiny_model_dir, tmp_path / "donor", "lora")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in donor.model.actor_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    folder = tmp_path / "verl_actor"
    export_actor_adapter(donor.model, folder)
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(key.startswith("base_model.model.model.layers.") for key in keys)

    module = _trainer(tiny_model_dir, tmp_path, "lora", f"model.actor_adapter={folder}")
    with _behaving_as(engine, _ignoring_class()), pytest.raises(StartingCheckError) as info:
        module.weight_sync.sync(module.model, _serving(engine), version=0)
    assert "starting check: with the actor adapter against the base the trainer's probe" in str(info.value)
    assert "the engine ignores the adapter it holds" in str(info.value)
    engine.set_adapter(None)

    module = _trainer(tiny_model_dir, tmp_path / "clean", "lora", f"model.actor_adapter={folder}")
    module.weight_sync.sync(module.model, _serving(engine), version=0)  # the engine that applies it passes
    assert module.weight_sync.movement.reference.version == 0
