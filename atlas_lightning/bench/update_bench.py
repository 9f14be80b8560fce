"""The update benchmark: our PPO update against plain transformers + peft (``bench/README.md``).

    atlas-lightning bench [OPTIONS]                  # or: python -m atlas_lightning.bench [OPTIONS]
    atlas-lightning bench --tiny                     # CPU, toy shapes: the smoke test of every code path
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True atlas-lightning bench --layers qwen3_6_27b=16 \\
        --sweep ours,ours_selective,unfused_lora,flex_attention --deadline-s 480 --out $OUT/bench.json

One run measures, on the machine it runs on: the bf16 matmul rate and copy bandwidth (the
ceilings), log-prob memory (chunked against full), and for each model shape: a sweep of our
options on a shortened stack (each recompute policy on every layer: its peak beside the plan's
figure), then the full stack, ours against the plain transformers + peft baseline on the same
inputs: the PPO update, forward-only passes and weight sync; and the batch update. Results go
to a JSON file (rewritten after every measurement, so a run cut short keeps what it measured)
and a markdown table (printed last). ``--tiny``: CPU, toy shapes, tiny token budgets. The third
command is the whole comparison on one H200 (both shapes, the 27B cut to 16 layers);
``update_suite.py`` runs the later recorded runs in one process.

Our path's recomputation is ``fit``'s: ``model.checkpoint_layers=auto`` resolved by the same
code (``_fit_plan``: ``run/recompute.choose_for`` on a config equal to what ``fit`` would run,
``update.fit_run_config``, for the card's free memory measured as ``fit`` measures it), the
plans of smaller micro-batches given to the model and each update micro-batch run under its
own (``update.OursRunner``). ``--memory-margin-gib`` (full stack) and ``--batch-cap-gib`` (batch)
lower the free memory planned for, as an engine beside the trainer would; the batch takes the
largest of ``--batch-budgets`` whose plan fits. The JSON keeps the choice (``recompute_choice``,
the batch's ``choice``). Off CUDA no card is sized: every layer checkpointed, as ``fit`` there.

``--batch-from artifacts/<name>/train/step_N``: the batch update replays the batch ``fit`` trained
on at that step (``recorded_batch.py``: its token ids and loss masks, one card's share), with the
run's update shape (``ppo_epochs`` x mini-batches, the micro-batch budget
``ppo_max_token_len_per_gpu``) and model keys (``recorded_batch.MODEL_KEYS``: LoRA, dtype, head
dtype, kernels; they replace ``--rank`` and ``--chunk``; ``--elementwise-kernels``, where given,
still sets the element-wise kernels), so its MFU and
``fit``'s ``update_actor`` MFU of that step are figures of the same work. The model's shape is still
``--models``' (and ``--layers``'): the step's model must have it.
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

from atlas_lightning.planning.recompute import KEY
from atlas_lightning.run.recompute import free_on_card, tier_shares

from . import measure
from .measure import GIB
from .batch import ActorUpdate, run_with_fallbacks, timed_update
from .flops import FORMULA, model_flops
from .logprob_memory import measure_logprob_memory
from .plan_check import plan_tensors_gib
from .probes import autotune_probe, fla_configs, profile_call, profile_micro_step
from .recorded_batch import RecordedBatchError, read_recorded_batch
from .report import markdown
from .shapes import build_model, shape_by_name, transformers_config
from .sync import measure_weight_sync
from .update import BaselineRunner, OursRunner, fit_budget_plan, fit_model_config, fit_run_config, plan_record, update_fn
from .workload import ppo_inputs, recorded_ppo_inputs, sample_batch, sample_micro_batch

#: Our options measured in the sweep: (name, fused LoRA, attention, per-layer recompute rule:
#: a ``models/recompute.py`` policy for every layer, or ``half``: the first half ``layer``).
SWEEP = {
    "ours": (True, "sdpa_varlen", "layer"),
    "ours_selective": (True, "sdpa_varlen", "half"),
    "ours_none": (True, "sdpa_varlen", "none"),
    "ours_mixer": (True, "sdpa_varlen", "mixer"),
    "ours_mlp": (True, "sdpa_varlen", "mlp"),
    "unfused_lora": (False, "sdpa_varlen", "layer"),
    "flex_attention": (True, "flex_attention", "layer"),
}


def sweep_plan(rule: str, layers: int) -> list[str]:
    if rule == "half":
        return ["layer"] * (layers // 2) + ["none"] * (layers - layers // 2)
    return [rule] * layers


def parameter_bytes(model) -> dict:
    """Frozen (base) and trainable (LoRA, value head) bytes, and their shares a decoder layer."""
    layers = model.decoder_layers()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    layer_frozen = sum(p.numel() * p.element_size() for p in layers.parameters() if not p.requires_grad)
    layer_lora = sum(p.numel() * p.element_size() for p in layers.parameters() if p.requires_grad)
    return {"frozen_bytes": frozen, "root_bytes": frozen - layer_frozen, "layer_bytes": layer_frozen / len(layers),
            "lora_layer_bytes_per_adapter": layer_lora / len(layers) / 2}


def tuned_entries_or_none() -> Optional[int]:
    try:
        from atlas_lightning.models.fla_tuning import tuned_entries

        return tuned_entries()
    except ImportError:
        return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atlas-lightning bench", description=__doc__.splitlines()[0],
                                epilog="atlas-lightning bench --help lists the other benchmarks")
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
    p.add_argument("--sweep-warmup", type=int, default=1, help="untimed updates before the sweep's timed ones")
    p.add_argument("--baseline-warmup", type=int, default=1,
                   help="untimed baseline updates before the timed ones (0 saves device time; the first update's "
                        "one-time costs then count against the baseline)")
    p.add_argument("--sections", default="peak,logprob,update,forward,sync",
                   help="of peak, logprob, update, forward, sync, autotune, profile, batch, update-profile (the "
                        "batch's whole update under the profiler: kernels and the card's idle share)")
    p.add_argument("--elementwise-kernels", default=None, choices=("auto", "liger", "torch"),
                   help="our path's norm/SwiGLU/rotary kernels (model.elementwise_kernels; models/fused_kernels.py; "
                        "default auto, or with --batch-from the run's)")
    p.add_argument("--paths", default="ours,baseline", help="which of ours, baseline the update and batch run")
    p.add_argument("--batch-sequences", type=int, default=32, help="trajectories of the batch benchmark")
    p.add_argument("--batch-from", default=None, metavar="STEP_FOLDER",
                   help="replay the batch fit trained on at artifacts/<name>/train/step_N, with that run's "
                        "epochs, mini-batches and micro-batch budget, in place of --batch-sequences sampled ones")
    p.add_argument("--micro-step-tokens", type=float, default=None,
                   help="a micro-step's fixed cost in tokens of work for the update's cut (default: fit's starting "
                        "figure, ppo/micro_batches.MICRO_STEP_TOKENS; 0: the cut of a fit that measured none)")
    p.add_argument("--batch-cap-gib", type=float, default=60.0,
                   help="the batch update's plan is made for at most this much free memory (an engine beside the "
                        "trainer would hold the rest), and its warm-up peak must stay within it (0: the card as found)")
    p.add_argument("--batch-repeats", type=int, default=1,
                   help="timed updates of our path on the same batch (the second: every length seen once)")
    p.add_argument("--batch-budgets", default="49152,40960,32768,24576,16384",
                   help="micro-batch token budgets of the batch update: the largest whose plan fits is taken "
                        "(at most --tokens)")
    p.add_argument("--memory-margin-gib", type=float, default=0.0,
                   help="the full update's plan is made for at most the card less this many GiB (0: the free "
                        "memory as fit finds it)")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip what is left after this many seconds")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--md", default=None, help="markdown output (default: --out with .md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beside-vllm", action="store_true",
                   help="import vLLM's platform module first, as fit's engine does, so the update runs under what "
                        "vLLM sets process-wide at import (0.26 on CUDA: cuDNN's attention off)")
    args = p.parse_args(argv)
    args.vllm = _import_vllm_platform(p.error) if args.beside_vllm else None
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
    args.recorded_batch = _recorded_batch(args, p.error) if args.batch_from else None
    return args


def _import_vllm_platform(refuse) -> str:
    """``--beside-vllm``: vLLM's platform module for this machine imported, as ``fit`` imports it for
    its engine before the trainer's first update, so that whatever vLLM sets process-wide at import
    holds here too (0.26's CUDA platform switches cuDNN's attention off; ``models/attention.py``
    keeps the trainer's choice). Returns vLLM's version and platform; ``refuse(message)`` (argparse's
    error: exit 2) where vLLM cannot be imported."""
    try:
        import vllm
        from vllm.platforms import current_platform  # resolving it imports the platform's module
    except (ImportError, RuntimeError) as err:
        refuse(f"--beside-vllm: vLLM cannot be imported here ({type(err).__name__}: {err})")
    return f"{vllm.__version__} ({type(current_platform).__name__})"


def _recorded_batch(args: argparse.Namespace, refuse):
    """``--batch-from``'s batch, read before anything runs; its run's LoRA rank and log-prob chunk
    set on ``args`` (its other model keys: ``Bench.model_keys``). ``refuse(message)`` (argparse's
    error: exit 2) for a folder that cannot be replayed or tokens outside a model's vocabulary."""
    try:
        recorded = read_recorded_batch(args.batch_from)
    except RecordedBatchError as err:
        refuse(f"--batch-from: {err}")
    args.rank = int(recorded.model_keys["lora"]["rank"])
    args.chunk = int(recorded.model_keys["logprob_chunk_tokens"])
    for name in args.models.split(","):
        try:
            vocab = shape_by_name(name).vocab_size
        except ValueError as err:
            refuse(f"--models: {err}")
        if recorded.largest_token_id >= vocab:
            refuse(f"--batch-from {args.batch_from}: token id {recorded.largest_token_id} is outside {name}'s "
                   f"vocabulary of {vocab}: the step was trained on another model")
    return recorded


class Bench:
    def __init__(self, args: argparse.Namespace, argv: Optional[list[str]] = None) -> None:
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16
        self.started = time.monotonic()
        self.scale = 1 / 32 if args.tiny else 1.0
        self.results: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, "-m", "atlas_lightning.bench",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "environment": self._environment(),
            "useful_flops_formula": FORMULA,
            "settings": {k: v for k, v in vars(args).items() if k != "recorded_batch"},
            "models": {},
        }
        self.layers = dict(item.split("=") for item in args.layers.split(",") if item)

    # ------------------------------------------------------------------ bookkeeping
    def _environment(self) -> dict:
        import peft
        import transformers

        env = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
               "python": platform.python_version(),
               # the attention backends the process allows (vLLM's import may have switched one off)
               "sdpa_enabled": {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
                                for name in ("flash", "mem_efficient", "cudnn", "math")}}
        if self.args.vllm:
            env["vllm"] = self.args.vllm
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

    def measure_update(self, runner, inputs, flops, label: str, reps: Optional[int] = None, warmup: int = 1) -> dict:
        times: dict = {}
        step = update_fn(runner, inputs, times)
        entry = measure.repeat(self.device, step, reps=reps or self.args.reps, warmup=warmup)
        warm = warmup
        entry["critic_s"] = statistics.median(times["critic"][warm:])
        entry["actor_s"] = statistics.median(times["actor"][warm:])
        if warmup:
            entry["warmup_critic_s"], entry["warmup_actor_s"] = times["critic"][0], times["actor"][0]
        ours = isinstance(runner, OursRunner)
        cut = runner.micro_batches(inputs, update=True) if ours else runner.micro_batches(inputs)
        entry["micro_batches"] = len(cut)
        entry["real_tokens"] = inputs.num_tokens
        seq_lens = [int(s.numel()) for s in inputs.sequences]
        widths = [len(mb) * max(seq_lens[i] for i in mb) if mb else 0 for mb in cut]
        if ours and runner.model.recompute_tiers:
            entry["recompute_per_micro_step"] = runner.take_replays()
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

    def _ours(self, shape, layers: int, layer_recompute, budget: Optional[int] = None, tiers=(), **keys) -> OursRunner:
        """Our path as ``fit`` builds it (``update.fit_model_config`` with this run's LoRA rank,
        chunk and kernels, and ``keys``), random weights of ``shape``'s first ``layers`` layers;
        ``tiers``: ``auto``'s plans per micro-batch size (``_fit_plan``), as ``fit`` gives them."""
        model_cfg = fit_model_config(self.args.rank, self.args.chunk, layer_recompute=layer_recompute,
                                     **{**self.model_keys, **keys})
        runner = OursRunner(model_cfg, transformers_config(shape, layers), budget or self.args.tokens,
                            device=self.device, seed=self.args.seed, tiers=tiers)
        if self.args.micro_step_tokens is not None:
            runner.micro_step_tokens = self.args.micro_step_tokens
        return runner

    @property
    def model_keys(self) -> dict:
        """``model.*`` keys of our path's build and plan: a recorded run's (``recorded_batch.MODEL_KEYS``)
        or ``auto`` kernels, with ``--elementwise-kernels`` over them where given (``update_suite``'s
        ``dense-torch`` step measures the fused kernels' share on a recorded batch too)."""
        recorded = self.args.recorded_batch
        keys = dict(recorded.model_keys) if recorded is not None else {"elementwise_kernels": "auto"}
        if self.args.elementwise_kernels is not None:
            keys["elementwise_kernels"] = self.args.elementwise_kernels
        return keys

    def _shape_only(self, shape, layers: int, attention: str):
        """``shape``'s model on the meta device: what the FLOP counts read (no weights)."""
        return build_model(shape, device=torch.device("meta"), dtype=self.dtype, attn_implementation=attention,
                           layers=layers, seed=self.args.seed)

    def _card_memory(self) -> Optional[tuple[float, float]]:
        """``(free, total)`` bytes of the card as ``fit`` measures them before the build
        (``run/recompute.free_on_card``), this benchmark's models freed first; None off CUDA."""
        if self.device.type != "cuda":
            return None
        measure.free_memory(self.device)
        return free_on_card(self.device)

    def _fit_plan(self, shape, layers: int, budgets: list[int], *, cap_gib: Optional[float] = None,
                  margin_gib: float = 0.0) -> tuple[dict, list]:
        """``model.checkpoint_layers=auto`` resolved as ``fit`` resolves it (``run/recompute.py``)
        for our path on ``shape``'s first ``layers`` layers: the plans of the largest of ``budgets``
        whose budget plan fits (``update.fit_budget_plan``), for the card's free memory now, at
        most ``cap_gib`` and at most the card less ``margin_gib`` (a smaller figure stands for an
        engine beside the trainer). ``(record, tiers)``: the JSON's record (``update.plan_record``)
        and the plans per micro-batch size for ``OursRunner`` (empty where nothing fits). Off CUDA
        no card to size: every layer checkpointed, as ``fit`` there."""
        card = self._card_memory()
        if card is None:
            return {"plan": None, "why": f"{KEY}=auto on {self.device.type}: every decoder layer checkpointed "
                                         f"(no card to size), as fit"}, []
        measured, total = card
        free = min([measured] + ([cap_gib * GIB] if cap_gib else []) + ([total - margin_gib * GIB] if margin_gib else []))

        def config_for(budget: int):
            return fit_run_config(self.args.rank, self.args.chunk, budget, **self.model_keys)

        budget, tiers, tried = fit_budget_plan(budgets, config_for, transformers_config(shape, layers), free=free,
                                               card=total)
        record = plan_record(tiers, measured_free_gib=measured / GIB, cap_gib=cap_gib, margin_gib=margin_gib,
                             budgets=tried)
        self.log(record["line"])
        if record["tiers"]:
            self.log(record["tiers"])
        return record, tier_shares(tiers)

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
        if self.sections & {"update", "batch"} and self.args.sweep_layers and "ours" in self.paths:
            self.sweep(name, shape, min(self.args.sweep_layers, full_layers), inputs, model_out)

        # ---- the full stack: ours (auto's plan, as fit takes it) and the baseline
        for path in self.paths if "update" in self.sections else ():
            if self.out_of_time():
                model_out[path] = {"skipped": "deadline"}
                continue
            attempts = [("baseline", None, [])]
            if path == "ours":
                record, tiers = self._fit_plan(shape, full_layers, [self.args.tokens], margin_gib=self.args.memory_margin_gib)
                model_out["recompute_choice"] = record
                self.save()
                plan = record.get("plan")
                attempts = [("auto" if plan else "every layer checkpointed", plan, tiers)]
                attempts += [("every layer checkpointed", None, [])] if tiers else []  # after an OOM
            for label, plan, tiers in attempts:
                # a failed attempt's model can survive in reference cycles until collected: the
                # first H200 run OOMed on its fallback attempt for want of this
                measure.free_memory(self.device)
                entry = self._run_full(name, shape, path, full_layers, inputs, plan, tiers)
                entry["allocated_before_gib"] = self._allocated_before
                if path == "ours":
                    entry["recompute"] = label
                model_out[path] = entry
                self.save()
                if "error" not in entry.get("update", {}) or not entry["update"]["error"].startswith("OOM"):
                    break
        if "batch" in self.sections and not self.out_of_time():
            measure.free_memory(self.device)
            model_out["batch"] = self.run_batch(name, shape, full_layers)
            self.save()

    def sweep(self, name: str, shape, layers: int, inputs, model_out: dict) -> None:
        """Our options (``SWEEP``: each a recompute policy for every layer, or another option) on
        a shortened stack of ``layers`` layers: the peak of each, beside the plan's figure
        (``plan_check.py``) where the plan can express it."""
        seq_lens = model_out["update_inputs"]["lengths"]
        scored = sum(n - p for n, p in zip(seq_lens, inputs.prompt_lengths))
        sweep = model_out.setdefault("sweep", {"layers": layers, "tokens": inputs.num_tokens})
        for option in [o for o in self.args.sweep.split(",") if o]:
            if self.out_of_time():
                sweep[option] = {"skipped": "deadline"}
                continue
            fused, attention, rule = SWEEP[option]
            runner = None
            with measure.section(sweep, option, self.device) as entry:
                flops = model_flops(self._shape_only(shape, layers, attention), self.args.rank)
                plan = sweep_plan(rule, layers)
                runner = self._ours(shape, layers, plan, fused_lora=fused, attn_implementation=attention)
                entry.update(fused_lora=fused, attention=attention, layer_recompute=plan,
                             linear_attention_kernel=runner.model.linear_attention_kernel,
                             elementwise_kernels=runner.model.elementwise_kernels)
                entry.update(parameter_bytes(runner.model))
                if rule in ("layer", "none"):  # what the plan can express: all or no layer checkpointed
                    with measure.section(entry, "plan", self.device) as planned:
                        planned["predicted_tensors_gib"] = plan_tensors_gib(
                            shape.config, shape.arch, layers, inputs.num_tokens, layers if rule == "layer" else 0,
                            runner.model.linear_attention_kernel or "fla", self.args.rank, self.args.chunk)
                entry.update(self.measure_update(runner, inputs, flops.train_step("critic", seq_lens, scored)
                                                 + flops.train_step("actor", seq_lens, scored),
                                                 f"{name} sweep {option} ({layers} layers)",
                                                 reps=self.args.sweep_reps, warmup=self.args.sweep_warmup))
            runner = None  # also after a failure, before the next option builds its model
            measure.free_memory(self.device)
            self.save()

    def _run_full(self, name, shape, path, layers, inputs, layer_recompute, tiers) -> dict:
        """The full stack's update (and probes, forward passes, weight sync) on ``path``; ours
        built with ``layer_recompute`` and ``tiers`` (``_fit_plan``)."""
        entry: dict = {"layers": layers}
        seq_lens = [int(s.numel()) for s in inputs.sequences]
        scored = sum(n - p for n, p in zip(seq_lens, inputs.prompt_lengths))
        self._allocated_before = measure.allocated_gib(self.device)
        runner = base = None
        attention = "sdpa_varlen" if path == "ours" else "sdpa"
        with measure.section(entry, "update", self.device) as update:
            flops = model_flops(self._shape_only(shape, layers, attention), self.args.rank)
            entry["flops_model"] = vars(flops)
            if path == "ours":
                runner = self._ours(shape, layers, layer_recompute, tiers=tiers)
                entry["options"] = {"fused_lora": True, "attention": attention,
                                    "layer_recompute": runner.model.layer_recompute, "recompute_tiers": len(tiers),
                                    "sequence_layout": runner.model.sequence_layout,
                                    "linear_attention_kernel": runner.model.linear_attention_kernel,
                                    "elementwise_kernels": runner.model.elementwise_kernels}
            else:
                base = build_model(shape, device=self.device, dtype=self.dtype, attn_implementation=attention,
                                   layers=layers, seed=self.args.seed)
                runner = BaselineRunner(base, self.args.rank, self.args.tokens, logits_bytes_limit=self._logits_limit())
                entry["options"] = {"attention": attention, "micro_batch_sequences": runner.micro_batch_size(inputs),
                                    "checkpoint_layers": layers, "logits": "full",
                                    "linear_attention": "transformers' torch reference" if shape.arch == "qwen3_5" else None}
            self.save()
            tuned_before = tuned_entries_or_none()
            update.update(self.measure_update(runner, inputs, flops.train_step("critic", seq_lens, scored)
                                              + flops.train_step("actor", seq_lens, scored),
                                              f"{name} {path} ({layers} layers)",
                                              warmup=1 if path == "ours" else self.args.baseline_warmup))
            update["fla_tuned_entries"] = {"before": tuned_before, "after": tuned_entries_or_none()}
            self.save()
            if path == "ours" and runner.model.linear_attention_kernel == "fla" and "autotune" in self.sections:
                with measure.section(entry, "autotune", self.device) as probe:
                    probe.update(autotune_probe(runner, inputs))
                    probe["configs"] = fla_configs()
                    self.log(f"{name} autotune probe: {json.dumps({k: v for k, v in probe.items() if k != 'configs'})}")
                self.save()
            if path == "ours" and "profile" in self.sections and not self.out_of_time():
                with measure.section(entry, "profile", self.device) as prof:
                    prof.update(profile_micro_step(runner, inputs))
                    self.log(f"{name} profile: " + ", ".join(f"{k} {v['share']:.0%}" for k, v in
                                                             prof.get("categories", {}).items()))
                self.save()
            if "forward" in self.sections and not self.out_of_time():
                runner.zero_grad()
                with measure.section(entry, "forward", self.device) as fwd:
                    fwd_inputs = self._inputs(shape, self.args.forward_tokens, self.args.seed + 1)
                    fwd.update(self.measure_forward(runner, fwd_inputs, flops, f"{name} {path}"))
                self.save()
            if path == "ours":
                self._sync_section(name, entry, runner)
        del runner, base
        return entry

    def _logits_limit(self) -> Optional[float]:
        if self.device.type != "cuda":
            return None
        capacity = torch.cuda.get_device_properties(self.device).total_memory
        return 0.5 * (capacity - torch.cuda.memory_allocated(self.device))

    def _batch_inputs(self, shape) -> tuple:
        """``(inputs, mini-batches of trajectory indices, epochs, budgets, what it is)``: the
        recorded batch with its run's update shape (``--batch-from``), else ``--batch-sequences``
        sampled ones as one mini-batch, one epoch, under ``--batch-budgets``."""
        recorded = self.args.recorded_batch
        if recorded is not None:
            inputs = recorded_ppo_inputs(recorded, self.device, seed=self.args.seed)
            about = {"source": recorded.source, "world_size": recorded.world_size}
            return inputs, recorded.mini_batch_indices(), recorded.epochs, [recorded.budget], about
        trajectories = sample_batch(self.args.seed, self.args.batch_sequences, scale=self.scale)
        inputs = ppo_inputs(trajectories, shape.vocab_size, self.device, seed=self.args.seed)
        longest = max(int(s.numel()) for s in inputs.sequences)
        budgets = [b for b in (int(x) for x in self.args.batch_budgets.split(",")) if longest <= b <= self.args.tokens]
        return inputs, [list(range(len(trajectories)))], 1, budgets or [self.args.tokens], {"source": "sampled"}

    def run_batch(self, name: str, shape, layers: int) -> dict:
        """The batch benchmark (``batch.py``): ours under ``auto``'s plan at the largest of the
        budgets whose plan fits (``_fit_plan``, the card's free memory capped to
        ``--batch-cap-gib``), then the baseline; the batch and its shape from ``_batch_inputs``."""
        inputs, chunks, epochs, budgets, about = self._batch_inputs(shape)
        seq_lens = [int(s.numel()) for s in inputs.sequences]
        scored = sum(n - p for n, p in zip(seq_lens, inputs.prompt_lengths))
        out: dict = {"layers": layers, "sequences": len(seq_lens), "real_tokens": sum(seq_lens),
                     "longest": max(seq_lens), "loss_tokens": int(inputs.response_mask.sum()),
                     "cap_gib": self.args.batch_cap_gib, "mini_batches": len(chunks), "epochs": epochs, **about}
        cap = self.args.batch_cap_gib or None
        peak_tflops = self.peak_tflops

        def build(plan, tiers, budget, path):
            def make():
                attention = "sdpa_varlen" if path == "ours" else "sdpa"
                bare = self._shape_only(shape, layers, attention)
                out.setdefault("flops", epochs * model_flops(bare, self.args.rank).train_step("actor", seq_lens, scored))
                if path == "ours":
                    runner = self._ours(shape, layers, plan, budget, tiers=tiers)
                    cut = lambda rows: runner.micro_batches(rows, update=True)  # noqa: E731
                    info = {"budget": budget, "layer_recompute": runner.model.layer_recompute,
                            "recompute_tiers": len(tiers), "elementwise_kernels": runner.model.elementwise_kernels,
                            "attention_length_bucket": runner.model.attention_length_bucket}
                else:
                    base = build_model(shape, device=self.device, dtype=self.dtype, attn_implementation=attention,
                                       layers=layers, seed=self.args.seed)
                    runner = BaselineRunner(base, self.args.rank, self.args.tokens, logits_bytes_limit=self._logits_limit())
                    cut = runner.micro_batches
                    info = {"micro_batch_sequences": runner.micro_batch_size(inputs)}
                minis = [[[chunk[i] for i in micro] for micro in cut(inputs.rows(chunk))] for chunk in chunks if chunk]
                return runner, ActorUpdate(runner, inputs, minis, epochs), info
            return make

        for path in self.paths:
            if self.out_of_time():
                out[path] = {"skipped": "deadline"}
                continue
            if path == "ours":
                out["choice"], tiers = self._fit_plan(shape, layers, budgets, cap_gib=cap)
                plan, budget = out["choice"]["plan"], out["choice"].get("tokens", max(budgets))
                attempts = [("auto" if plan else "every layer checkpointed", build(plan, tiers, budget, path))]
                if tiers:  # the plan's warm-up over the cap: every layer checkpointed at the same budget
                    attempts.append(("every layer checkpointed", build(None, [], budget, path)))
            else:
                attempts = [("baseline", build(None, [], self.args.tokens, path))]
            runner, update, tried = run_with_fallbacks(attempts, cap if path == "ours" else None, self.log)
            out[path] = self._time_batch(name, path, runner, update, inputs, out["flops"] if update else 0.0,
                                         peak_tflops) | {"attempts": tried}
            runner = update = None
            measure.free_memory(self.device)
            self.save()
        ours, baseline = out.get("ours", {}).get("update", {}), out.get("baseline", {}).get("update", {})
        if ours.get("tokens_per_s") and baseline.get("tokens_per_s"):
            out["speedup"] = ours["tokens_per_s"] / baseline["tokens_per_s"]
        return out

    def _time_batch(self, name: str, path: str, runner, update, inputs, flops: float, peak_tflops) -> dict:
        """The timed updates of one path of the batch benchmark (ours may update the same batch
        again, ``--batch-repeats``: ``update``, then ``update_2``, ...), and ours' profile."""
        entry: dict = {}
        if update is None:
            return entry
        for repeat in range(1, (max(self.args.batch_repeats, 1) if path == "ours" else 1) + 1):
            section, label = ("update", "") if repeat == 1 else (f"update_{repeat}", f" update {repeat}")
            with measure.section(entry, section, self.device) as timed:
                timed.update(timed_update(update, flops, peak_tflops))
                if isinstance(runner, OursRunner) and runner.model.recompute_tiers:
                    timed["recompute_per_micro_step"] = runner.take_replays()
                self.log(f"{name} batch {path}{label}: {timed['seconds']:.2f} s, {timed['tokens_per_s']:.0f} "
                         f"tok/s, MFU {timed.get('useful_mfu', 0):.3f}, peak {timed['peak_gib']}")
        if isinstance(runner, OursRunner):  # what fit's step report shows beside its own figures
            entry["attention_backends"] = runner.model.attention_backends()
            self.log(f"{name} batch {path}: attention ran {', '.join(entry['attention_backends']) or '-'}")
            self._against_the_run(name, entry, runner.model.resolved_keys())
        if path == "ours" and "profile" in self.sections and not self.out_of_time():
            with measure.section(entry, "profile", self.device) as prof:
                prof.update(profile_micro_step(runner, inputs, update.largest))
                self.log(f"{name} batch profile: " + ", ".join(f"{k} {v['share']:.0%}" for k, v in
                                                               prof.get("categories", {}).items()))
        if path == "ours" and "update-profile" in self.sections and self.device.type == "cuda" \
                and not self.out_of_time():
            with measure.section(entry, "update_profile", self.device) as prof:
                prof.update(profile_call(update)[1])
                self.log(f"{name} batch update profiled: {prof['wall_s_under_profiler']:.2f} s, kernels "
                         f"{prof['device_s']:.2f} s, the card idle {prof['idle_share']:.1%}, allocator {prof['allocator']}")
        if path == "ours":  # after the updates: the adapters are no longer zero, so the merge's check bites
            self._sync_section(name, entry, runner)
        return entry

    def _sync_section(self, name: str, entry: dict, runner) -> None:
        """The ``sync`` section: the weight sync's paths timed and the merge kernel checked on
        this model (``sync.measure_weight_sync``), into ``entry["weight_sync"]``."""
        if "sync" not in self.sections or self.out_of_time():
            return
        with measure.section(entry, "weight_sync", self.device) as sync:
            sync.update(measure_weight_sync(runner.model, self.device, self.args.bucket_mb * 2**20,
                                            self.results.get("copy_bandwidth", {}).get("gbps")))
            self.log(f"{name} weight sync: kernel check {json.dumps(sync.get('kernel_check'))}; "
                     f"{json.dumps({k: v for k, v in sync.items() if k != 'kernel_check'})[:300]}")

    def _against_the_run(self, name: str, entry: dict, resolved: dict) -> None:
        """Where the batch is a run's (``--batch-from``): the kernels our model resolved here
        against those the run's model resolved (``run.json``), each difference logged and kept
        (``resolved_unlike_the_run``): the replay then measured other kernels than the step ran."""
        recorded = self.args.recorded_batch
        if recorded is None:
            return
        entry["resolved_unlike_the_run"] = {key: list(pair) for key, pair in recorded.differs_from(resolved).items()}
        for key, (here, there) in entry["resolved_unlike_the_run"].items():
            self.log(f"{name} batch: {key} resolved to {here!r} here, {there!r} in the run: not the step's kernels")

    # ------------------------------------------------------------------ driver
    @property
    def paths(self) -> list[str]:
        return [p for p in ("ours", "baseline") if p in self.args.paths.split(",")]

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
    bench = Bench(args, argv)
    results = bench.run()
    print(markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
