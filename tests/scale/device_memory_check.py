"""Plan against memory-check on one accelerator card: the calibration run (not collected by pytest).

    PYTHONPATH=.carry/scale-site:. python3 tests/scale/device_memory_check.py --out DIR CASE [CASE ...]

A CASE is ``shape:tokens:ckpt|nockpt[:layers]``, e.g. ``dense8b:8192:ckpt`` or
``qwen3_6_27b:16384:ckpt:8`` (the first 8 decoder layers of the 27B shape, keeping its 3:1
linear/full pattern). Shapes: ``dense8b`` (Qwen3-8B: hidden 4096, 36 layers, vocabulary
151,936), ``qwen3_6_27b`` (Qwen3.6-27B text: hidden 5120, 64 layers, 48 of them Gated DeltaNet,
vocabulary 248,320), ``tiny`` and ``tiny_hybrid`` (CPU smoke runs).

Each case runs ``memory_check.run_memory_check`` (the real ``PPOModule.training_step`` under a
real ``lightning.Trainer``, one process, one card) on a random-weight base of that shape built
in place on the card (transformers' own initialisation; the module's ``configure_model`` is the
only thing replaced), LoRA r64 all-linear on both adapters, bf16, fused LoRA, 1,024-token
log-prob chunks, one mini-batch of one micro-batch at ``tokens`` for both the update and the
forward-only passes, sequences of 4,096 tokens (memory does not depend on how the budget is cut
into sequences for varlen attention; time does). The config is composed without hydra (the
device has none): ``conf/`` YAML files merged onto ``config.RootConfig``.

Per case it writes one JSON line to ``DIR/results.jsonl``: the measured per-phase peaks
(``max_memory_allocated`` / ``max_memory_reserved``) beside ``planning.estimate``'s tensors for
the same config, and the relative error; a case that runs out of memory is recorded as such
with the plan's prediction. Cases stop being started when ``--budget-s`` seconds have passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from atlas_lightning.config import RootConfig, validate  # noqa: E402
from atlas_lightning.run.memory_check import MemoryCheckModule, run_memory_check  # noqa: E402
from atlas_lightning.planning import estimate, shape_from_config  # noqa: E402

GIB = 2**30
SHAPES = {
    "dense8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen3_6_27b": ("qwen3_5", dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                    num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                                    linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                    max_position_embeddings=262144, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                     "partial_rotary_factor": 0.25})),
    "tiny": ("qwen3", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "tiny_hybrid": ("qwen3_5", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                    tie_word_embeddings=False)),
}


def text_config(shape: str, layers: int | None) -> tuple[str, dict]:
    arch, config = SHAPES[shape]
    config = dict(config)
    if layers:
        config["num_hidden_layers"] = layers
    if arch == "qwen3_5":
        config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                 for i in range(config["num_hidden_layers"])]
    return arch, config


def compose_plain(overrides: dict):
    """``config.yaml``'s groups (the 27B model group, GPU rollout, single-card layout) merged
    onto the schema without hydra, then ``overrides``; validated like ``config.compose``."""
    conf = REPO / "conf"
    root = OmegaConf.load(conf / "config.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(RootConfig), {k: v for k, v in root.items() if k != "defaults"})
    for group, name in (("model", "qwen3_6_27b"), ("data", "sample"), ("rollout", "vllm_gpu"), ("algorithm", "ppo"),
                        ("reward", "cost"), ("trainer", "default"), ("layout", "single")):
        cfg = OmegaConf.merge(cfg, {group: OmegaConf.load(conf / group / f"{name}.yaml")})
    cfg = OmegaConf.merge(cfg, overrides)
    OmegaConf.resolve(cfg)
    validate(cfg)
    return cfg


class RandomBaseModule(MemoryCheckModule):
    """``MemoryCheckModule`` whose base is built with random weights on the card instead of
    loaded from ``model.path`` (``PPOModule.random_base``); the builder, placement, adapters,
    value head, sharding and everything after are ``fit``'s."""

    def __init__(self, cfg, arch: str, config: dict) -> None:
        super().__init__(cfg, generation=False)
        if arch == "qwen3":
            from transformers import Qwen3Config as Config
        else:
            from transformers.models.qwen3_5 import Qwen3_5TextConfig as Config
        self.random_base = Config(**config)


def case_setup(case: str, root: Path, attn: str, accelerator: str):
    """``(cfg, model_shape, arch, text_config)`` of a CASE (module doc), as the run and the
    test that replays the plan against the stored measurements (``test_plan_vs_h200.py``) use it."""
    parts = case.split(":")
    shape, tokens, ckpt = parts[0], int(parts[1]), parts[2] == "ckpt"
    layers = int(parts[3]) if len(parts) > 3 else None
    arch, config = text_config(shape, layers)
    cfg = compose_plain({
        "name": f"device-{shape}-{tokens}-{'ckpt' if ckpt else 'nockpt'}", "paths": {"root": str(root / "runs")},
        "model": {"path": str(root), "gradient_checkpointing": ckpt, "attn_implementation": attn,
                  "dtype": "float32" if accelerator == "cpu" else "bfloat16"},
        "algorithm": {"ppo_max_token_len_per_gpu": tokens, "forward_max_token_len_per_gpu": tokens,
                      "train_batch_size": 1, "ppo_mini_batch_size": 1, "ppo_epochs": 1},
        "rollout": {"max_prompt_length": 2048, "max_response_length": 6144, "max_model_len": 8192,
                    "max_tokens_per_turn": 2048},
        "trainer": {"accelerator": accelerator, "devices": 1, "memory_check_steps": 1},
    })
    model_shape = shape_from_config({**config, "model_type": "qwen3" if arch == "qwen3" else "qwen3_5_text"})
    return cfg, model_shape, arch, config


def run_case(case: str, out: Path, attn: str, sequence_tokens: int) -> dict:
    cpu = not torch.cuda.is_available()
    cfg, model_shape, arch, config = case_setup(case, out, attn, "cpu" if cpu else "gpu")
    card = torch.cuda.get_device_properties(0).total_memory / GIB if not cpu else 80.0
    plan = estimate(model_shape, cfg, card_gib=card, linear_kernel="torch")
    row = {"case": case, "attn": attn, "sequence_tokens": sequence_tokens, "card_gib": card,
           "plan_tensors_gib": {p.name: p.tensors / GIB for p in plan.phases if p.tokens},
           "plan_terms_gib": {p.name: {k: v / GIB for k, v in p.terms.items()} for p in plan.phases if p.tokens}}
    started = time.monotonic()
    module = RandomBaseModule(cfg, arch, config)
    try:
        report = run_memory_check(cfg, module=module, vocab_size=config["vocab_size"],
                                  sequence_tokens=sequence_tokens, write=False, plan=plan)
        measured = {}
        for record in report["ranks"][0]["phases"]:
            measured[record["phase"]] = {k: record[k] for k in ("peak_allocated_gib", "peak_reserved_gib",
                                                                 "start_gib", "seconds", "peak_rss_gib") if k in record}
        row["measured"] = measured
        row["error"] = {name: row["plan_tensors_gib"][name] / m["peak_allocated_gib"] - 1.0
                        for name, m in measured.items() if "peak_allocated_gib" in m and name in row["plan_tensors_gib"]}
        row["status"] = "ok"
    except torch.OutOfMemoryError as err:
        row["status"] = "oom"
        row["detail"] = str(err).splitlines()[0][:300]
        row["measured"] = {r["phase"]: r for r in (module.probe.records if module.probe else [])}
    except Exception as err:  # recorded and the next case still runs
        row["status"] = "error"
        row["detail"] = f"{type(err).__name__}: {err}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
    row["seconds"] = time.monotonic() - started
    del module
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--attn", default="sdpa_varlen")
    parser.add_argument("--sequence-tokens", type=int, default=4096)
    parser.add_argument("--budget-s", type=float, default=1e9)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text("{}")
    started = time.monotonic()
    attn = args.attn
    for case in args.cases:
        if time.monotonic() - started > args.budget_s:
            print(f"skipped (time budget): {case}", flush=True)
            continue
        row = run_case(case, args.out, attn, args.sequence_tokens)
        if row["status"] == "error" and attn == "sdpa_varlen":  # the speed path failed here: measure with flex
            print(f"{case}: sdpa_varlen failed ({row['detail'][:200]}); retrying with flex_attention", flush=True)
            attn = "flex_attention"
            row = run_case(case, args.out, attn, args.sequence_tokens)
        with open(args.out / "results.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        errors = ", ".join(f"{k} {v:+.1%}" for k, v in row.get("error", {}).items())
        peaks = ", ".join(f"{k} {v.get('peak_allocated_gib', v.get('peak_rss_gib', 0)):.2f}"
                          for k, v in row.get("measured", {}).items() if isinstance(v, dict))
        print(f"[{time.monotonic() - started:6.0f}s] {case} {row['status']} in {row['seconds']:.0f}s | "
              f"measured {peaks} | plan {', '.join(f'{k} {v:.2f}' for k, v in row['plan_tensors_gib'].items())} | "
              f"error {errors} {row.get('detail', '')[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
