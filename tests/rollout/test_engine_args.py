"""The engine arguments are built once from the config (``rollout/engines/args.py``): the report's
runs get the report's engines, the server's flags are vLLM's own engine arguments (parsed back
by vLLM's CLI parser into what the in-process engine passes to ``vllm.LLM``), and the separate
layout's training ranks never put more requests in the server than it was sized for."""

from __future__ import annotations

import pytest

from atlas_lightning.config import compose
from atlas_lightning.rollout.engines.args import (
    MAX_NUM_SEQS,
    VLLM_GDN_PREFILL_KERNELS,
    EngineArgs,
    client_in_flight,
    lora_rank_slot,
    refusal_message,
    refused_arguments,
)


@pytest.mark.parametrize("run, tp, lora", [
    ("r28-continued-cost-8gpu-n32", 4, 64),                              # two TP4 engines, LoRA sync
    ("r28-continued-cost-8gpu-t49152-tp8-memory", 8, 64),                # one TP8 engine
    ("r28-base-cost-2gpu", 2, 64),
    ("r28-continued-cost-8gpu-t49152-n16-separate4-4-memory", 4, None),  # one TP4 server, merged weights
    ("r28-continued-cost-8gpu-t98304-separate6-2-memory", 2, None),
])
def test_the_report_runs_engines(run, tp, lora):
    args = EngineArgs.from_config(compose([f"experiment={run}"]))
    # 640 requests in flight an engine, the 27B's bf16, 32K tokens, sleeping between rollouts
    # where the engine shares the training cards
    assert (args.tensor_parallel_size, args.max_num_seqs, args.lora_rank) == (tp, 640, lora)
    assert (args.dtype, args.max_model_len, args.gpu_memory_utilization) == ("bfloat16", 32768, 0.55)
    assert args.enable_sleep_mode == ("separate" not in run) and args.model == "/models/Qwen3.6-27B"


def test_the_embedded_defaults_engine():
    args = EngineArgs.from_config(compose(["experiment=tiny-cpu", "model.path=/m"]))
    assert args == EngineArgs(model="/m", dtype="float32", max_model_len=2048, tensor_parallel_size=1, max_num_seqs=64,
                              seed=0, gpu_memory_utilization=0.6, enable_sleep_mode=False, enforce_eager=True,
                              cpu_kvcache_gib=1, lora_rank=8)
    assert EngineArgs.from_config(compose(["experiment=tiny-cpu", "rollout.weight_sync=merged"])).lora_rank is None
    assert EngineArgs.from_config(compose(["experiment=tiny-cpu", "rollout.max_in_flight=5000"])).max_num_seqs == 1024
    assert MAX_NUM_SEQS == 1024


def test_cpu_and_gpu_arguments():
    args = EngineArgs.from_config(compose(["experiment=r28-continued-cost-8gpu-n32"]))
    gpu = args.vllm_kwargs(on_cpu=False)
    assert (gpu["gpu_memory_utilization"], gpu["enable_sleep_mode"]) == (0.55, True)
    assert "enable_chunked_prefill" not in gpu
    assert (gpu["enable_lora"], gpu["max_lora_rank"], gpu["max_loras"]) == (True, 64, 1)
    cpu = args.vllm_kwargs(on_cpu=True)
    # seeded sampling with chunked prefill fails on CPU: whole prompts, a batch as long as a sequence
    assert (cpu["enable_chunked_prefill"], cpu["max_num_batched_tokens"]) == (False, 32768)
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu
    assert gpu["logprobs_mode"] == cpu["logprobs_mode"] == "processed_logprobs"
    assert [lora_rank_slot(r) for r in (1, 8, 9, 64, 65, 320)] == [1, 8, 16, 64, 128, 320]
    with pytest.raises(ValueError, match="LoRA rank 600"):
        lora_rank_slot(600)


def test_the_gdn_prefill_kernel_is_a_rollout_key(tmp_path, capsys):
    """``rollout.gdn_prefill_backend`` reaches vLLM as its ``gdn_prefill_backend`` engine argument:
    ``auto`` is Triton on GPUs (vLLM's own SM90 default, FlashInfer's JIT kernel, cannot be built
    from the device wheels) and left to vLLM on CPU; a named kernel goes as it is, on both; a value
    vLLM does not have is refused naming the key, by the config (exit 2) and by the arguments."""
    from atlas_lightning.cli import main
    from atlas_lightning.config import ConfigError
    from atlas_lightning.constraints import CONSTRAINTS

    args = EngineArgs.from_config(compose(["experiment=h200-8b"]))
    assert args.gdn_prefill_backend == "auto"
    assert args.vllm_kwargs(on_cpu=False)["gdn_prefill_backend"] == "triton"
    assert "gdn_prefill_backend" not in args.vllm_kwargs(on_cpu=True)
    for kernel in VLLM_GDN_PREFILL_KERNELS:
        named = EngineArgs.from_config(compose(["experiment=h200-8b", f"rollout.gdn_prefill_backend={kernel}"]))
        assert named.vllm_kwargs(on_cpu=False)["gdn_prefill_backend"] == kernel
        assert named.vllm_kwargs(on_cpu=True)["gdn_prefill_backend"] == kernel
    assert CONSTRAINTS["rollout.gdn_prefill_backend"].choices == ("auto", *VLLM_GDN_PREFILL_KERNELS)
    with pytest.raises(ConfigError, match=r"rollout.gdn_prefill_backend='fla': is not one of auto, triton"):
        compose(["experiment=tiny-cpu", "rollout.gdn_prefill_backend=fla"])
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", "rollout.gdn_prefill_backend=fla"]) == 2
    assert "rollout.gdn_prefill_backend" in capsys.readouterr().err and not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="rollout.gdn_prefill_backend='fla' is not one of"):
        EngineArgs(**{**args.__dict__, "gdn_prefill_backend": "fla"}).vllm_kwargs(on_cpu=False)


def test_the_hybrids_state_dtype_is_a_rollout_key(tmp_path, capsys):
    """``rollout.mamba_ssm_cache_dtype`` reaches a GPU engine as vLLM's ``mamba_ssm_cache_dtype``:
    float32 unless set (the trainer's state dtype), a named dtype as it is, ``auto`` not at all
    (vLLM reads the checkpoint's ``mamba_ssm_dtype``); a CPU engine is never given it; a dtype
    vLLM does not have is refused naming the key, before anything is written (exit 2)."""
    from atlas_lightning.cli import main
    from atlas_lightning.config import ConfigError

    args = EngineArgs.from_config(compose(["experiment=h200-8b"]))
    assert args.vllm_kwargs(on_cpu=False)["mamba_ssm_cache_dtype"] == "float32"
    assert "mamba_ssm_cache_dtype" not in args.vllm_kwargs(on_cpu=True)
    half = EngineArgs.from_config(compose(["experiment=h200-8b", "rollout.mamba_ssm_cache_dtype=bfloat16"]))
    assert half.vllm_kwargs(on_cpu=False)["mamba_ssm_cache_dtype"] == "bfloat16"
    auto = EngineArgs.from_config(compose(["experiment=h200-8b", "rollout.mamba_ssm_cache_dtype=auto"]))
    assert "mamba_ssm_cache_dtype" not in auto.vllm_kwargs(on_cpu=False)
    with pytest.raises(ConfigError, match=r"rollout.mamba_ssm_cache_dtype='fp32': is not one of auto, float32"):
        compose(["experiment=tiny-cpu", "rollout.mamba_ssm_cache_dtype=fp32"])
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", "rollout.mamba_ssm_cache_dtype=fp32"]) == 2
    assert "rollout.mamba_ssm_cache_dtype" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_the_head_dtype_is_one_key_for_the_trainer_and_every_engine(tmp_path, capsys):
    """``model.head_dtype`` reaches an engine, CPU or GPU, as vLLM's ``hf_overrides`` head dtype
    (nothing passed for ``model``, verl's numerics and the default) and the trainer as its
    ``float32_head`` (``tests/models/test_actor_critic_head.py``); a value neither has is refused
    naming the key, before anything is written."""
    from atlas_lightning.cli import main
    from atlas_lightning.config import ConfigError

    default = EngineArgs.from_config(compose(["experiment=h200-8b"]))
    assert default.head_dtype == "model"
    assert "hf_overrides" not in default.vllm_kwargs(on_cpu=False) and "hf_overrides" not in default.vllm_kwargs(on_cpu=True)
    cfg = compose(["experiment=h200-8b", "model.head_dtype=float32"])
    wide = EngineArgs.from_config(cfg)
    for on_cpu in (True, False):
        assert wide.vllm_kwargs(on_cpu=on_cpu)["hf_overrides"] == {"head_dtype": "float32"}
    with pytest.raises(ConfigError, match=r"model.head_dtype='bfloat16': is not one of model, float32"):
        compose(["experiment=tiny-cpu", "model.head_dtype=bfloat16"])
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", "model.head_dtype=fp32"]) == 2
    assert "model.head_dtype" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_an_engine_that_rounds_its_logits_otherwise_is_named():
    """``head_dtype_problem``: None when the engine's logits dtype is the one asked for (``model``:
    the model's dtype), else a message naming the key, what the engine holds and what was asked."""
    from types import SimpleNamespace

    import torch

    from atlas_lightning.rollout.engines.vllm_engine import head_dtype_problem

    def engine(head):
        return SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16, head_dtype=head))

    assert head_dtype_problem(engine(torch.float32), "float32") is None
    assert head_dtype_problem(engine(torch.bfloat16), "model") is None
    fell_back = head_dtype_problem(engine(torch.bfloat16), "float32")
    assert "model.head_dtype=float32" in fell_back and "torch.bfloat16" in fell_back and "not float32" in fell_back
    assert "not bfloat16" in head_dtype_problem(engine(torch.float32), "model")
    assert "the model dtype" in head_dtype_problem(SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)), "float32")


def test_the_production_shape_says_its_state_dtype_as_its_checkpoints_do():
    """The Qwen3.6-27B shape's folders carry ``mamba_ssm_dtype: float32`` in their text config,
    as the published checkpoints do (vLLM reads it when the key is ``auto``)."""
    from atlas_lightning.bench.shapes import checkpoint_config, shape_by_name

    assert checkpoint_config(shape_by_name("qwen3_6_27b"), 4).to_dict()["text_config"]["mamba_ssm_dtype"] == "float32"


def test_the_engines_lora_rank_is_the_shape_the_run_resolved():
    """The engines' LoRA slot is sized from the actor's shape as the run's start-up resolved it
    (``RunFacts.lora``, handed down), not read again: a shape handed in wins over ``model.lora``
    (its largest per-module rank included); without one the same resolution runs from the config."""
    from atlas_lightning.store.lora_shapes import LoraShape, lora_shapes_or_config

    cfg = compose(["experiment=tiny-cpu", "model.path=/m", "model.lora.rank=8"])
    handed = LoraShape(rank=4, alpha=12.0, rank_pattern={"q_proj": 24}, source="adapter_config.json")
    args = EngineArgs.from_config(cfg, handed)
    assert args.lora_rank == 24 and args.vllm_kwargs(on_cpu=True)["max_lora_rank"] == 32
    assert EngineArgs.from_config(cfg).lora_rank == lora_shapes_or_config(cfg)[0]["actor"].max_rank == 8
    merged = compose(["experiment=tiny-cpu", "model.path=/m", "rollout.weight_sync=merged"])
    assert EngineArgs.from_config(merged, handed).lora_rank is None


def test_engines_serve_the_language_model_only():
    """The agent sends text alone: vLLM builds no vision tower of an image-text checkpoint
    (Qwen3.5/3.6) and needs no image processor; attention-only models ignore the argument."""
    args = EngineArgs.from_config(compose(["experiment=tiny-cpu", "model.path=/m"]))
    assert args.vllm_kwargs(on_cpu=True)["language_model_only"] is True
    assert args.vllm_kwargs(on_cpu=False)["language_model_only"] is True


@pytest.mark.parametrize("overrides, ranks, each", [
    (["experiment=r28-continued-cost-8gpu-n32"], 8, 640),                              # each engine its own
    (["experiment=r28-continued-cost-8gpu-t49152-n16-separate4-4-memory"], 4, 160),    # one server, 4 clients
    (["experiment=r28-continued-cost-8gpu-t98304-separate6-2-memory"], 6, 106),
    (["experiment=tiny-cpu", "layout=separate_cpu", "rollout=vllm_server_cpu", "rollout.max_in_flight=3",
      "layout.gpus=5", "layout.train_gpus=4"], 4, 1),                                  # never 0
])
def test_requests_in_flight_a_training_rank(overrides, ranks, each):
    cfg = compose(overrides)
    assert client_in_flight(cfg, ranks) == each
    if cfg.layout.mode == "separate" and each > 1:
        assert ranks * each <= EngineArgs.from_config(cfg).max_num_seqs  # the server holds them all at once


@pytest.mark.vllm
@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu", "gpu"])
@pytest.mark.parametrize("lora_rank", [8, None], ids=["lora", "merged"])
@pytest.mark.parametrize("head_dtype", ["model", "float32"])
def test_server_flags_are_the_in_process_engines_arguments(on_cpu, lora_rank, head_dtype):
    """``vllm serve``'s own parser turns the server's flags into vLLM's engine arguments: each
    equals what ``VLLMEngine`` passes to ``vllm.LLM`` (as the server's entry point parses them)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from atlas_lightning.rollout.engines.server_process import engine_flags

    args = EngineArgs(model="/models/m", dtype="float32", max_model_len=3072, tensor_parallel_size=2, max_num_seqs=48,
                      seed=7, gpu_memory_utilization=0.45, enable_sleep_mode=False, enforce_eager=True,
                      cpu_kvcache_gib=1, lora_rank=lora_rank, head_dtype=head_dtype)
    parsed = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(
        engine_flags(args, on_cpu=on_cpu)))
    wanted = args.vllm_kwargs(on_cpu=on_cpu)
    assert {name: getattr(parsed, name) for name in wanted} == wanted
    assert bool(parsed.enable_lora) == (lora_rank is not None)  # vLLM's default is None


#: vLLM 0.26's refusal on an H100 (the 32-layer hybrid, rollout.gpu_memory_utilization=0.45), verbatim
MAMBA_REFUSAL = ("max_num_seqs (256) exceeds available Mamba cache blocks (158). Each decode sequence requires one "
                 "Mamba cache block, so CUDA graph capture cannot proceed. Please lower max_num_seqs to at most 158 "
                 "or increase gpu_memory_utilization.")


def test_an_engine_refusal_is_named_in_the_configs_keys():
    kwargs = EngineArgs.from_config(compose(["experiment=h200-8b", "rollout.gpu_memory_utilization=0.45"])
                                    ).vllm_kwargs(on_cpu=False)
    assert refused_arguments(MAMBA_REFUSAL, kwargs) == [
        "rollout.max_in_flight (vLLM's max_num_seqs=256)", "rollout.gpu_memory_utilization (vLLM's gpu_memory_utilization=0.45)"]
    # a word of vLLM's, not a part of another name: mamba_ssm_cache_dtype does not name dtype
    assert refused_arguments("mamba_ssm_cache_dtype='float16' is not supported", kwargs) == [
        "rollout.mamba_ssm_cache_dtype (vLLM's mamba_ssm_cache_dtype='float32')"]
    assert refused_arguments("the model's architecture is not supported", kwargs) == []


def test_a_servers_log_is_read_for_its_last_refusal():
    """A server's log names arguments on its command line too; only a line reporting an error is a refusal."""
    kwargs = EngineArgs.from_config(compose(["experiment=h200-8b"])).vllm_kwargs(on_cpu=False)
    log = "\n".join(["$ python -m vllm... --dtype bfloat16 --max-num-seqs 256", "INFO loading the model",
                     f"[rank0]: ValueError: {MAMBA_REFUSAL}", "[rank0]: the process exits"])
    assert refusal_message(log, kwargs).startswith(
        "the rollout engine refused rollout.max_in_flight (vLLM's max_num_seqs=256); rollout.gpu_memory_utilization")
    assert refusal_message("$ python -m vllm --dtype bfloat16\nFatal Python error: init_fs_encoding", kwargs) is None
