"""An engine from outside the package, chosen by ``rollout.engine=<class or factory path>``: the
factory builds it from the run's config on this process, the datamodule's set-up builds it that
way and rolls out through it; a target that is not an ``Engine``, or cannot be found, is refused
naming ``rollout.engine``."""

from __future__ import annotations

import sys
import textwrap

import pytest

from atlas_lightning.config import ConfigError, compose

#: Written to tmp_path: the package is not edited, the engine is the user's own module.
PLUGIN = '''
"""A user's engine: answers every request with one submit call, token by token from the model's tokenizer."""
from transformers import AutoTokenizer

from atlas_lightning.rollout.engine import Engine, GenerationResult

CALL = '<tool_call>\\n{"name": "submit", "arguments": {"answer": "A"}}\\n</tool_call>'
LOGPROB = -0.375


class SubmitEngine(Engine):
    name = "submit-engine"

    def __init__(self, cfg, *, rank, local_rank, world_size):
        self.cfg, self.placement = cfg, (rank, local_rank, world_size)
        self.tokens = AutoTokenizer.from_pretrained(cfg.model.path).encode(CALL, add_special_tokens=False)
        self.pending, self.prompts = [], []

    def submit(self, request):
        self.pending.append(request)
        self.prompts.append(request.prompt_ids)

    def poll(self):
        done, self.pending = self.pending, []
        return [GenerationResult(r.request_id, self.tokens + [r.sampling.stop_token_ids[0]],
                                 [LOGPROB] * (len(self.tokens) + 1), "stop") for r in done]

    def num_pending(self):
        return len(self.pending)

    def prompt_logprobs(self, token_ids):
        return [LOGPROB] * (len(token_ids) - 1)


def make_engine(cfg, *, rank, local_rank, world_size):
    return SubmitEngine(cfg, rank=rank, local_rank=local_rank, world_size=world_size)


def not_an_engine(cfg, *, rank, local_rank, world_size):
    return object()


def engine_told_the_actor_lora(cfg, *, rank, local_rank, world_size, actor_lora=None):
    engine = SubmitEngine(cfg, rank=rank, local_rank=local_rank, world_size=world_size)
    engine.actor_lora = actor_lora
    return engine
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "user_engines_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(folder))
    import user_engines_plugin

    yield user_engines_plugin
    sys.modules.pop("user_engines_plugin", None)


def _cfg(tiny_model_dir, sample_data_dir, tmp_path, engine):
    return compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                    f"paths.root={tmp_path}", f"rollout.engine={engine}", "rollout.n=2",
                    "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1"])


@pytest.mark.parametrize("target", ["user_engines_plugin.SubmitEngine", "user_engines_plugin.make_engine"])
def test_an_engine_from_outside_the_package_is_built_and_rolls_out(plugin, target, tiny_model_dir,
                                                                   sample_data_dir, tmp_path):
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.rollout.factory import build_engine

    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path, target)
    built = build_engine(cfg, rank=0, local_rank=0, world_size=1)
    assert type(built) is plugin.SubmitEngine and built.cfg is cfg and built.placement == (0, 0, 1)

    dm = RolloutDataModule(cfg)
    dm.setup("fit")  # no engine given: the factory builds the configured one
    assert type(dm.engine) is plugin.SubmitEngine
    batch = dm.rollout(1)
    assert len(batch) == 4 and len(dm.engine.prompts) == 4
    n = len(dm.engine.tokens) + 1
    for record in batch.records:
        assert record.episode["terminal_reason"] == "submitted" and record.num_turns == 1
        assert list(record.response_ids) == dm.engine.tokens + [dm.chat.stop_token_ids[0]]
        assert record.response_logprobs.tolist() == [plugin.LOGPROB] * n and record.response_mask.sum() == n
    assert sorted(tuple(p) for p in dm.engine.prompts) == sorted(tuple(r.prompt_ids) for r in batch.records)


def test_an_engine_target_that_is_not_an_engine_or_not_there_is_named(plugin, tiny_model_dir, sample_data_dir,
                                                                       tmp_path):
    from atlas_lightning.rollout.factory import build_engine

    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path, "user_engines_plugin.not_an_engine")
    with pytest.raises(TypeError, match=r"rollout\.engine='user_engines_plugin\.not_an_engine'.*returned a object"):
        build_engine(cfg)
    with pytest.raises(ConfigError, match=r"rollout\.engine='no_such_pkg\.Engine': no module no_such_pkg"):
        compose(["experiment=tiny-cpu", "rollout.engine=no_such_pkg.Engine"])
    with pytest.raises(ConfigError, match=r"rollout\.engine='tgi' is neither one of vllm, vllm-server, hf nor a class or factory path"):
        compose(["experiment=tiny-cpu", "rollout.engine=tgi"])


def test_a_target_that_takes_actor_lora_gets_the_shape_the_run_resolved(plugin, tiny_model_dir, sample_data_dir,
                                                                         tmp_path):
    """A factory with an ``actor_lora`` parameter gets the actor's LoRA shape the datamodule was
    handed (the run's start-up resolved it once, as the package's vLLM engines take it to size
    their LoRA slot); a factory without one is called as before."""
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.rollout.factory import build_engine
    from atlas_lightning.store.lora_shapes import LoraShape

    shape = LoraShape(rank=4, alpha=12.0)
    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path, "user_engines_plugin.engine_told_the_actor_lora")
    assert build_engine(cfg, actor_lora=shape).actor_lora is shape
    assert build_engine(cfg).actor_lora is None
    dm = RolloutDataModule(cfg, actor_lora=shape)
    dm.setup("fit")
    assert dm.engine.actor_lora is shape
    dm.teardown()
