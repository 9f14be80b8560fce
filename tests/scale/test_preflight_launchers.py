"""Every ``launch/<run>.sh``: its pre-flight (plan + checks) passes on CPU for its real config
with the tiny model swapped in (the asynchronous separate layouts included: three launchers run
through the shell, every experiment's plan and pre-flight in-process); and a
broken config (unknown key, missing data, an adapter of another rank or base) is caught there,
in seconds, naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm
from atlas_lightning.run.preflight import main as preflight_main
from atlas_lightning.run.preflight import run_preflight

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
SEPARATE = {"r28-continued-cost-8gpu-t49152-n16-separate4-4-memory", "r28-continued-cost-8gpu-t98304-separate6-2-memory"}


@pytest.fixture(scope="module")
def tiny8(tiny_model_dir, tmp_path_factory):
    """The tiny model's tokenizer with a base of 8 attention heads (2 KV heads), so that every
    engine layout of the report (TP2, TP4, TP8) divides its heads as vLLM requires."""
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    folder = save_tiny_causal_lm(tmp_path_factory.mktemp("tiny8") / "model", hidden_size=128, intermediate_size=256,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tiny_model_dir) / name).is_file():
            shutil.copy(Path(tiny_model_dir) / name, folder / name)
    # it stands in for the production models: their context (Qwen3.6-27B's 262,144 positions), so
    # that the runs' rollout.max_model_len fits it as it fits them (models/serving_files.py)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**fields, "max_position_embeddings": 262144}))
    return folder


def _save_adapters(base, step_dir: Path, rank: int, alpha: int, critic: dict | None = None) -> Path:
    from tests.model_builds import actor_critic
    from atlas_lightning.models.adapters import save_adapter

    model = actor_critic(str(base), {"rank": rank, "alpha": alpha}, critic_lora=critic)
    for role in ("actor", "critic"):
        save_adapter(model, role, step_dir / role / "lora_adapter")
    return step_dir


@pytest.fixture(scope="module")
def step29(tiny8, tmp_path_factory):
    """A ``global_step_29`` with r64/alpha-128 adapters (the production LoRA) on the tiny base."""
    return _save_adapters(tiny8, tmp_path_factory.mktemp("r25") / "global_step_29", rank=64, alpha=128)


def test_there_is_one_launcher_per_experiment_and_a_slurm_template():
    assert EXPERIMENTS and sorted(p.stem for p in LAUNCH.glob("*.sh") if p.name != "common.sh") == EXPERIMENTS
    assert all(os.access(LAUNCH / f"{run}.sh", os.X_OK) for run in EXPERIMENTS)
    assert (LAUNCH / "slurm.sbatch").is_file()


#: The launchers run through the shell in full: one of each kind (CPU; the separate layout; a GPU
#: run continued from adapters, given as launcher variables: ``test_launcher_variables_become_overrides``,
#: one launch fewer: each runs two Python processes, ~11 CPU-s). The others differ from these only
#: in their last line, which ``test_every_launcher_runs_its_own_experiment`` checks, and their
#: configs pass the same plan and pre-flight in-process (``test_every_experiment_plans_and_passes_preflight_on_cpu``).
LAUNCHED = ("tiny-cpu", "r28-continued-cost-8gpu-t98304-separate6-2-memory")


def _tiny_inputs(run, tiny8, tiny_model_dir, sample_data_dir, step29) -> list[str]:
    model = tiny_model_dir if run == "tiny-cpu" else tiny8
    args = [f"model.path={model}", f"data.root={sample_data_dir}"]
    if run == "r28-continued-cost-8gpu-n32":
        args.append(f"trainer.init_from={step29}")
    return args


@pytest.mark.parametrize("run", EXPERIMENTS)
def test_every_launcher_runs_its_own_experiment(run):
    """Its last line launches the experiment of its own name, asking for the GPUs of its layout
    (none for a CPU run); bash parses it."""
    from omegaconf import OmegaConf

    from atlas_lightning.config import compose

    script = LAUNCH / f"{run}.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    cfg = compose([f"experiment={run}"])
    gpus = 0 if OmegaConf.select(cfg, "trainer.accelerator") == "cpu" else int(cfg.layout.gpus)
    verb = "memory-check" if run.endswith("-memory") else "fit"
    last = script.read_text().strip().splitlines()[-1]
    assert last == f'ATLAS_GPUS_WANTED={gpus} atlas_launch {run} {verb} "$@"'


@pytest.mark.parametrize("run", EXPERIMENTS)
def test_every_experiment_plans_and_passes_preflight_on_cpu(run, tiny8, tiny_model_dir, sample_data_dir, step29,
                                                            tmp_path, capsys):
    """What each launcher runs before starting anything (the plan, then the pre-flight with
    ``--cpu-preflight``), in-process, on its real config with the tiny model swapped in."""
    from atlas_lightning.planning.cli import main as plan_main

    args = [f"experiment={run}", f"paths.root={tmp_path}",
            *_tiny_inputs(run, tiny8, tiny_model_dir, sample_data_dir, step29)]
    assert plan_main(args) == 0, capsys.readouterr()
    assert (tmp_path / "outputs" / run / "plan.json").is_file()
    if run in SEPARATE:
        assert "receive_weights" in capsys.readouterr().out  # the serving cards' bucket phase is planned
    failed = {c.name: c.detail for c in run_preflight(args, cpu=True, echo=lambda line: None) if not c.ok}
    assert failed == {}


@pytest.mark.e2e  # one launcher through its pre-flight in make test: test_launcher_variables_become_overrides
@pytest.mark.parametrize("run", LAUNCHED)
def test_launcher_preflight_on_cpu_with_the_tiny_model(run, tiny8, tiny_model_dir, sample_data_dir, step29, tmp_path):
    args = _tiny_inputs(run, tiny8, tiny_model_dir, sample_data_dir, step29)
    env = {**os.environ, "ATLAS_PREFLIGHT_ONLY": "1", "ATLAS_CPU_PREFLIGHT": "1", "ATLAS_ROOT": str(tmp_path),
           "ATLAS_PYTHON": str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").is_dir() else "python3"}
    result = subprocess.run(["bash", str(LAUNCH / f"{run}.sh"), *args], env=env, capture_output=True, text=True,
                            timeout=120)
    out = result.stdout + result.stderr
    logs = list((tmp_path / "logs").glob(f"{run}-*.log"))
    assert len(logs) == 1 and "== plan" in logs[0].read_text()  # everything went to logs/ too
    # every run passes its pre-flight, the asynchronous separate layouts included
    assert result.returncode == 0, out[-3000:]
    assert "pre-flight passed" in out and "ATLAS_PREFLIGHT_ONLY set" in out
    if run != "tiny-cpu":
        assert "GPU count NOT checked" in out  # the relaxation says so
    if run in SEPARATE:
        assert "receive_weights" in out  # the serving cards' bucket phase is planned
    assert (tmp_path / "outputs" / run / "plan.json").is_file()


def test_launcher_variables_become_overrides(tiny8, sample_data_dir, step29, tmp_path):
    """The training of record's launcher with its inputs and the card size given as launcher
    variables (no overrides): they reach the plan, the pre-flight and the run as overrides."""
    env = {**os.environ, "ATLAS_PREFLIGHT_ONLY": "1", "ATLAS_CPU_PREFLIGHT": "1", "ATLAS_ROOT": str(tmp_path),
           "ATLAS_BASE_MODEL": str(tiny8), "ATLAS_DATA_ROOT": str(sample_data_dir), "ATLAS_INIT_FROM": str(step29),
           "ATLAS_CARD_GIB": "139",
           "ATLAS_PYTHON": str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").is_dir() else "python3"}
    result = subprocess.run(["bash", str(LAUNCH / "r28-continued-cost-8gpu-n32.sh")], env=env, capture_output=True,
                            text=True, timeout=120)
    out = result.stdout + result.stderr
    logs = list((tmp_path / "logs").glob("r28-continued-cost-8gpu-n32-*.log"))
    assert len(logs) == 1 and "== plan" in logs[0].read_text()  # everything went to logs/ too
    assert result.returncode == 0, out[-3000:]
    assert "pre-flight passed" in out and "ATLAS_PREFLIGHT_ONLY set" in out
    assert (f"overrides: experiment=r28-continued-cost-8gpu-n32 paths.root={tmp_path} plan.card_gib=139 "
            f"model.path={tiny8} data.root={sample_data_dir} trainer.init_from={step29}") in out
    assert "GPU count NOT checked" in out  # --cpu-preflight
    assert "actor " in out and "critic " in out and "r64" in out  # the shapes of step29's adapters
    plan = json.loads((tmp_path / "outputs" / "r28-continued-cost-8gpu-n32" / "plan.json").read_text())
    assert plan["card_gib"] == 139


def _gpu_run(tiny8, sample_data_dir, tmp_path, *extra):
    return ["experiment=r28-continued-cost-8gpu-n32", f"model.path={tiny8}", f"data.root={sample_data_dir}",
            f"paths.root={tmp_path}", *extra]


def _failures(overrides, capsys) -> dict[str, str]:
    results = run_preflight(overrides, cpu=True, echo=lambda line: None)
    return {c.name: c.detail for c in results if not c.ok}


def test_broken_configs_are_caught_and_named(tiny8, sample_data_dir, step29, tmp_path, capsys):
    good = _gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={step29}")
    assert _failures(good, capsys) == {}

    bad_key = _failures(good + ["model.lora.rnak=8"], capsys)
    assert list(bad_key) == ["config"] and "rnak" in bad_key["config"]

    missing = tmp_path / "no-data"
    no_data = _failures(_gpu_run(tiny8, missing, tmp_path, f"trainer.init_from={step29}"), capsys)
    assert list(no_data) == ["data"] and str(missing) in no_data["data"]

    no_model = _failures(_gpu_run(tmp_path / "no-model", sample_data_dir, tmp_path), capsys)
    assert "model" in no_model and "no-model: no such folder" in no_model["model"]

    # the starting adapters bring their own shape: model.lora does not have to agree
    assert _failures(good + ["model.lora.rank=32"], capsys) == {}
    assert _failures(good + ["model.lora.target_modules=[q_proj,v_proj]"], capsys) == {}

    no_step = _failures(_gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={tmp_path}/nowhere"), capsys)
    assert list(no_step) == ["adapters"] and "nowhere" in no_step["adapters"]

    refused = _failures(good + ["algorithm.ppo_max_token_len_per_gpu=16384"], capsys)
    assert list(refused) == ["plan"] and "ppo_max_token_len_per_gpu=16,384" in refused["plan"]


def _details(overrides) -> dict[str, str]:
    return {c.name: c.detail for c in run_preflight(overrides, cpu=True, echo=lambda line: None)}


def test_preflight_prints_the_shapes_each_adapter_trains(tiny8, sample_data_dir, tmp_path):
    """A critic of another rank and targets than the actor, both unlike model.lora: pre-flight
    passes, prints each folder's shape and says the config's is not what trains; the plan
    sizes the critic's LoRA states from its folder."""
    critic = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    step = _save_adapters(tiny8, tmp_path / "r25" / "global_step_29", rank=64, alpha=128, critic=critic)
    details = _details(_gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={step}", "model.lora.rank=32"))
    line = details["adapters"]
    assert "actor " in line and "r64 alpha 128, down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj" in line
    assert "critic " in line and "r16 alpha 32, q_proj,v_proj" in line and "value head" not in line
    assert line.count("the folder's shape; model.lora says r32 alpha 128, all-linear") == 2

    from atlas_lightning.config import compose
    from atlas_lightning.planning import make_plan

    cfg = compose(_gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={step}", "model.lora.rank=32"))
    plan = make_plan(cfg)
    hidden, layers = 128, 2
    kv = 2 * 16  # two KV heads of 16
    assert plan.model["lora_params"]["critic"] == layers * 16 * ((hidden + 8 * 16) + (hidden + kv))
    assert plan.model["lora_params"]["actor"] > 10 * plan.model["lora_params"]["critic"]
    assert "r16 alpha 32, q_proj,v_proj" in plan.model["lora"]["critic"]

    fresh = _details(_gpu_run(tiny8, sample_data_dir, tmp_path, "trainer.init_from=null",
                              "model.critic_lora={rank:8,target_modules:[q_proj]}"))
    assert fresh["adapters"] == ("actor fresh: r64 alpha 128, all-linear (model.lora); "
                                 "critic fresh: r8 alpha 128, q_proj (model.critic_lora)")


def test_an_adapter_whose_tensors_disagree_with_its_config_is_caught(tiny8, sample_data_dir, tmp_path):
    step = _save_adapters(tiny8, tmp_path / "r25" / "global_step_29", rank=64, alpha=128)
    config = step / "critic" / "lora_adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 64', '"r": 32'))
    details = _details(_gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={step}"))
    assert "folder's r=32 imply" in details["adapters"] and "trainer.init_from" in details["adapters"]


def test_an_adapter_of_another_base_is_caught(tiny8, tiny_model_dir, sample_data_dir, tmp_path, capsys):
    """Adapters trained on the other tiny base (hidden 128, other heads): caught from the
    safetensors header and atlas_base.json, without loading any weights."""
    step = _save_adapters(tiny_model_dir, tmp_path / "elsewhere" / "global_step_3", rank=64, alpha=128)
    failures = _failures(_gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={step}"), capsys)
    assert list(failures) == ["adapters"]
    assert "different base" in failures["adapters"] or "imply" in failures["adapters"]


def test_preflight_main_exit_code_and_gpu_count(tiny8, sample_data_dir, step29, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATLAS_CPU_PREFLIGHT", "1")  # a launcher variable: the pre-flight itself never reads it
    args = _gpu_run(tiny8, sample_data_dir, tmp_path, f"trainer.init_from={step29}")
    assert preflight_main(args) == 2  # no 8 GPUs here, and the check is not relaxed
    out = capsys.readouterr().out
    assert "trainer.accelerator=gpu with trainer.devices=8: this machine has no CUDA GPU" in out
    assert "pre-flight FAILED: environment" in out
    assert preflight_main(["--cpu-preflight", *args]) == 0
    assert "pre-flight passed" in capsys.readouterr().out


@pytest.mark.parametrize("damage, message", [
    ("tensor_with_no_place", "has no place for (model.layers.9.mlp.down_proj.weight)"),
    ("chat_template_without_tools", "its chat template does not render the tools passed as tools="),
    ("nan_adapter", "non-finite value(s) of 2048 (NaN or inf)"),
])
def test_what_fit_refuses_of_the_model_and_adapters_preflight_refuses(damage, message, tiny8, sample_data_dir,
                                                                      tmp_path):
    """Pre-flight's model and adapter checks are ``fit``'s start-up checks: the weights against the
    architecture, the chat template, the starting adapters' tensors."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny8, model)
    step = _save_adapters(tiny8, tmp_path / "r25" / "global_step_29", rank=8, alpha=16)
    if damage == "tensor_with_no_place":
        tensors = load_file(model / "model.safetensors")
        tensors["model.layers.9.mlp.down_proj.weight"] = torch.zeros(4, 4)
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    elif damage == "chat_template_without_tools":
        (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    else:
        weights = step / "actor" / "lora_adapter" / "adapter_model.safetensors"
        tensors = load_file(weights)
        first = sorted(tensors)[0]
        tensors[first] = torch.full_like(tensors[first], float("nan"))
        save_file(tensors, weights)
    details = {c.name: (c.ok, c.detail) for c in run_preflight(
        _gpu_run(model, sample_data_dir, tmp_path, f"trainer.init_from={step}"), cpu=True, echo=lambda line: None)}
    failed = {name: detail for name, (ok, detail) in details.items() if not ok}
    assert list(failed) == (["adapters"] if damage == "nan_adapter" else ["model"]), failed
    assert message in next(iter(failed.values()))
