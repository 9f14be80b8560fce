"""``python -m atlas_lightning.bench``: the issue-9 performance benchmark (bench/README.md).

One run measures, on the machine it runs on: the bf16 matmul rate and copy bandwidth (the
ceilings), log-prob memory (chunked against full), and for each model shape: a sweep of our
speed options on a shortened stack, then the full stack, ours against the plain
transformers + peft baseline on the same inputs: the PPO update, forward-only passes and
weight sync. Results go to a JSON file (rewritten after every measurement, so a run cut
short keeps what it measured) and a markdown table (printed last).

``--tiny``: CPU, toy shapes, tiny token budgets: the smoke test of every code path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import measure
from .flops import FORMULA, model_flops
from .logprob_memory import measure_logprob_memory
from .report import markdown
from .shapes import build_model, shape_by_name
from .sync import measure_weight_sync
from .update import BaselineRunner, OursRunner, update_fn
from .workload import ppo_inputs, sample_micro_batch

#: Our options measured in the sweep: (name, fused LoRA, attention, checkpointed-layer rule).
SWEEP = {
    "ours": (True, "sdpa_varlen", "all"),
    "ours_selective": (True, "sdpa_varlen", "half"),
    "unfused_lora": (False, "sdpa_varlen", "all"),
    "flex_attention": (True, "flex_attention", "all"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m atlas_lightning.bench", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on toy shapes")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--models", default="dense8b,qwen3_6_27b")
    p.add_argument("--layers", default="", help="per model: name=N (decoder layers of the full run)")
    p.add_argument("--sweep-layers", type=int, default=8, help="layers of the option sweep (0: no sweep)")
    p.add_argument("--sweep", default=",".join(SWEEP), help="options to sweep")
    p.add_argument("--tokens", type=int, default=49152, help="update micro-batch token budget")
    p.add_argument("--forward-tokens", type=int, default=98304, help="forward-only micro-batch token budget")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024, help="log-prob chunk tokens")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions (after one warm-up)")
    p.add_argument("--sweep-reps", type=int, default=1, help="timed repetitions in the sweep")
    p.add_argument("--sections", default="peak,logprob,update,forward,sync")
    p.add_argument("--memory-margin-gib", type=float, default=16.0)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip what is left after this many seconds")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--md", default=None, help="markdown output (default: --out with .md)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        args.device = args.device or "cpu"
        if args.models == "dense8b,qwen3_6_27b":
            args.models = "tiny,tiny_hybrid"
        args.tokens = min(args.tokens, 3072)
        args.forward_tokens = min(args.forward_tokens, 6144)
        args.rank = min(args.rank, 8)
        args.chunk = min(args.chunk, 128)
        args.sweep_layers = min(args.sweep_layers, 2)
        args.bucket_mb = 1
    return args


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16
        self.started = time.monotonic()
        self.scale = 1 / 32 if args.tiny else 1.0
        self.results: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, "-m", "atlas_lightning.bench", *sys.argv[1:]]),
            "environment": self._environment(),
            "useful_flops_formula": FORMULA,
            "settings": {k: v for k, v in vars(args).items()},
            "models": {},
        }
        self.layers = dict(item.split("=") for item in args.layers.split(",") if item)

    # ------------------------------------------------------------------ bookkeeping
    def _environment(self) -> dict:
        import peft
        import transformers

        env = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
               "python": platform.python_version()}
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / measure.GIB
        return env

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out_of_time(self) -> bool:
        return self.elapsed() > self.args.deadline_s

    def save(self) -> None:
        self.results["elapsed_s"] = self.elapsed()
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        for path, text in ((out, json.dumps(self.results, indent=1, default=str)),
                           (Path(self.args.md) if self.args.md else out.with_suffix(".md"), markdown(self.results))):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, path)

    def log(self, message: str) -> None:
        print(f"[bench {self.elapsed():7.1f}s] {message}", flush=True)

    # ------------------------------------------------------------------ ceilings
    def ceilings(self) -> None:
        tiny = self.args.tiny
        self.results["matmul_peak"] = measure.matmul_peak(self.device, n=512 if tiny else 8192, reps=3 if tiny else 20)
        self.results["copy_bandwidth"] = measure.copy_bandwidth(self.device, nbytes=2**20 if tiny else 4 * 2**30,
                                                                reps=3 if tiny else 10)
        self.log(f"matmul {self.results['matmul_peak']['tflops']:.1f} TFLOP/s, "
                 f"copy {self.results['copy_bandwidth']['gbps']:.0f} GB/s")
        self.save()

    @property
    def peak_tflops(self) -> Optional[float]:
        return self.results.get("matmul_peak", {}).get("tflops")

    # ------------------------------------------------------------------ measurements
    def _rates(self, entry: dict, flops: float, tokens: int) -> None:
        seconds = entry["median_s"]
        entry["tokens_per_s"] = tokens / seconds
        entry["useful_tflops"] = flops / seconds / 1e12
        if self.peak_tflops:
            entry["useful_mfu"] = entry["useful_tflops"] / self.peak_tflops

    def measure_update(self, runner, inputs, flops, label: str, reps: Optional[int] = None) -> dict:
        times: dict = {}
        step = update_fn(runner, inputs, times)
        entry = measure.repeat(self.device, step, reps=reps or self.args.reps, warmup=1)
        warm = 1
        entry["critic_s"] = statistics.median(times["critic"][warm:])
        entry["actor_s"] = statistics.median(times["actor"][warm:])
        entry["warmup_critic_s"], entry["warmup_actor_s"] = times["critic"][0], times["actor"][0]
        entry["micro_batches"] = len(runner.micro_batches(inputs))
        entry["real_tokens"] = inputs.num_tokens
        seq_lens = [int(s.numel()) for s in inputs.sequences]
        widths = [len(mb) * max(seq_lens[i] for i in mb) if mb else 0 for mb in runner.micro_batches(inputs)]
        entry["padded_tokens"] = sum(widths) if (isinstance(runner, BaselineRunner)
                                                or runner.model.sequence_layout == "padded") else inputs.num_tokens
        self._rates(entry, flops, inputs.num_tokens)
        self.log(f"{label}: {entry['median_s']:.3f} s/update, {entry['tokens_per_s']:.0f} tok/s, "
                 f"MFU {entry.get('useful_mfu', 0):.3f}, peak {entry['peak_gib']}")
        return entry

    def measure_forward(self, runner, inputs, flops_model, label: str) -> dict:
        seq_lens = [int(s.numel()) for s in inputs.sequences]
        scored = sum(int(s.numel()) - p for s, p in zip(inputs.sequences, inputs.prompt_lengths))
        budget = self.args.forward_tokens
        out = {"real_tokens": inputs.num_tokens, "budget": budget,
               "micro_batches": len(runner.micro_batches(inputs, budget))}
        for role in ("actor", "critic"):
            entry = measure.repeat(self.device, lambda: runner.forward_pass(role, inputs, budget), reps=self.args.reps,
                                   warmup=1)
            self._rates(entry, flops_model.forward(role, seq_lens, scored), inputs.num_tokens)
            out[role] = entry
            self.log(f"{label} forward {role}: {entry['median_s']:.3f} s, {entry['tokens_per_s']:.0f} tok/s, "
                     f"peak {entry['peak_gib']}")
        return out

    def _inputs(self, shape, budget: int, seed: int):
        trajectories = sample_micro_batch(seed, budget, scale=self.scale)
        return ppo_inputs(trajectories, shape.vocab_size, self.device, seed=seed)

    def _ours(self, base, fused: bool, checkpoint_layers):
        return OursRunner(base, self.args.rank, self.args.tokens, fused_lora=fused,
                          checkpoint_layers=checkpoint_layers, chunk_tokens=self.args.chunk)

    def run_model(self, name: str) -> None:
        shape = shape_by_name(name)
        full_layers = int(self.layers.get(name, shape.num_layers))
        model_out = self.results["models"].setdefault(name, {"shape": shape.config | {"arch": shape.arch},
                                                             "full_run_layers": full_layers})
        inputs = self._inputs(shape, self.args.tokens, self.args.seed)
        model_out["update_inputs"] = {
            "sequences": len(inputs.sequences), "real_tokens": inputs.num_tokens,
            "lengths": [int(s.numel()) for s in inputs.sequences], "prompt_lengths": inputs.prompt_lengths,
            "loss_tokens": int(inputs.response_mask.sum()),
        }
        seq_lens = model_out["update_inputs"]["lengths"]
        scored = sum(n - p for n, p in zip(seq_lens, inputs.prompt_lengths))

        # ---- sweep of our options on a shortened stack
        selective = None
        if "update" in self.sections and self.args.sweep_layers:
            sweep_layers = min(self.args.sweep_layers, full_layers)
            sweep = model_out.setdefault("sweep", {"layers": sweep_layers})
            for option in [o for o in self.args.sweep.split(",") if o]:
                if self.out_of_time():
                    sweep[option] = {"skipped": "deadline"}
                    continue
                fused, attention, rule = SWEEP[option]
                runner = base = None
                with measure.section(sweep, option, self.device) as entry:
                    base = build_model(shape, device=self.device, dtype=self.dtype, attn_implementation=attention,
                                       layers=sweep_layers, seed=self.args.seed)
                    flops = model_flops(base, self.args.rank)
                    k = sweep_layers if rule == "all" else sweep_layers // 2
                    runner = self._ours(base, fused, k)
                    entry.update(self.measure_update(runner, inputs, flops.train_step("critic", seq_lens, scored)
                                                     + flops.train_step("actor", seq_lens, scored),
                                                     f"{name} sweep {option} ({sweep_layers} layers)",
                                                     reps=self.args.sweep_reps))
                    entry.update(fused_lora=fused, attention=attention, checkpoint_layers=k)
                    entry["layer_bytes"] = sum(p.numel() * p.element_size() for p in runner.model.decoder_layers()[0].parameters())
                runner = base = None  # also after a failure, before the next option builds its model
                measure.free_memory(self.device)
                self.save()
            selective = self._choose_checkpoint_layers(sweep, full_layers, inputs.num_tokens, shape)
            model_out["checkpoint_choice"] = selective

        # ---- the full stack: ours (best options) and the baseline
        for path in ("ours", "baseline"):
            if self.out_of_time():
                model_out[path] = {"skipped": "deadline"}
                continue
            attempts = [selective["checkpoint_layers"]] if selective and selective.get("checkpoint_layers") is not None \
                else [None]
            if path == "ours" and attempts[0] is not None and attempts[0] < full_layers:
                attempts.append(full_layers)  # fall back to checkpointing every layer if it does not fit
            for attempt in attempts:
                # a failed attempt's model can survive in reference cycles until collected: the
                # first H200 run OOMed on its fallback attempt for want of this
                measure.free_memory(self.device)
                entry = self._run_full(name, shape, path, full_layers, inputs, seq_lens, scored, attempt)
                entry["allocated_before_gib"] = self._allocated_before
                model_out[path] = entry
                self.save()
                if "error" not in entry.get("update", {}) or not entry["update"]["error"].startswith("OOM"):
                    break

    def _choose_checkpoint_layers(self, sweep: dict, full_layers: int, tokens: int, shape) -> dict:
        """Layers to checkpoint on the full stack so that the predicted peak stays under the card's
        memory less a margin: per-layer activation cost from the sweep's all/half checkpointed peaks."""
        all_ckpt, half = sweep.get("ours", {}), sweep.get("ours_selective", {})
        if self.device.type != "cuda" or not all_ckpt.get("peak_gib") or not half.get("peak_gib"):
            return {"checkpoint_layers": None, "why": "no sweep peaks (CPU run or sweep incomplete): all layers"}
        sweep_layers = sweep["layers"]
        uncheckpointed = sweep_layers - half["checkpoint_layers"]
        # x1.25: on the H200 (run 1) the unscaled prediction left the 36-layer 8B 1-2 GiB short
        per_layer = 1.25 * max((half["peak_gib"] - all_ckpt["peak_gib"]) / max(uncheckpointed, 1), 1e-3)
        # a checkpointed layer keeps its weights and its input (T x hidden, bf16) alive
        kept = all_ckpt["layer_bytes"] / measure.GIB + tokens * shape.config["hidden_size"] * 2 / measure.GIB
        predicted_all = all_ckpt["peak_gib"] + (full_layers - sweep_layers) * kept
        capacity = torch.cuda.get_device_properties(self.device).total_memory / measure.GIB
        room = capacity - self.args.memory_margin_gib - predicted_all
        free_layers = max(0, min(full_layers, int(room // per_layer)))
        return {"checkpoint_layers": full_layers - free_layers, "per_layer_activation_gib": per_layer,
                "predicted_peak_all_checkpointed_gib": predicted_all, "capacity_gib": capacity,
                "margin_gib": self.args.memory_margin_gib}

    def _run_full(self, name, shape, path, layers, inputs, seq_lens, scored, checkpoint_layers) -> dict:
        entry: dict = {"layers": layers}
        self._allocated_before = measure.allocated_gib(self.device)
        runner = base = None
        attention = "sdpa_varlen" if path == "ours" else "sdpa"
        with measure.section(entry, "update", self.device) as update:
            base = build_model(shape, device=self.device, dtype=self.dtype, attn_implementation=attention,
                               layers=layers, seed=self.args.seed)
            flops = model_flops(base, self.args.rank)
            entry["flops_model"] = vars(flops)
            if path == "ours":
                runner = self._ours(base, True, checkpoint_layers)
                entry["options"] = {"fused_lora": True, "attention": attention,
                                    "checkpoint_layers": runner.model.checkpointed_layers,
                                    "sequence_layout": runner.model.sequence_layout}
            else:
                capacity = (torch.cuda.get_device_properties(self.device).total_memory
                            if self.device.type == "cuda" else None)
                limit = None if capacity is None else 0.5 * (capacity - torch.cuda.memory_allocated(self.device))
                runner = BaselineRunner(base, self.args.rank, self.args.tokens, logits_bytes_limit=limit)
                entry["options"] = {"attention": attention, "micro_batch_sequences": runner.micro_batch_size(inputs),
                                    "checkpoint_layers": layers, "logits": "full"}
            self.save()
            if "update" in self.sections:
                update.update(self.measure_update(runner, inputs, flops.train_step("critic", seq_lens, scored)
                                                  + flops.train_step("actor", seq_lens, scored),
                                                  f"{name} {path} ({layers} layers)"))
                self.save()
            if "forward" in self.sections and not self.out_of_time():
                runner.zero_grad()
                with measure.section(entry, "forward", self.device) as fwd:
                    fwd_inputs = self._inputs(shape, self.args.forward_tokens, self.args.seed + 1)
                    fwd.update(self.measure_forward(runner, fwd_inputs, flops, f"{name} {path}"))
                self.save()
            if path == "ours" and "sync" in self.sections and not self.out_of_time():
                with measure.section(entry, "weight_sync", self.device) as sync:
                    sync.update(measure_weight_sync(runner.model, self.device, self.args.bucket_mb * 2**20,
                                                    self.results.get("copy_bandwidth", {}).get("gbps")))
                    self.log(f"{name} weight sync: {json.dumps(sync)[:400]}")
        del runner, base
        return entry

    # ------------------------------------------------------------------ driver
    @property
    def sections(self) -> set[str]:
        return set(self.args.sections.split(","))

    def run(self) -> dict:
        self.log(f"device {self.device}, {self.results['environment']}")
        if "peak" in self.sections:
            self.ceilings()
        names = [n for n in self.args.models.split(",") if n]
        if "logprob" in self.sections:
            rows = []
            for name in names:
                shape = shape_by_name(name)
                counts = sorted({self.args.tokens // 4, self.args.tokens})
                rows += measure_logprob_memory(self.device, shape.config["hidden_size"], shape.vocab_size, counts,
                                               self.args.chunk)
                self.results["logprob_memory"] = rows
                self.save()
        for name in names:
            if self.out_of_time():
                self.results["models"].setdefault(name, {})["skipped"] = "deadline"
                continue
            self.run_model(name)
            measure.free_memory(self.device)
            self.save()
        self.save()
        return self.results


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    results = bench.run()
    print(markdown(results), flush=True)
    return 0
