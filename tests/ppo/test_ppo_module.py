"""PPOModule on the tiny model: one PPO step gives the same adapters at world sizes 1, 2 and 3
(FSDP2 over gloo, uneven shards; world 2 under per-micro-batch recompute plans), its adapters load with ``PeftModel.from_pretrained``, and
after the step the vLLM engine serving the exported adapter agrees with the trainer."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from atlas_lightning.config import compose
from atlas_lightning.rollout.datamodule import RolloutDataModule

WORKER = Path(__file__).with_name("fsdp_ppo_worker.py")
#: torchrun's rendezvous for the worker's ranks, forked after one import of its modules.
FORKED_RANKS = Path(__file__).resolve().parents[1] / "forked_ranks.py"


@pytest.fixture(scope="module")
def step_inputs(tiny_model_dir, sample_data_dir, tmp_path_factory, vllm_engine):
    """A real 4 x 4 rollout batch and the config of the step, written for the worker."""
    tmp = tmp_path_factory.mktemp("ppo")
    cfg = compose([
        "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={tmp}",
        "rollout.n=4", "algorithm.train_batch_size=4", "algorithm.ppo_mini_batch_size=4", "algorithm.ppo_epochs=2",
        "algorithm.actor_lr=1e-3", "algorithm.critic_lr=1e-3", "algorithm.ppo_max_token_len_per_gpu=2500",
        "algorithm.forward_max_token_len_per_gpu=4000", "rollout.max_tokens_per_turn=48",
    ])
    vllm_engine.set_adapter(None)
    dm = RolloutDataModule(cfg, engine=vllm_engine)
    dm.setup("fit")
    batch = dm.rollout(1)
    batch_path, config_path = tmp / "batch.pkl", tmp / "config.yaml"
    with open(batch_path, "wb") as handle:
        pickle.dump(batch, handle)
    config_path.write_text(OmegaConf.to_yaml(cfg))
    return batch_path, config_path, tmp, cfg


def _run(step_inputs, world: int, *extra: str) -> Path:
    batch_path, config_path, tmp, _ = step_inputs
    out = tmp / "-".join([f"world{world}", *extra])
    if not (out / "metrics.json").exists():
        env = dict(os.environ, OMP_NUM_THREADS="1")
        result = subprocess.run([sys.executable, str(FORKED_RANKS), str(world), str(WORKER), str(batch_path),
                                 str(config_path), str(out), str(world), *extra], capture_output=True, text=True,
                                timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-6000:]
    return out


def _adapter(out: Path, role: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / role / "lora_adapter" / "adapter_model.safetensors"))


@pytest.mark.vllm
def test_step_updates_both_adapters_and_reports_verl_metrics(step_inputs, tiny_model_dir):
    out = _run(step_inputs, 1)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["finite"] is True
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
                "response_length/mean", "perf/throughput", "timing_s/update_actor", "timing_s/update_critic",
                "reward/mapping_sum_error_max", "reward/mapped_slots_minus_events_max"):
        assert key in metrics, key
    assert metrics["actor/grad_norm"] > 0 and metrics["critic/grad_norm"] > 0
    # the moments were made before the update, and no gradient outlives it: on a card, both would
    # otherwise sit in the activations' cached segments and keep them from a waking engine
    assert metrics["_stateless_before_update"] == 0 and metrics["_grads_left"] == 0
    # The first PPO epoch starts on-policy: the ratio is 1 up to float noise.
    assert abs(metrics["actor/ppo_kl"]) < 1e-2


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.e2e)])
def test_fsdp_world_sizes_match_one_process(step_inputs, world):
    """World 2 also runs ``model.checkpoint_layers=auto``'s per-size plans (the module's tiers, as
    built on a card): each micro-batch switches plan for the largest of the ranks', and the
    mini-batches are cut by the plans' replayed shares; recomputation changes no number, so the
    step is world 1's (without any) all the same. (The logged losses are means of each
    micro-batch's own token mean, as verl logs them: they follow the cut, and are not compared.)"""
    one = _run(step_inputs, 1)
    many = _run(step_inputs, world, *(["tiers"] if world == 2 else []))
    m1 = json.loads((one / "metrics.json").read_text())
    mn = json.loads((many / "metrics.json").read_text())
    # one rank holds the model whole (nothing to share: no gathers); several shard every parameter
    assert m1["_sharded_params"] == 0 and mn["_sharded_params"] == mn["_params"] == m1["_params"] > 0
    if world == 2:
        assert mn["perf/actor_mixers_replayed"] > 0 and mn["perf/critic_mixers_replayed"] > 0, mn  # plans switched
        assert "perf/actor_layers_replayed" not in m1
    for key in ("actor/grad_norm", "critic/grad_norm", "critic/advantages/mean", "critic/returns/mean",
                "critic/values/mean", "actor/entropy", "critic/score/mean"):
        assert mn[key] == pytest.approx(m1[key], rel=2e-4, abs=1e-5), key
    # Adam divides each gradient element by its own magnitude (+1e-8): where that magnitude is
    # near 1e-8, the fp32 rounding of a different micro-batch summation order shows in the
    # update (seen: 1.5e-4 on one element at world 3). So: nearly every element equal to 1e-6
    # (a sharding error moves most of them), and none off by more than half of one optimizer
    # step (lr = 1e-3).
    for role in ("actor", "critic"):
        a, b = _adapter(one, role), _adapter(many, role)
        assert a.keys() == b.keys()
        diffs = torch.cat([(a[name] - b[name]).abs().flatten() for name in a])
        assert float((diffs > 1e-6).float().mean()) < 1e-3, role
        assert float(diffs.max()) < 5e-4, role


@pytest.mark.vllm
def test_engine_serving_the_trained_adapter_agrees_with_the_trainer(step_inputs, tiny_model_dir, vllm_engine):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from atlas_lightning.rollout.engine import AdapterVersion, GenerationRequest, SamplingSpec

    out = _run(step_inputs, 1)
    folder = out / "actor" / "lora_adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trained = PeftModel.from_pretrained(base, str(folder)).eval()  # a PEFT folder, as the README's "On-disk layout" promises
    assert any(float(p.abs().sum()) > 0 for n, p in trained.named_parameters() if "lora_B" in n)

    vllm_engine.set_adapter(AdapterVersion(str(folder), version=101))
    prompt = list(pickle.load(open(step_inputs[0], "rb")).records[0].prompt_ids)
    result = vllm_engine.generate([GenerationRequest("after-step", tuple(prompt), SamplingSpec(max_tokens=24, temperature=0.0))])[0]
    with torch.no_grad():
        ids = torch.tensor([prompt + result.token_ids])
        logp = torch.log_softmax(trained(ids).logits[0].float(), -1)
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(result.token_ids))
    reference = [float(logp[p, t]) for p, t in zip(positions, result.token_ids)]
    greedy = [int(logp[p].argmax()) for p in positions]
    assert result.token_ids == greedy
    assert max(abs(a - b) for a, b in zip(result.logprobs, reference)) < 2e-4
    vllm_engine.set_adapter(None)


@pytest.mark.vllm
def test_decoupled_loss_on_an_on_policy_batch_is_the_vanilla_step(step_inputs):
    """``algorithm.off_policy_loss=decoupled`` on a batch the engine sampled with the trainer's
    own weights (the base, fresh adapters): every behaviour weight is 1 up to the engine's
    numerical gap, and the step is the default one's up to that gap."""
    batch_path, config_path, tmp, cfg = step_inputs
    vanilla = _run(step_inputs, 1)
    decoupled_cfg = OmegaConf.merge(cfg, {"algorithm": {"off_policy_loss": "decoupled"}})
    (tmp / "decoupled.yaml").write_text(OmegaConf.to_yaml(decoupled_cfg))
    out = tmp / "decoupled"
    result = subprocess.run([sys.executable, str(FORKED_RANKS), "1", str(WORKER), str(batch_path),
                             str(tmp / "decoupled.yaml"), str(out), "1"], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-6000:]
    m1 = json.loads((vanilla / "metrics.json").read_text())
    m2 = json.loads((out / "metrics.json").read_text())
    assert "actor/behav_kl" not in m1  # the default step computes what it always did
    assert m2["actor/behav_imp_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(m2["actor/behav_kl"]) < 1e-3 and m2["actor/behav_capped_frac"] == 0.0
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-2, abs=1e-5), key
    a, b = _adapter(vanilla, "actor"), _adapter(out, "actor")
    assert max(float((a[name] - b[name]).abs().max()) for name in a) < 5e-4
