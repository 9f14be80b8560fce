"""Where the trainer's and the engine's per-token log-probs part: the same engine-sampled tokens
scored by the engine (as sampled, and again through its prefill path) and by the trainer in
several numerics, each against a float32 reference, every pair's mean and largest |Δ log p|.

    atlas-lightning bench gap-sources --out gap.json -- experiment=h200-8b model.path=/tmp/qwen3_6_27b
    atlas-lightning bench gap-sources --requests 2 --prompt-tokens 16 --max-tokens 8 -- \\
        experiment=tiny-cpu model.path=$HOME/.cache/atlas-lightning/tiny-model       # the CPU, float32

Both sides are built as ``fit`` builds them from the overrides. The engine
(``rollout.factory.build_engine``) runs in a child process, so that its card memory is surely gone
before the trainer's models are built: it samples ``--requests`` answers of ``--max-tokens`` to
seeded random prompts of ``--prompt-tokens`` ids at ``rollout.temperature`` (the full
distribution: top-p and top-k off, as the trainer scores it), keeps its log-probs of the sampled
tokens (``engine_sampled``) and scores each whole sequence again through its prefill
(``engine_prefill``, temperature 1). The parent then scores the same tokens with the trainer's
``ActorCritic`` (``models.build.build_actor_critic``) in turn: ``trainer`` (as configured: the
bf16 path ``fit`` runs, fla's kernels on a card), ``trainer_torch`` (the same with
``model.linear_attention_kernel=torch``; a hybrid whose trainer runs fla only) and ``reference``
(float32, torch's kernels, TF32 off), at the rollout temperature and, where that is not 1, at 1
for the prefill. ``engine_sampled`` against ``trainer`` is what ``fit`` logs as
``rollout/logprob_diff_mean`` (with fresh adapters). JSON on stdout (``--out``: also a file),
a table on stderr; ``--scores FILE``: the sequences and every source's per-token log-probs.

Why: on the card the two sides part by a mean |Δ log p| of 0.065 on the 24-layer Qwen3.5-shaped
hybrid (Gated DeltaNet + attention), more than the dense model's 0.053
(``bench/depth_rounding.py``: bf16 rounding alone grows with the hybrid's depth). Whether the
engine, the trainer's fla kernels or bf16 itself carries it decides what to fix.

How to read it: if engine-vs-reference is about trainer-vs-reference and engine-vs-trainer is
about sqrt(2) times that, the gap is both sides' bf16 rounding (independent errors of one size)
and no kernel is wrong; if trainer-vs-reference is clearly larger than trainer_torch-vs-reference,
the trainer's fla kernels carry part of it; if engine-vs-reference is clearly larger than
trainer-vs-reference, the engine carries it. The prefill rows tell the engine's sampling path from
its prefill kernels (a hybrid's engine decodes Gated DeltaNet recurrently and prefills in chunks).
One caution: a checkpoint stored in bf16 (as released ones are) gives the float32 reference the
very weights both sides run; one stored in float32 (the tiny model) has its weights rounded to
bf16 once, for both sides alike, an error they share, so there engine-vs-trainer comes out below
sqrt(2) times the others (the tiny model in bf16 on a CPU: 0.015 against 0.017 and 0.019).

Seen on an H100 (2026-12-07, ``bench/results/h100-gap-sources-*.json``, bf16 folders): at 16, 24
and 32 hybrid layers engine-vs-trainer 0.052, 0.065, 0.075, engine-vs-reference 0.044, 0.055,
0.063, trainer-vs-reference 0.049, 0.060, 0.072 with fla and 0.048, 0.060, 0.070 with torch's
kernel; the dense 8B shape (36 layers) 0.061, 0.047, 0.055. Both sides' bf16, growing as sqrt(L),
no kernel wrong; engine-vs-trainer below sqrt(2) times the others, so part of the two sides'
rounding is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from atlas_lightning.run.exit_codes import exit_code

if TYPE_CHECKING:
    import torch

PROGRAM = "atlas-lightning bench gap-sources"
#: every source of log-probs, in the order the report pairs them
SOURCES = ("engine_sampled", "engine_prefill", "trainer", "trainer_torch", "reference")
#: each trainer variant: its changes to ``cfg.model`` (the reference also runs with TF32 off)
VARIANTS = {
    "trainer": {},
    "trainer_torch": {"linear_attention_kernel": "torch"},
    "reference": {"dtype": "float32", "linear_attention_kernel": "torch", "elementwise_kernels": "torch"},
}
#: prompt ids are drawn from [LOWEST_ID, min(vocab, HIGHEST_ID)): the lowest ids are often special
#: tokens, and every vocabulary this runs on has ordinary tokens up to 32000
LOWEST_ID, HIGHEST_ID = 10, 32000


def _say(message: str) -> None:
    print(f"[gap_sources {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _write_json(path: str | os.PathLike, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (a non-finite log-prob written as JSON's extension)."""
    from atlas_lightning.store.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


# -- the engine phase (a child process) ------------------------------------------------------------


def random_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """``count`` prompts of ``length`` ids in ``[LOWEST_ID, min(vocab, HIGHEST_ID))``, prompt ``i``
    drawn from a generator seeded with ``i`` (the same prompts on every run)."""
    import torch

    high = min(vocab, HIGHEST_ID)
    return [torch.randint(LOWEST_ID, high, (length,), generator=torch.Generator().manual_seed(index)).tolist()
            for index in range(count)]


def _generate(engine, prompts: list[list[int]], max_tokens: int, temperature: float) -> list:
    """Each prompt's sampled answer (seed: its index), in the prompts' order; a failed request raises."""
    from atlas_lightning.rollout.engine import GenerationRequest, SamplingSpec

    results = engine.generate([GenerationRequest(f"gap-{index}", tuple(prompt), SamplingSpec(
        max_tokens=max_tokens, temperature=temperature, seed=index)) for index, prompt in enumerate(prompts)])
    failed = [result.error for result in results if result.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} requests failed: {failed[0]}")
    return results


def engine_phase(path: Path, overrides: list[str], requests: int, prompt_tokens: int, max_tokens: int) -> None:
    """Build the engine as ``fit`` does, sample and prefill-score (module doc) and write the
    sequences and the engine's log-probs to ``path`` (JSON, atomically)."""
    import torch
    import torch.distributed as dist

    from atlas_lightning.config import compose
    from atlas_lightning.models.build import causal_lm_config
    from atlas_lightning.rollout.engines.server_http import free_port
    from atlas_lightning.rollout.factory import build_engine

    if torch.cuda.is_available():  # fit's world-1 group on a card (Lightning's); a CPU fit has none
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    cfg = compose(overrides)
    temperature = float(cfg.rollout.temperature)
    prompts = random_prompts(requests, prompt_tokens, int(causal_lm_config(cfg.model.path).vocab_size))
    started = time.monotonic()
    engine = build_engine(cfg)
    built = time.monotonic()
    _say(f"engine {type(engine).__name__} on {cfg.model.path} up in {built - started:.1f} s; sampling")
    results = _generate(engine, prompts, max_tokens, temperature)
    generated = time.monotonic()
    prefill = [engine.prompt_logprobs(prompt + result.token_ids)[len(prompt) - 1:]
               for prompt, result in zip(prompts, results)]
    prefilled = time.monotonic()
    _write_json(path, {
        "temperature": temperature, "prompts": prompts, "responses": [r.token_ids for r in results],
        "sampled_logprobs": [r.logprobs for r in results], "prefill_logprobs": prefill,
        "engine": {"class": type(engine).__name__, "enforce_eager": bool(cfg.rollout.enforce_eager),
                   "seconds": {"start": built - started, "generate": generated - built,
                               "prefill": prefilled - generated}}})
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_engine_phase(path: Path, args: argparse.Namespace) -> int:
    """The engine phase in a child process, its stdout onto this one's stderr (stdout is the
    report); the child's exit code (its traceback, if any, is on stderr)."""
    command = [sys.executable, "-m", "atlas_lightning.bench.gap_sources", "--engine-phase", str(path),
               "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
               "--max-tokens", str(args.max_tokens), "--", *args.overrides]
    return subprocess.run(command, stdout=2).returncode


# -- the trainer phase (this process) --------------------------------------------------------------


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """float32 matmuls and convolutions without TF32 inside; the settings as they were after."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def score(model, prompts: list[list[int]], responses: list[list[int]], temperature: float, batch: int,
          device) -> torch.Tensor:
    """``model``'s actor log-probs of every response token at ``temperature``, ``(N,)`` float64 on
    the CPU, sequence by sequence (packed order), ``batch`` sequences a forward."""
    import torch

    from atlas_lightning.models.packing import pack_sequences

    parts = []
    for start in range(0, len(prompts), batch):
        group = range(start, min(start + batch, len(prompts)))
        sequences = [torch.tensor(prompts[i] + responses[i], dtype=torch.int64) for i in group]
        packed = pack_sequences(sequences, [len(prompts[i]) for i in group]).to(device)
        with torch.no_grad():
            log_probs, _ = model.actor_forward(packed, temperature=temperature, compute_entropy=False)
        parts.append(log_probs.double().cpu())
    return torch.cat(parts)


def _layers(model) -> dict:
    """The decoder's depth and its layer types, counted (transformers' ``layer_types`` where the
    config has it)."""
    config = model.hf_model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    return {"layers": len(model.decoder_layers()), "layer_types": dict(Counter(types)) if types else None}


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":  # the next variant's build gets the card back
        torch.cuda.empty_cache()


def score_variant(cfg, name: str, data: dict, temperatures: list[float], batch: int, device) -> tuple[dict, dict]:
    """Variant ``name``'s model (``VARIANTS``) built as ``fit`` builds it, scored at each
    temperature: ``({temperature: (N,) log-probs}, its facts and seconds)``; freed after."""
    import torch
    from omegaconf import OmegaConf

    from atlas_lightning.models.build import build_actor_critic

    model_cfg = OmegaConf.merge(cfg.model, VARIANTS[name])
    exact = exact_float32() if name == "reference" else contextlib.nullcontext()
    with exact:
        started = time.monotonic()
        model = build_actor_critic(model_cfg, seed=int(cfg.seed), device=device)
        model.eval()
        if device.type == "cuda":
            torch.cuda.synchronize()
        built = time.monotonic()
        scores = {t: score(model, data["prompts"], data["responses"], t, batch, device) for t in temperatures}
        scored = time.monotonic()
    facts = {"dtype": str(model_cfg.dtype), "linear_attention_kernel": model.linear_attention_kernel,
             "elementwise_kernels": model.elementwise_kernels, "build_s": built - started,
             "score_s": scored - built, **_layers(model)}
    if name == "reference":
        facts["tf32"] = False
    del model
    _free(device)
    _say(f"{name}: built in {facts['build_s']:.1f} s, scored in {facts['score_s']:.1f} s")
    return scores, facts


def _skip_torch_variant(trainer: dict) -> Optional[str]:
    """Why ``trainer_torch`` would tell nothing apart from ``trainer`` (None: it runs)."""
    if trainer["linear_attention_kernel"] is None:
        return "dense model: no linear-attention layers"
    if trainer["linear_attention_kernel"] == "torch":
        return "the trainer runs torch's linear-attention kernel already (no fla here)"
    return None


def scored_temperatures(data: dict) -> list[float]:
    """The temperatures every source is compared at: the rollout's, then 1 (the engine's prefill's)
    where that differs."""
    return [data["temperature"]] + ([1.0] if data["temperature"] != 1.0 else [])


def trainer_phase(cfg, data: dict, batch: int) -> tuple[dict, dict]:
    """Every variant's scores: ``({(variant, temperature): (N,) log-probs}, {variant: facts})``."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    temperatures = scored_temperatures(data)
    scores, facts = {}, {}
    for name in VARIANTS:
        skipped = _skip_torch_variant(facts["trainer"]) if name == "trainer_torch" else None
        if skipped:
            facts[name] = {"skipped": skipped}
            continue
        by_temperature, facts[name] = score_variant(cfg, name, data, temperatures, batch, device)
        scores.update(((name, t), values) for t, values in by_temperature.items())
    return scores, facts


# -- the report -----------------------------------------------------------------------------------


def engine_scores(data: dict) -> dict:
    """The engine's log-probs in packed order: ``{(source, temperature): (N,) float64}``."""
    import torch

    def flat(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor([value for row in rows for value in row], dtype=torch.float64)

    return {("engine_sampled", data["temperature"]): flat(data["sampled_logprobs"]),
            ("engine_prefill", 1.0): flat(data["prefill_logprobs"])}


def pairs(scores: dict, temperatures: list[float]) -> list[dict]:
    """Every two sources scored at one temperature (``SOURCES``' order): the mean and largest
    |Δ log p| over the response tokens, and how many there are."""
    rows = []
    for temperature in temperatures:
        present = [source for source in SOURCES if (source, temperature) in scores]
        for a, b in itertools.combinations(present, 2):
            gap = (scores[a, temperature] - scores[b, temperature]).abs()
            rows.append({"a": a, "b": b, "temperature": temperature, "mean": gap.mean().item(),
                         "max": gap.max().item(), "tokens": gap.numel()})
    return rows


def table(rows: list[dict]) -> str:
    """The pairs, one a line, for a reader."""
    lines = [f"{'pair':34} {'T':>5} {'mean |Δ|':>10} {'max |Δ|':>10} {'tokens':>7}"]
    lines += [f"{row['a'] + ' - ' + row['b']:34} {row['temperature']:5.3g} {row['mean']:10.4g} {row['max']:10.4g} "
              f"{row['tokens']:7d}" for row in rows]
    return "\n".join(lines)


def per_sequence(scores: dict, data: dict) -> dict:
    """``--scores``' content: the sequences and each source's log-probs, one list a response."""
    lengths = [len(response) for response in data["responses"]]
    return {"temperature": data["temperature"], "prompts": data["prompts"], "responses": data["responses"],
            "scores": [{"source": source, "temperature": temperature,
                        "logprobs": [part.tolist() for part in values.split(lengths)]}
                       for (source, temperature), values in scores.items()]}


def check_options(args: argparse.Namespace) -> None:
    """``InputError`` naming the first option out of range."""
    from atlas_lightning.errors import InputError

    for option in ("requests", "prompt_tokens", "max_tokens", "score_batch"):
        if getattr(args, option) < 1:
            raise InputError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")


def check_config(cfg, args: argparse.Namespace) -> None:
    """``InputError`` for a run the engine cannot serve or the trainer cannot score alike."""
    from atlas_lightning.errors import InputError

    if float(cfg.rollout.temperature) <= 0:
        raise InputError(f"rollout.temperature={cfg.rollout.temperature}: greedy decoding has no sampled "
                         f"distribution to compare; set a temperature above 0")
    if args.prompt_tokens + args.max_tokens > int(cfg.rollout.max_model_len):
        raise InputError(f"--prompt-tokens {args.prompt_tokens} + --max-tokens {args.max_tokens} exceed "
                         f"rollout.max_model_len={cfg.rollout.max_model_len}")


def report(cfg, args: argparse.Namespace, data: dict, variants: dict, rows: list[dict], seconds: dict) -> dict:
    """The report (module doc): the model and engine facts, each variant's, the pairs, the seconds."""
    import torch

    trainer = variants["trainer"]
    return {
        "model": {"path": str(cfg.model.path), "dtype": str(cfg.model.dtype), "head_dtype": str(cfg.model.head_dtype),
                  "attn_implementation": str(cfg.model.attn_implementation), "layers": trainer["layers"],
                  "layer_types": trainer["layer_types"]},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "engine": {**data["engine"], "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                   "max_tokens": args.max_tokens, "temperature": data["temperature"],
                   "response_tokens": sum(map(len, data["responses"]))},
        "variants": variants,
        "pairs": rows,
        "seconds": seconds,
    }


def run(args: argparse.Namespace) -> int:
    """Check the options, compose, run both phases and report (module doc). A bad option or
    override raises (``InputError``, ``ConfigError``) before the engine starts."""
    from atlas_lightning.config import compose

    started = time.monotonic()
    check_options(args)
    cfg = compose(args.overrides)
    check_config(cfg, args)
    composed = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gap-sources-") as folder:
        code = run_engine_phase(Path(folder) / "engine.json", args)
        if code != 0:
            print(f"{PROGRAM}: the engine phase exited {code} (its output is above)", file=sys.stderr)
            return code
        data = json.loads((Path(folder) / "engine.json").read_text())
    engine_done = time.monotonic()
    scores, variants = trainer_phase(cfg, data, args.score_batch)
    scores.update(engine_scores(data))
    rows = pairs(scores, scored_temperatures(data))
    seconds = {"compose": composed - started, "engine_phase": engine_done - composed,
               "trainer_phase": time.monotonic() - engine_done, "total": time.monotonic() - started}
    result = report(cfg, args, data, variants, rows, seconds)
    if args.scores:
        _write_json(args.scores, per_sequence(scores, data))
    if args.out:
        _write_json(args.out, result)
    print(table(rows), file=sys.stderr)
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="sampled answers, each to its own prompt")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="each random prompt's length")
    parser.add_argument("--max-tokens", type=int, default=512, help="each answer's longest length")
    parser.add_argument("--score-batch", type=int, default=4, help="sequences a trainer forward (bounds its memory)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    parser.add_argument("--scores", type=Path, default=None,
                        help="write the sequences and every source's per-token log-probs here (JSON)")
    parser.add_argument("--engine-phase", type=Path, default=None, metavar="FILE",
                        help="internal: run only the engine phase, writing its sequences to FILE")
    parser.add_argument("overrides", nargs="*", help="fit overrides, after --")
    args = parser.parse_args(argv)
    if args.engine_phase is not None:  # the child run_engine_phase starts; the parent checked the options
        engine_phase(args.engine_phase, args.overrides, args.requests, args.prompt_tokens, args.max_tokens)
        return 0
    return exit_code(PROGRAM, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
