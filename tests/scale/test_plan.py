"""``plan``: shapes read from config.json agree with transformers; the estimate reproduces the
measurements it was calibrated on and the report's budgets; impossible layouts are refused,
each with its reason, and the verb exits 2 on a refusal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from atlas_lightning.cli import main as cli_main
from atlas_lightning.config import ConfigError, compose
from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm
from atlas_lightning.planning import GIB, ShapeError, estimate, make_plan, read_model_shape, shape_from_config
from atlas_lightning.planning.checks import MERGED_WEIGHTS_TEST, SEPARATE_LAYOUT_TEST, layout_refusals

from .conftest import DENSE_8B, QWEN3_6_27B_TEXT

REPO = Path(__file__).resolve().parents[2]


def _meta_model(config: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        if config["model_type"] == "qwen3":
            return Qwen3ForCausalLM(Qwen3Config(**fields))
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))


def _lora_params(model, rank: int) -> int:
    return sum(rank * (m.in_features + m.out_features) for m in model.model.layers.modules()
               if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("config", [DENSE_8B, QWEN3_6_27B_TEXT], ids=["dense8b", "qwen3_6_27b"])
def test_shape_counts_equal_a_transformers_model(config):
    model = _meta_model(config)
    shape = shape_from_config(config)
    assert shape.base_params == sum(p.numel() for p in model.parameters())
    assert shape.lora_params(64) == _lora_params(model, 64)
    assert shape.largest_layer_params == max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)


@pytest.mark.parametrize("arch, tied", [("qwen3", False), ("qwen3", True), ("qwen3_5", False)])
def test_shape_of_a_saved_folder_equals_what_loads(arch, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_causal_lm(tmp_path / arch, arch=arch, tie_word_embeddings=tied, hidden_size=72)
    shape = read_model_shape(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    unique = {id(p): p.numel() for p in loaded.parameters()}
    assert shape.base_params == sum(unique.values())
    assert shape.lora_params(4) == _lora_params(loaded, 4)
    assert shape.recurrent == (arch == "qwen3_5")


def test_27b_adapter_size_is_the_reports_actor_adapter(qwen27b_dir):
    """ATLAS report 28's (the reproduced report's) actor adapter (LoRA r64, all linear, fp32) is 1,867,797,544 bytes: the
    tensors plus a safetensors header of ~150 KB."""
    tensors = read_model_shape(qwen27b_dir).lora_params(64) * 4
    assert 0 < 1_867_797_544 - tensors < 300_000


_DTYPE_BYTES = {"F32": 4, "BF16": 2}


def _safetensors_bytes(entries: list[tuple[str, tuple, str]], metadata: dict | None = None) -> int:
    """The size of a ``.safetensors`` file of ``(name, shape, dtype)`` tensors, without writing
    it: 8 bytes of header length, the JSON header (``__metadata__`` first, then the tensors
    ordered by dtype size, largest first, then name, each with its ``data_offsets``), padded with
    spaces to a multiple of 8, then the data. Checked against ``safetensors`` itself below."""
    ordered = sorted(entries, key=lambda e: (-_DTYPE_BYTES[e[2]], e[0]))
    parts = [f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}'] if metadata else []
    offset = 0
    for name, shape, dtype in ordered:
        size = _DTYPE_BYTES[dtype] * math.prod(shape)
        parts.append(f'{json.dumps(name)}:{{"dtype":"{dtype}","shape":{json.dumps(list(shape), separators=(",", ":"))},'
                     f'"data_offsets":[{offset},{offset + size}]}}')
        offset += size
    header = len(("{" + ",".join(parts) + "}").encode())
    return 8 + header + (-header) % 8 + offset


def _lora_entries(shape, rank: int, targets, prefix: str = "base_model.model.model.language_model.") -> list:
    """PEFT's fp32 LoRA tensors of one adapter on ``shape``, named as a Qwen3.6 checkpoint (VLM) names them."""
    entries = []
    for index, kind in enumerate(shape.layer_types):
        block = "linear_attn" if kind == "linear_attention" else "self_attn"
        for lin in shape.adapted_linears(kind, targets):
            module = f"{prefix}layers.{index}.{'mlp' if lin.name.endswith(('gate_proj', 'up_proj', 'down_proj')) else block}.{lin.name}"
            entries += [(f"{module}.lora_A.weight", (rank, lin.in_features), "F32"),
                        (f"{module}.lora_B.weight", (lin.out_features, rank), "F32")]
    return entries


def test_the_safetensors_size_formula_is_safetensors_own(tmp_path):
    import torch
    from safetensors.torch import save_file

    entries = [("b.lora_A.weight", (3, 5), "F32"), ("a.x.lora_B.weight", (7, 3), "F32"), ("score.bias", (1,), "BF16"),
               ("score.weight", (1, 9), "BF16")]
    path = tmp_path / "x.safetensors"
    save_file({n: torch.zeros(s, dtype=torch.float32 if d == "F32" else torch.bfloat16) for n, s, d in entries},
              str(path), metadata={"format": "pt"})
    assert path.stat().st_size == _safetensors_bytes(entries, {"format": "pt"})


def test_27b_adapter_sizes_are_the_reports_byte_for_byte(qwen27b_dir):
    """Report 28's starting adapters, from their byte counts alone (README, "The runs of report
    28"): the actor is LoRA r64 on every linear (1,867,797,544 bytes); the critic is LoRA r64 on
    q_proj, k_proj, v_proj, o_proj (the 16 full-attention layers) and gate/up/down_proj (all 64
    layers), the linear-attention mixers untouched, plus a bf16 value head (weight (1, 5120) and
    bias (1,)) saved as a modules_to_save module: 1,275,155,586 bytes, 318,767,104 LoRA
    parameters. Both fp32, in the VLM checkpoint's tensor names."""
    shape = read_model_shape(qwen27b_dir)
    meta = {"format": "pt"}
    assert _safetensors_bytes(_lora_entries(shape, 64, "all-linear"), meta) == 1_867_797_544
    critic_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    head = [("base_model.model.score.weight", (1, shape.hidden_size), "BF16"), ("base_model.model.score.bias", (1,), "BF16")]
    assert _safetensors_bytes(_lora_entries(shape, 64, critic_targets) + head, meta) == 1_275_155_586
    assert shape.lora_params(64, critic_targets) == 318_767_104
    # the same LoRA without the 2-byte-odd head cannot reach that size: its data is a multiple of 4
    assert _safetensors_bytes(_lora_entries(shape, 64, critic_targets), meta) % 8 == 0 != 1_275_155_586 % 8


def test_unknown_family_and_missing_folder_are_named(tmp_path):
    with pytest.raises(ShapeError, match="model_type='gpt2'"):
        shape_from_config({"model_type": "gpt2", "hidden_size": 8}, "x/config.json")
    with pytest.raises(ShapeError, match="num_hidden_layers"):
        shape_from_config({**DENSE_8B, "num_hidden_layers": 0})
    with pytest.raises(ShapeError, match="no config.json"):
        read_model_shape(tmp_path)


def _cfg(run: str, model_dir, tmp_path, *extra: str):
    return compose([f"experiment={run}", f"model.path={model_dir}", f"data.root={tmp_path}", f"paths.root={tmp_path}",
                    *extra])


def test_logprob_term_reproduces_the_h200_measurement(qwen27b_dir, tmp_path):
    """models/logprobs.py measured on an H200 (hidden 5120, vocabulary 248,320, 49,152 tokens):
    2.8 GiB with 1,024-token chunks, 11.4 GiB with 4,096 (the grad of the hidden states aside)."""
    shape = read_model_shape(qwen27b_dir)
    terms = {}
    for chunk in (1024, 4096):
        cfg = _cfg("r28-continued-cost-8gpu-t49152-memory", qwen27b_dir, tmp_path, f"model.logprob_chunk_tokens={chunk}")
        term = estimate(shape, cfg).phase("update_actor").sequential["log-prob chunks"]
        terms[chunk] = (term - 49152 * 5120 * 2) / GIB
    assert terms[1024] == pytest.approx(2.8, rel=0.05)
    assert terms[4096] == pytest.approx(11.4, rel=0.05)


def test_report_budgets_on_80gb_cards(qwen27b_dir, tmp_path):
    """Report 28: 49,152 tokens a card fit on 8 A100 80GB with the 27B; 73,728 ran out of memory."""
    fits = make_plan(_cfg("r28-continued-cost-8gpu-t49152-memory", qwen27b_dir, tmp_path), card_gib=80, linear_kernel="fla")
    assert fits.ok, fits.refusals
    assert 49152 <= fits.max_update_tokens < 73728
    oom = make_plan(_cfg("r28-continued-cost-8gpu-t73728-memory", qwen27b_dir, tmp_path), card_gib=80, linear_kernel="fla")
    assert not oom.ok
    assert any(r.startswith("update_actor") and "ppo_max_token_len_per_gpu=73,728" in r for r in oom.refusals)
    assert oom.max_update_tokens == fits.max_update_tokens
    # An H200 holds it; transformers' fallback kernels (no flash-linear-attention) need far more.
    assert make_plan(_cfg("r28-continued-cost-8gpu-t73728-memory", qwen27b_dir, tmp_path), card_gib=139,
                     linear_kernel="fla").ok
    torch_path = make_plan(_cfg("r28-continued-cost-8gpu-t49152-memory", qwen27b_dir, tmp_path), card_gib=80,
                           linear_kernel="torch")
    assert torch_path.phase("update_actor").tensors > 1.2 * fits.phase("update_actor").tensors


def test_linear_kernel_is_the_config_key(qwen27b_dir, tmp_path):
    """The plan reads model.linear_attention_kernel (no environment variable): fla and torch as
    given; auto is planned for the target, whatever this machine has installed: fla on GPUs, torch
    on a CPU run, and the plan says which it assumed."""
    run = "r28-continued-cost-8gpu-t49152-memory"
    for kernel in ("fla", "torch"):
        plan = make_plan(_cfg(run, qwen27b_dir, tmp_path, f"model.linear_attention_kernel={kernel}"), card_gib=80)
        assert plan.model["linear_attention_kernel"] == kernel
        assert any(note.startswith(f"assumed linear-attention kernel: {kernel} ") for note in plan.notes)
    auto = make_plan(_cfg(run, qwen27b_dir, tmp_path), card_gib=80)
    assert auto.model["linear_attention_kernel"] == "fla" and auto.ok  # the training of record fits 80 GiB
    assert any("fla (model.linear_attention_kernel=auto on CUDA" in note for note in auto.notes)
    on_cpu = make_plan(_cfg(run, qwen27b_dir, tmp_path, "trainer.accelerator=cpu"), card_gib=80)
    assert on_cpu.model["linear_attention_kernel"] == "torch"


def test_a_run_is_planned_from_its_named_shape_before_the_weights_are_fetched(qwen27b_dir, tmp_path):
    """model.shape stands in for a model.path that is not there yet, and plans as its config.json does."""
    run = "r28-continued-cost-8gpu-t49152-memory"
    from_folder = make_plan(_cfg(run, qwen27b_dir, tmp_path), card_gib=80)
    named = make_plan(_cfg(run, qwen27b_dir, tmp_path, f"model.path={tmp_path}/not-fetched", "model.shape=qwen3_6_27b"),
                      card_gib=80)
    assert named.phase("update_actor").tensors == pytest.approx(from_folder.phase("update_actor").tensors, rel=1e-3)
    assert any("shape from model.shape=qwen3_6_27b" in note for note in named.notes)
    with pytest.raises(ShapeError, match="model.shape=qwen3_6_27b"):
        make_plan(_cfg(run, qwen27b_dir, tmp_path, f"model.path={tmp_path}/not-fetched", "model.shape=null"))
    with pytest.raises(ShapeError, match="'nope' is not a known shape"):
        make_plan(_cfg(run, qwen27b_dir, tmp_path, f"model.path={tmp_path}/not-fetched", "model.shape=nope"))
    with pytest.raises(ConfigError, match="model.linear_attention_kernel"):
        _cfg(run, qwen27b_dir, tmp_path, "model.linear_attention_kernel=cuda")


@pytest.mark.parametrize("run, train, card", [("r28-continued-cost-8gpu-t98304-separate6-2-memory", 6, 139),
                                              ("r28-continued-cost-8gpu-t49152-n16-separate4-4-memory", 4, 80)])
def test_separate_layouts_pass_with_the_buckets_accounted(run, train, card, qwen27b_dir, tmp_path):
    """The layouts run (tests/e2e/test_separate_layout.py on CPU; merged weights exact at FSDP2
    world sizes 4 and 6): ``plan`` refuses them only for memory. 98,304 tokens a card need an
    H200, as the colocated 73,728 do."""
    cfg = _cfg(run, qwen27b_dir, tmp_path)
    plan = make_plan(cfg, card_gib=card, linear_kernel="fla")
    assert plan.ok, plan.refusals
    on_80 = make_plan(cfg, card_gib=80, linear_kernel="fla")
    assert all(r.startswith(("update_actor", "update_critic")) for r in on_80.refusals), on_80.refusals
    assert plan.model["world_size"] == train
    assert (REPO / MERGED_WEIGHTS_TEST).is_file() and (REPO / SEPARATE_LAYOUT_TEST).is_file()
    # rollout.bucket_mb=512, but the 27B's embedding (2.4 GiB in bf16) travels alone, whole
    largest = read_model_shape(qwen27b_dir).largest_tensor_params * 2
    bucket = max(512 * 2**20, largest)
    assert bucket > 512 * 2**20
    sync = plan.phase("update_weights")
    assert sync.cards == "training cards" and sync.terms["merged bucket"] == bucket
    assert sync.terms["send buffers (2 x bucket, rank 0)"] == 2 * bucket
    receive = plan.phase("receive_weights")
    assert receive.cards == "serving cards"
    assert receive.terms["receive buffers (2 x bucket)"] == 2 * bucket
    assert receive.overhead["engine (gpu_memory_utilization x card)"] == pytest.approx(
        cfg.rollout.gpu_memory_utilization * card * GIB)
    assert plan.phase("generation").cards == "serving cards"
    # buckets too large for the room the engine leaves on its cards: refused with the reason
    huge = make_plan(_cfg(run, qwen27b_dir, tmp_path, "rollout.bucket_mb=20000", "rollout.gpu_memory_utilization=0.9"),
                     card_gib=card, linear_kernel="fla")
    assert any(r.startswith("receive_weights on serving cards") and "rollout.bucket_mb" in r for r in huge.refusals)


def _refusals(base: dict, shape, **changes) -> str:
    """``layout_refusals`` of ``base`` with ``group__key=value`` changes, joined by `` | ``."""
    cfg = json.loads(json.dumps(base))
    for key, value in changes.items():
        group, name = key.split("__")
        cfg[group][name] = value
    return " | ".join(layout_refusals(OmegaConf.create(cfg), shape))


def test_separate_layouts_the_build_cannot_run_are_refused(qwen27b_dir, tmp_path):
    shape = read_model_shape(qwen27b_dir)
    base = OmegaConf.to_container(_cfg("r28-continued-cost-8gpu-t49152-n16-separate4-4-memory", qwen27b_dir, tmp_path),
                                  resolve=True)
    assert layout_refusals(OmegaConf.create(base), shape) == []

    def refused(**changes):
        return _refusals(base, shape, **changes)

    assert "set rollout.engine=vllm-server" in refused(rollout__engine="vllm")
    assert "would make 2 servers" in refused(layout__engine_tp=2)
    assert "set rollout.enable_sleep_mode=false" in refused(rollout__enable_sleep_mode=True)
    assert "layout.train_gpus (4) + layout.serve_gpus (4) != layout.gpus (6)" in refused(layout__gpus=6)
    assert "but layout.train_gpus=4" in refused(trainer__devices=2)


def test_impossible_layouts_are_refused(qwen27b_dir, tmp_path):
    shape = read_model_shape(qwen27b_dir)
    base = OmegaConf.to_container(_cfg("r28-continued-cost-8gpu-n32", qwen27b_dir, tmp_path), resolve=True)
    assert layout_refusals(OmegaConf.create(base), shape) == []

    def refused(**changes):
        return _refusals(base, shape, **changes)

    assert "engine TP 3 does not divide the 8 cards" in refused(layout__engine_tp=3)
    assert "24 attention heads" in refused(layout__engine_tp=16, layout__gpus=16, layout__train_gpus=16,
                                           trainer__devices=16)
    assert "must all be equal" in refused(trainer__devices=4)
    assert "longer than algorithm.ppo_max_token_len_per_gpu=16,384" in refused(algorithm__ppo_max_token_len_per_gpu=16384)
    # the composed route refuses the TP mismatch before the plan, naming the key
    with pytest.raises(ConfigError, match="layout.engine_tp=3 does not divide layout.gpus=8"):
        _cfg("r28-continued-cost-8gpu-n32", qwen27b_dir, tmp_path, "layout.engine_tp=3")


@pytest.mark.parametrize("run", ["r28-continued-cost-8gpu-n32", "r28-continued-cost-8gpu-t49152-n16-separate4-4-memory"])
def test_the_plan_sizes_the_engine_the_factory_starts(run, qwen27b_dir, tmp_path):
    """One set of engine arguments: the plan's engine is ``EngineArgs.from_config`` of the same
    config (TP, sequences in flight, budget), the separate layout's shared server included."""
    from atlas_lightning.planning.estimate import ENGINE_RESERVE_GIB
    from atlas_lightning.rollout.engines.args import EngineArgs

    cfg = _cfg(run, qwen27b_dir, tmp_path, "rollout.max_in_flight=300")
    args = EngineArgs.from_config(cfg)
    plan = make_plan(cfg, card_gib=80, linear_kernel="fla")
    vocab = read_model_shape(qwen27b_dir).vocab_size
    assert (plan.engine["tensor_parallel_size"], plan.engine["max_num_seqs"]) == (args.tensor_parallel_size, 300) == (4, 300)
    assert plan.engine["reserve_gib"] == pytest.approx(ENGINE_RESERVE_GIB + 300 * vocab * 4 / GIB)
    assert plan.engine["budget_gib"] == pytest.approx(args.gpu_memory_utilization * 80)


def test_engine_budget_refusals(qwen27b_dir, tmp_path):
    greedy = make_plan(_cfg("r28-continued-cost-8gpu-n32", qwen27b_dir, tmp_path, "rollout.gpu_memory_utilization=0.95"),
                       card_gib=80, linear_kernel="fla")
    assert any(r.startswith("generation on every card") and "lower gpu_memory_utilization" in r for r in greedy.refusals)
    starved = make_plan(_cfg("r28-continued-cost-8gpu-n32", qwen27b_dir, tmp_path, "rollout.gpu_memory_utilization=0.1"),
                        card_gib=80, linear_kernel="fla")
    assert any(r.startswith("engine:") and "sequences of rollout.max_model_len=32768" in r for r in starved.refusals)


def test_plan_verb_exit_codes_and_plan_json(qwen27b_dir, tmp_path, monkeypatch, capsys):
    args = [f"model.path={qwen27b_dir}", f"data.root={tmp_path}", f"paths.root={tmp_path}", "plan.card_gib=80",
            "model.linear_attention_kernel=fla"]
    assert cli_main(["plan", "experiment=r28-continued-cost-8gpu-t49152-memory", *args]) == 0
    assert "PLAN OK" in capsys.readouterr().out
    assert cli_main(["plan", "experiment=r28-continued-cost-8gpu-t73728-memory", *args]) == 2
    out = capsys.readouterr().out
    assert "PLAN REFUSED" in out and "update_actor on every card" in out
    saved = json.loads((tmp_path / "outputs" / "r28-continued-cost-8gpu-t73728-memory" / "plan.json").read_text())
    assert saved["ok"] is False and saved["card_gib"] == 80
    assert {p["name"] for p in saved["phases"]} >= {"generation", "old_log_prob", "values", "update_critic",
                                                    "update_actor", "update_weights"}
    # an H200 holds 73,728 tokens a card
    assert cli_main(["plan", "experiment=r28-continued-cost-8gpu-t73728-memory", *args, "plan.card_gib=139"]) == 0
    assert cli_main(["plan", "experiment=r28-continued-cost-8gpu-t73728-memory", *args, "plan.card_gib=lots"]) == 2
    assert "plan.card_gib: Value 'lots'" in capsys.readouterr().err


def test_model_build_reads_the_whole_base_onto_each_card(qwen27b_dir, tmp_path):
    """``models/build.py`` reads the whole base onto every card before FSDP2 shards it: the plan
    sizes that moment (more cards do not lower it) and refuses a card that cannot hold it."""
    cfg = _cfg("r28-continued-cost-8gpu-t49152-memory", qwen27b_dir, tmp_path)
    plan = make_plan(cfg, card_gib=80, linear_kernel="fla")
    build = plan.phase("model_build")
    whole = build.terms["base weights, whole (before sharding)"]
    assert whole == read_model_shape(qwen27b_dir).base_params * 2  # bf16, not divided by the 8 ranks
    assert whole / GIB > 45 and plan.ok  # the engine sleeps meanwhile: 80 GiB cards hold it
    awake = make_plan(_cfg("r28-continued-cost-8gpu-t49152-memory", qwen27b_dir, tmp_path,
                           "rollout.enable_sleep_mode=false"), card_gib=80, linear_kernel="fla")
    assert any(r.startswith("model_build on every card: each rank reads the whole base") for r in awake.refusals)


def test_a_shared_card_counts_the_servers_share_in_every_training_phase(dense8b_dir, tmp_path):
    """``layout.share_cards``: the server keeps rollout.gpu_memory_utilization x card on the
    training card through every phase, so each trainer phase needs exactly that much more than
    with the server on a card of its own, and generation is the trainer's resident tensors beside
    the server's budget."""
    from atlas_lightning.planning.estimate import ALLOCATOR_SLACK, RUNTIME_GIB, SHARED_SERVER

    # every layer checkpointed in both: h200-8b's auto would keep fewer on the card the server shares
    args = ("rollout=vllm_server_gpu", "rollout.gpu_memory_utilization=0.4", "model.checkpoint_layers=null")
    shared = make_plan(_cfg("h200-8b", dense8b_dir, tmp_path, "layout=separate_one_card", *args), card_gib=140)
    split = make_plan(_cfg("h200-8b", dense8b_dir, tmp_path, "layout=separate_cpu", *args), card_gib=140)
    server = 0.4 * 140 * GIB
    for name in ("model_build", "old_log_prob", "values", "update_critic", "update_actor", "update_weights"):
        mine, apart = shared.phase(name), split.phase(name)
        assert mine.overhead == {"runtime (CUDA context, NCCL)": RUNTIME_GIB * GIB, SHARED_SERVER: server}
        assert mine.terms == apart.terms
        assert mine.card == pytest.approx(apart.card + server)
    generation = shared.phase("generation")
    assert generation.cards == "training cards"
    assert generation.card == pytest.approx(sum(generation.terms.values()) * ALLOCATOR_SLACK + server
                                            + RUNTIME_GIB * GIB)
    # the room the trainer has: card x (1 - utilization) less the runtime
    room = 140 * GIB * (1 - 0.4) - RUNTIME_GIB * GIB
    update = shared.phase("update_actor")
    assert update.card - server - RUNTIME_GIB * GIB == pytest.approx(update.tensors * ALLOCATOR_SLACK)
    assert (update.card <= 140 * GIB) == (update.tensors * ALLOCATOR_SLACK <= room)
    assert shared.max_update_tokens < split.max_update_tokens
