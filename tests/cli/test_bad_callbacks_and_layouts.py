"""Keys a fit cannot use are refused before anything is written, naming the key (exit 2): a
callback's argument of the wrong type, misspelt, or out of its range (``callbacks.validation.overlap``,
``callbacks.checkpoint.background``, the fault injection's keys, ...), and the layout keys a layout
cannot run or would silently ignore (``layout.partial_rollouts``, ``layout.staleness_policy``,
the server engine's settings in a colocated layout, the separate layout's engine side)."""

from __future__ import annotations

import re

import pytest

from atlas_lightning.cli import main
from atlas_lightning.config import ConfigError, compose

INJECT = "+callbacks.fault_injection._target_=atlas_lightning.callbacks.faults.FaultInjection"


@pytest.mark.parametrize("overrides, message", [
    (["callbacks.validation.overlap=maybe"],
     "callbacks.validation.overlap='maybe': ValidationCallback takes bool for overlap, got str"),
    (["callbacks.validation.overlap=1"], "callbacks.validation.overlap=1: ValidationCallback takes bool"),
    (["callbacks.checkpoint.background=nope"], "callbacks.checkpoint.background='nope': StepCheckpoint takes bool"),
    (["callbacks.checkpoint.every_n_steps=five"],
     "callbacks.checkpoint.every_n_steps='five': StepCheckpoint takes int"),
    (["+callbacks.validation.overlpa=true"], "callbacks.validation.overlpa: ValidationCallback takes no argument "
                                            "'overlpa' (it takes: artifacts, checkpoints, run_id, val_every"),
    (["callbacks.nan_guard.policy=rolback"], "callbacks.nan_guard: cannot build atlas_lightning.callbacks.nan_guard."
                                            "NaNGuardCallback: NaNGuardCallback: policy must be one of"),
    (["callbacks.figures.dpi=2"], "callbacks.figures: cannot build"),
    (["callbacks.checkpoint.every_n_steps=-1"], "callbacks.checkpoint.every_n_steps=-1: must be an integer >= 0 "
                                                "(the rule of trainer.save_every"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kil", "+callbacks.fault_injection.step=2"],
     "FaultInjection: fault must be one of engine_kill"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=-1"],
     "FaultInjection: step must be an RL step"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=two"],
     "callbacks.fault_injection.step='two': FaultInjection takes int"),
    ([INJECT, "+callbacks.fault_injection.fault=out_of_memory", "+callbacks.fault_injection.step=2",
      "+callbacks.fault_injection.phase=sync"], "phase must be one of rollout, sync, validation (other than rollout "
                                               "only for engine_kill)"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=2",
      "+callbacks.fault_injection.rank=-1"], "rank must be a global rank"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill"], "callbacks.fault_injection: cannot build"),
    # a fault that would never strike: the run would end as if it had been survived
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=11"],
     "callbacks.fault_injection: engine_kill at RL step 11 would never happen: the run trains RL steps 1..10"),
    ([INJECT, "+callbacks.fault_injection.fault=checkpoint_write", "+callbacks.fault_injection.step=3"],
     "checkpoint_write at RL step 3 would never happen: no checkpoint is written at that step"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=3",
      "+callbacks.fault_injection.phase=validation"], "no validation runs at that step (trainer.val_every)"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=2",
      "+callbacks.fault_injection.phase=validation", "trainer.val_every=2", "callbacks.validation.overlap=true"],
     "that step's validation rides with the next training rollout"),
    ([INJECT, "+callbacks.fault_injection.fault=non_finite", "+callbacks.fault_injection.step=3",
      "+callbacks.fault_injection.rank=1"], "non_finite at RL step 3 on rank 1 would never happen: the run has 1 rank"),
    ([INJECT, "+callbacks.fault_injection.fault=engine_kill", "+callbacks.fault_injection.step=3", "rollout.engine=hf"],
     "the hf engine runs in the trainer's process"),
    # the hub callback's upload settings, checked as it is built, not when its uploader is first built mid-run
    (["+callbacks.hub.retries=-1"], "callbacks.hub: cannot build atlas_lightning.callbacks.hub.HubCheckpointCallback: "
                                    "HubCheckpointCallback: retries=-1 must be an int >= 0"),
    (["+callbacks.hub.backoff_s=-2.0"], "HubCheckpointCallback: backoff_s=-2.0 must be a finite number of seconds"),
    # an argument the shipped entry takes from a run key, set on the callback: that key's rule
    (["callbacks.hub.repo_type=nonsense"], "callbacks.hub.repo_type='nonsense': is not one of dataset, model (the "
                                           "rule of hub.repo_type, which the shipped entry passes here)"),
    (["callbacks.figures.artifacts=/proc/x"], "callbacks.figures.artifacts=/proc/x: /proc is not writable"),
    (["callbacks.checkpoint.total_steps=5"], "callbacks.checkpoint.total_steps=5 differs from trainer.total_steps=10, "
                                             "which the run follows: set trainer.total_steps instead"),
    (["callbacks.artifacts.run_id=other"], "callbacks.artifacts.run_id='other' differs from name='tiny-cpu'"),
    (["layout=separate_cpu"], "layout.mode=separate serves from a vLLM server on the serving cards: set "
                              "rollout.engine=vllm-server"),
])
def test_a_bad_callback_or_layout_exits_2_naming_the_key_before_anything_is_written(
        overrides, message, tmp_path, sample_data_dir, tiny_model_dir, capsys):
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
                 f"data.root={sample_data_dir}", "logger.mode=disabled", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, message", [
    (["layout.partial_rollouts=true"], "layout.partial_rollouts=true interrupts the separate layout's server requests"),
    (["layout.staleness_policy=drop"], "layout.staleness_policy=drop: a colocated layout samples each rollout on the "
                                       "weights just trained"),
    (["layout.staleness_policy=dorp"], "layout.staleness_policy='dorp': is not one of wait, drop"),
    (["layout.partial_rollouts=maybe"], "layout.partial_rollouts"),
    (["rollout=vllm_server_cpu", "rollout.weight_sync=merged"], "rollout.weight_sync=merged with "
                                                                "rollout.engine=vllm-server in a colocated layout"),
    (["rollout.server_url=http://127.0.0.1:8000"], "rollout.server_url=http://127.0.0.1:8000: attaching to a running "
                                                   "server is the vllm-server engine's"),
    (["rollout=vllm_server_cpu", "rollout.server_url=http://127.0.0.1:8000", "layout=colocated_2gpu",
      "layout.engine_tp=1"], "2 engine(s) here"),
    (["rollout=vllm_server_cpu", "layout=colocated_2gpu"], "rollout.engine=vllm-server with layout.engine_tp=2 over 2 "
                                                           "training processes"),
    (["layout.serve_gpus=1"], "layout.serve_gpus=1: a colocated layout serves from its training cards"),
    (["rollout.weight_transfer=gloo"], "rollout.weight_transfer=gloo carries merged weights to the separate layout's "
                                       "server"),
    (["layout=separate_cpu", "rollout=vllm_server_cpu", "rollout.weight_transfer=gloo"],
     "(layout.mode=separate, rollout.weight_sync=lora) it would do nothing"),
    (["algorithm.off_policy_loss=decoupld"], "algorithm.off_policy_loss"),
    (["algorithm.behav_imp_weight_cap=0.5"], "algorithm.behav_imp_weight_cap=0.5: must be a finite number >= 1"),
    (["algorithm.behav_imp_weight_cap=nan"], "algorithm.behav_imp_weight_cap=nan: must be a finite number"),
    (["algorithm.behav_imp_weight_mode=clip"], "algorithm.behav_imp_weight_mode"),
    (["trainer.gpu_hour_usd=-1"], "trainer.gpu_hour_usd=-1.0: must be a finite number >= 0"),
    (["trainer.gpu_hour_usd=inf"], "trainer.gpu_hour_usd=inf: must be a finite number"),
    (["trainer.gpu_hour_usd=cheap"], "trainer.gpu_hour_usd"),
    (["rollout.gdn_prefill_backend=tritn"], "rollout.gdn_prefill_backend='tritn': is not one of auto, triton"),
    (["layout.mode=separate"], "layout.mode=separate with layout.serve_gpus=0: a separate layout serves on cards of "
                               "its own"),
    (["rollout.engine=hf", "rollout.top_p=0.9"], "rollout.engine=hf (the transformers reference engine) samples with "
                                                 "neither top_p nor top_k"),
    (["rollout.engine=hf", "rollout.top_k=20"], "rollout.top_p=1.0 rollout.top_k=20"),
    # a training process left without a trajectory: one TP2 engine, one TP1 engine a card, the separate layout's ranks
    (["layout=colocated_2gpu", "algorithm.train_batch_size=1", "algorithm.ppo_mini_batch_size=1", "rollout.n=1"],
     "algorithm.train_batch_size=1 with rollout.n=1: the 2 training processes (1 engine(s) of 2) would leave one "
     "without a trajectory"),
    (["layout=colocated_2gpu", "layout.engine_tp=1", "algorithm.train_batch_size=1", "algorithm.ppo_mini_batch_size=1"],
     "at least algorithm.train_batch_size=2"),
    (["layout=colocated_8gpu_tp4", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.n=1"],
     "at least algorithm.train_batch_size=8"),
    (["layout=separate_4_4", "algorithm.train_batch_size=3", "algorithm.ppo_mini_batch_size=1"],
     "the 4 training processes (4 engine(s) of 1)"),
])
def test_layout_and_algorithm_keys_that_cannot_work_are_refused_at_compose(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(["experiment=tiny-cpu", *overrides])


def test_every_shipped_experiment_and_layout_still_composes():
    for experiment in ("tiny-cpu", "h200-tiny", "h200-8b", "r28-base-cost-2gpu", "r28-continued-cost-8gpu-n32",
                       "r28-continued-cost-8gpu-t49152-n16-separate4-4-memory",
                       "r28-continued-cost-8gpu-t98304-separate6-2-memory"):
        compose([f"experiment={experiment}"])
    compose(["experiment=tiny-cpu", "layout=separate_cpu", "rollout=vllm_server_cpu", "layout.partial_rollouts=true",
             "layout.staleness_policy=drop"])
    compose(["experiment=tiny-cpu", "rollout=vllm_server_cpu"])  # one colocated server engine
    # one question's trajectories split over a TP2 engine's two processes: each gets one
    compose(["experiment=tiny-cpu", "layout=colocated_2gpu", "algorithm.train_batch_size=1",
             "algorithm.ppo_mini_batch_size=1", "rollout.n=2"])
    compose(["experiment=tiny-cpu", "layout=separate_cpu", "rollout=vllm_server_cpu", "rollout.weight_sync=merged",
             "rollout.weight_transfer=gloo"])


@pytest.mark.parametrize("name", ["config.yaml", "main_ppo.log"])
def test_a_run_file_that_is_a_folder_exits_2_before_anything_is_written(name, tmp_path, sample_data_dir,
                                                                        tiny_model_dir, capsys):
    (tmp_path / "outputs" / "tiny-cpu" / name).mkdir(parents=True)
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
                 f"data.root={sample_data_dir}", "logger.mode=disabled"])
    err = capsys.readouterr().err
    assert code == 2 and f"the run's file {tmp_path / 'outputs' / 'tiny-cpu' / name} is a folder" in err, err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "outputs", "outputs/tiny-cpu", f"outputs/tiny-cpu/{name}"]


@pytest.mark.parametrize("unappendable", ["/proc/version", "read-only"])
def test_a_run_log_that_takes_no_lines_exits_2_before_anything_is_written(unappendable, tmp_path, sample_data_dir,
                                                                          tiny_model_dir, capsys):
    """``main_ppo.log`` is appended to by every launch: one that exists and takes no line (a file
    without write permission; a link to a file nothing can append to, which binds root too) is
    refused before the config is written, instead of a traceback after it."""
    import os

    log_file = tmp_path / "outputs" / "tiny-cpu" / "main_ppo.log"
    log_file.parent.mkdir(parents=True)
    if unappendable == "read-only":
        log_file.write_text("the last launch's lines\n")
        log_file.chmod(0o444)
        if os.access(log_file, os.W_OK):
            pytest.skip("this user writes a read-only file (root)")
    else:
        log_file.symlink_to(unappendable)
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
                 f"data.root={sample_data_dir}", "logger.mode=disabled"])
    err = capsys.readouterr().err
    assert code == 2 and f"the run's log {log_file} cannot be appended to" in err and "Traceback" not in err, err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "outputs", "outputs/tiny-cpu", "outputs/tiny-cpu/main_ppo.log"]


#: A value each rule kind refuses (the rules of the run keys the shipped callbacks take).
_REFUSED_BY = {"paths.artifacts": "", "paths.checkpoints": "", "name": "a/b", "trainer.total_steps": 0,
               "trainer.val_every": -1, "trainer.save_every": -1, "hub.repo_id": "no-owner",
               "hub.repo_type": "nonsense", "hub.endpoint": "ftp://hub"}


def test_every_argument_the_shipped_callbacks_take_from_a_run_key_keeps_its_rule_when_set_directly():
    """Set on the callback itself, each such argument is refused as its run key would be, naming
    the callback's key; every one with a rule is tried (a new one without a refused value here
    fails this test)."""
    from atlas_lightning.constraints import CONSTRAINTS
    from atlas_lightning.run.callback_arguments import shipped_sources
    from atlas_lightning.run.wiring import build_callbacks

    tried = 0
    for entry, sources in shipped_sources().items():
        for key, source in sources.items():
            if source not in CONSTRAINTS:
                continue
            assert source in _REFUSED_BY, f"callbacks.{entry}.{key} takes {source}: add a value its rule refuses"
            value = _REFUSED_BY[source]
            cfg = compose(["experiment=tiny-cpu", f"callbacks.{entry}.{key}={value!r}"])
            with pytest.raises(ConfigError, match=re.escape(f"callbacks.{entry}.{key}={value!r}: ") +
                               ".*" + re.escape(f"(the rule of {source}, which the shipped entry passes here)")):
                build_callbacks(cfg)
            tried += 1
    assert tried >= 15
    build_callbacks(compose(["experiment=tiny-cpu"]))  # the shipped values pass


def test_a_fault_at_a_step_the_resumed_run_does_not_train_is_refused():
    from atlas_lightning.callbacks.faults import FaultInjection
    from atlas_lightning.run.faults import check_injections

    cfg = compose(["experiment=tiny-cpu"])
    check_injections({"fault": FaultInjection("engine_kill", 4)}, cfg, resumed_step=3)  # step 4 is trained
    attached = compose(["experiment=tiny-cpu", "rollout=vllm_server_cpu", "rollout.server_url=http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match=re.escape("(rollout.server_url): it holds no process to kill")):
        check_injections({"fault": FaultInjection("engine_kill", 4)}, attached, resumed_step=0)
    separate = compose(["experiment=tiny-cpu", "layout=separate_cpu", "rollout=vllm_server_cpu", "layout.gpus=3",
                        "layout.train_gpus=2"])
    with pytest.raises(ConfigError, match=re.escape("rank 0 alone holds the server's process")):
        check_injections({"fault": FaultInjection("engine_kill", 4)}, separate, resumed_step=0)
    check_injections({"fault": FaultInjection("engine_kill", 4, rank=0)}, separate, resumed_step=0)
    with pytest.raises(ConfigError, match=re.escape("engine_kill at RL step 3 would never happen: the run trains "
                                                    "RL steps 4..10")):
        check_injections({"fault": FaultInjection("engine_kill", 3)}, cfg, resumed_step=3)


def test_a_server_engine_asked_to_sleep_on_gpus_is_refused_before_anything_is_written(monkeypatch):
    import atlas_lightning.run.environment as environment
    from atlas_lightning.run.environment import check_machine

    cfg = compose(["experiment=tiny-cpu", "rollout=vllm_server_cpu", "rollout.enable_sleep_mode=true"])
    check_machine(cfg)  # no card here: the CPU server never sleeps, nothing to refuse
    monkeypatch.setattr(environment, "_gpu_count", lambda: 1)
    with pytest.raises(ConfigError, match=re.escape("rollout.enable_sleep_mode=true with rollout.engine=vllm-server "
                                                    "on GPUs")):
        check_machine(cfg)


def test_preflight_builds_the_callbacks_as_fit_does(tiny_model_dir, sample_data_dir, tmp_path):
    from atlas_lightning.run.preflight import run_preflight

    base = ["experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
            f"data.root={sample_data_dir}", "logger.mode=disabled"]
    checks = {c.name: c for c in run_preflight(base, cpu=True, echo=lambda line: None)}
    assert checks["callbacks"].ok and "StepCheckpoint" in checks["callbacks"].detail
    checks = {c.name: c for c in run_preflight([*base, "callbacks.validation.overlap=maybe"], cpu=True,
                                               echo=lambda line: None)}
    assert not checks["callbacks"].ok
    assert checks["callbacks"].detail.startswith("callbacks.validation.overlap='maybe': ValidationCallback takes bool")
    assert not any(tmp_path.iterdir())
