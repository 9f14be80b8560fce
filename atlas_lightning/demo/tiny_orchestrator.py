"""``build_tiny_orchestrator``: the tiny model warm-started by SFT on scripted tool-call episodes.

A random tiny model never writes a valid tool call, so PPO would have nothing to learn from. This
module fine-tunes it (all weights, plain torch, AdamW) on demonstrations rendered by the runtime
(``demos.py``: varied explore counts 0..8, varied submit choices), with the loss on generated
tokens only. The result serves the embedded default (``experiment=tiny-cpu``): it emits valid
Hermes calls, explores a varied number of times and submits a revealed answer, so PPO starts with
a real decision to learn (when to stop, which answer).

Recipe (``SFTRecipe``; ``DEFAULT_RECIPE``): the bundled sample's train questions (``sample_seed``,
generated in memory: the same questions ``atlas-lightning data sample`` writes), 4 demonstrations
each (1,280 in all, different reveal orders), 800 AdamW steps (lr 2e-3) over shuffled batches of
4 of similar length (2.5 epochs), right-padded (causal attention never lets a real token see a
pad, so no attention mask is needed), linear warm-up then cosine decay, gradient clipping. Logits
are computed only where the loss is. Why so many steps: the call format is learnt within ~50
steps, but copying a revealed candidate's answer into the submit (an induction-like skill: GPQA
answers are otherwise a constant letter, below chance) appears only after ~500-700 steps. About
4 minutes of training on two idle CPU cores (0.28 s a step); much longer when the cores are shared.

Determinism: the same ``seed``, base, recipe, library versions, CPU and torch thread count give
a byte-identical ``model.safetensors`` (nothing here draws from an RNG during training: the order
comes from ``random.Random(seed)`` and the model has no dropout; CPU kernels reduce in a fixed
order for a fixed instruction set and thread count). Another CPU or thread count changes the last
bits, and the weights' fingerprints with them, but not the losses beyond ``LOSS_RTOL``.

Output (``out``, the layout of ``tiny_model.build_tiny_model``): ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja`` (the tokenizer files copied byte for byte from the base), plus
``sft_summary.json`` (demonstrations, steps, losses, the quick evaluation, timings). Written in a
staging folder beside ``out`` (``.<out's name>.staging-*``) and renamed into place whole, so ``out``
is never half-built; the staging folder a killed build left is removed by the next build
(``store/staging.py``).

Who calls it: the CLI (``atlas-lightning data tiny-orchestrator --out DIR [--seed N]``; ``make
demo`` builds it into the cache once), tests.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from atlas_lightning.demo.demos import Demo, build_demos
from atlas_lightning.demo.sample import SAMPLE_COUNTS, generate_questions
from atlas_lightning.questions.schema import Question
from atlas_lightning.demo.tiny_model import MODEL_FILES
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.env.terminal import TERMINAL_REASONS
from atlas_lightning.config import LoopLimits
from atlas_lightning.store.files import sha256_file
from atlas_lightning.store.staging import replace_folder, staging_folder

log = logging.getLogger(__name__)

#: The embedded default's loop limits and runtime (``conf/rollout/vllm_cpu.yaml``; a test keeps
#: them equal to the composed ``experiment=tiny-cpu``): demonstrations must fit them.
TINY_CPU_LIMITS = LoopLimits(max_response_length=1024, max_tokens_per_turn=128, max_model_len=2048)
TINY_CPU_RUNTIME = RuntimeConfig(max_explores=8, max_turns=9)
#: The reward's lambda of ``experiment=tiny-cpu`` (1.0: spending matters there), for the summary's objective.
COST_PER_USD = 1.0
SUMMARY_FILE = "sft_summary.json"
#: After which training steps the build fingerprints its weights (``weights_sha256``), kept in
#: the summary under ``TRAJECTORY_KEY``: the exact record of one machine's build (another CPU's
#: kernels round the last bits differently; see ``LOSS_RTOL``).
TRAJECTORY_STEPS = (1, 10, 40, 100, 200, 400, 800)
TRAJECTORY_KEY = "weights_sha256_after_step"
#: The summary's losses of every tenth step (rounded to 5 decimals), machine-independent
#: within ``LOSS_RTOL``: what a rebuild or a replay of the first steps is compared with.
LOSSES_KEY = "loss_every_10_steps"
#: How closely a rebuild's losses must follow the shipped build's, relative. The same code on
#: another CPU or thread count rounds differently: measured on the first 41 steps (AVX-512 with
#: AMX against the shipped machine, then forced to AVX2 and SSE4.2, one thread and two), the
#: losses moved by at most 2e-5 relative. A change of the build's path moves them far more: the
#: learning rate 1% higher moved step 11's loss by 9e-3 and step 21's by 4e-3.
LOSS_RTOL = 1e-4
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class SFTRecipe:
    """How the warm start is trained and checked. ``demos_per_question`` demonstrations of each of
    the first ``train_questions`` train questions per benchmark (``None``: all); ``steps``
    optimizer steps of ``batch_size`` demonstrations; ``eval_questions`` validation questions per
    benchmark in the quick check (0: none); ``val_loss_questions`` validation questions per
    benchmark whose demonstrations give ``val_demo_loss`` (``None``: all). The checks read the
    trained model and never change it."""

    demos_per_question: int = 4
    train_questions: int | None = None
    steps: int = 800
    batch_size: int = 4
    lr: float = 2e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_questions: int = 8
    val_loss_questions: int | None = None

    def __post_init__(self) -> None:
        for name in ("demos_per_question", "steps", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"SFTRecipe.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_questions"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"SFTRecipe.{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("train_questions", "val_loss_questions"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"SFTRecipe.{name} must be None or an int >= 1, got {value!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"SFTRecipe.lr must be a finite number > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"SFTRecipe.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


DEFAULT_RECIPE = SFTRecipe()


# ----------------------------------------------------------------------------- training


def batch_order(lengths: Sequence[int], batch_size: int, steps: int, seed: int, window: int = 8) -> list[list[int]]:
    """Demo indices of each of ``steps`` steps (``batch_size`` each), from the demos' ``lengths``.

    A stream of epochs, each a ``random.Random(seed)`` shuffle of all indices (every index once
    an epoch), is cut into windows of ``window`` batches; within a window the demos are sorted by
    length before being cut into batches, and the batches are shuffled. Batches of similar
    lengths waste less compute on padding; the windows keep the order close to random.
    """
    count = len(lengths)
    if count < 1:
        raise ValueError("batch_order: no demonstrations to train on")
    if batch_size < 1 or steps < 1 or window < 1:
        raise ValueError(f"batch_order: batch_size={batch_size}, steps={steps}, window={window} must be >= 1")
    rng = random.Random(f"atlas-sft-order/{seed}")
    span = batch_size * window
    needed = -(-steps * batch_size // span) * span
    stream: list[int] = []
    while len(stream) < needed:
        epoch = list(range(count))
        rng.shuffle(epoch)
        stream.extend(epoch)
    batches: list[list[int]] = []
    for begin in range(0, needed, span):
        chunk = sorted(stream[begin:begin + span], key=lambda i: lengths[i])  # stable: ties keep stream order
        cut = [chunk[i:i + batch_size] for i in range(0, span, batch_size)]
        rng.shuffle(cut)
        batches.extend(cut)
    return batches[:steps]


def collate(demos: Sequence[Demo], pad_id: int):
    """``(input_ids, targets)``: ``(B, T)`` right-padded with ``pad_id``, and ``(B, T-1)`` next
    tokens with ``-100`` wherever no loss is taken (prompt, tool responses, padding)."""
    import torch

    width = max(len(d.input_ids) for d in demos)
    input_ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    targets = torch.full((len(demos), width - 1), -100, dtype=torch.long)
    for row, demo in enumerate(demos):
        ids = torch.tensor(demo.input_ids, dtype=torch.long)
        input_ids[row, : len(ids)] = ids
        trained = torch.tensor(demo.loss_mask[1:], dtype=torch.bool)
        targets[row, : len(ids) - 1] = torch.where(trained, ids[1:], torch.full_like(ids[1:], -100))
    return input_ids, targets


def demo_loss(model, input_ids, targets):
    """Token-mean cross-entropy of the trained tokens (``targets != -100``), in nats. Logits are
    formed only at those positions (the vocabulary projection of every prompt token is waste)."""
    import torch

    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
    where = targets != -100
    logits = model.lm_head(hidden[where])
    return torch.nn.functional.cross_entropy(logits.float(), targets[where])


def learning_rate(step: int, recipe: SFTRecipe) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` (step is 0-based)."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    span = max(1, recipe.steps - recipe.warmup_steps)
    progress = min(1.0, (step - recipe.warmup_steps) / span)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_on_demos(model, demos: Sequence[Demo], recipe: SFTRecipe, seed: int, pad_id: int,
                   on_step: Callable[[int, float], None] | None = None, max_steps: int | None = None) -> list[float]:
    """Fine-tune ``model`` (a ``Qwen3ForCausalLM``, all weights, in place, on whatever device it
    is) on ``demos``; returns each step's loss. AdamW; gradients clipped to ``recipe.grad_clip``
    (global norm). ``on_step(step, loss)`` is called after each step (0-based), e.g. to report.
    ``max_steps``: stop after that many steps of the same ``recipe.steps`` schedule (the order and
    learning rates of the whole build: the weights equal the whole build's at that step)."""
    import torch

    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    losses = []
    order = batch_order([len(d.input_ids) for d in demos], recipe.batch_size, recipe.steps, seed)[:max_steps]
    for step, indices in enumerate(order):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        input_ids, targets = collate([demos[i] for i in indices], pad_id)
        loss = demo_loss(model, input_ids.to(device), targets.to(device))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT step {step}: loss is {loss.item()}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % 40 == 0 or step == len(order) - 1:
            log.info("SFT step %d/%d loss %.4f", step + 1, recipe.steps, losses[-1])
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def mean_demo_loss(model, demos: Sequence[Demo], pad_id: int, batch_size: int = 8) -> float:
    """Token-mean loss of ``demos`` (teacher-forced, no gradient): the held-out check."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(demos), batch_size):
            input_ids, targets = collate(demos[i:i + batch_size], pad_id)
            tokens = int((targets != -100).sum())
            device = next(model.parameters()).device
            total += float(demo_loss(model, input_ids.to(device), targets.to(device))) * tokens
            count += tokens
    return total / max(count, 1)


# ----------------------------------------------------------------------------- evaluation


def summarize_episodes(episodes: Iterable[dict], cost_per_usd: float = COST_PER_USD) -> dict:
    """Behaviour of ended episodes (``Episode.to_record_episode()`` dicts or records' ``episode``):
    ``{"episodes", "terminal_reasons": {reason: n}, "explores": {k: n}, "acc", "cost_usd",
    "objective", "by_benchmark": {bench: {"episodes", "acc", "objective", "mean_explores"}}}``.
    ``objective`` is the mean of ``acc - cost_per_usd * dollars`` (README, "The reward")."""
    from atlas_lightning.reward import reward_breakdown

    rows = []
    for episode in episodes:
        breakdown = reward_breakdown(episode, cost_per_usd)
        rows.append((episode["benchmark"], episode["terminal_reason"], breakdown))
    if not rows:
        raise ValueError("summarize_episodes: no episodes")

    def means(selected: list) -> dict:
        n = len(selected)
        return {
            "episodes": n,
            "acc": sum(b["acc"] for _, _, b in selected) / n,
            "cost_usd": sum(b["cost_total"] for _, _, b in selected) / n,
            "objective": sum(b["objective"] for _, _, b in selected) / n,
            "mean_explores": sum(b["num_explores"] for _, _, b in selected) / n,
        }

    reasons = Counter(reason for _, reason, _ in rows)
    explores = Counter(int(b["num_explores"]) for _, _, b in rows)
    return {
        **means(rows),
        "terminal_reasons": {r: reasons[r] for r in TERMINAL_REASONS if reasons[r]},
        "explores": {str(k): explores[k] for k in sorted(explores)},
        "by_benchmark": {bench: means([r for r in rows if r[0] == bench]) for bench in sorted({r[0] for r in rows})},
    }


def evaluate_policy(model, chat, questions: Sequence[Question], *, temperature: float, seed: int = 0,
                    limits: LoopLimits = TINY_CPU_LIMITS, runtime: RuntimeConfig = TINY_CPU_RUNTIME,
                    cost_per_usd: float = COST_PER_USD) -> dict:
    """Run one episode of each question through the real agent loop on the transformers
    reference engine (greedy when ``temperature == 0``); ``summarize_episodes`` of the result."""
    from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
    from atlas_lightning.rollout.engines.hf_engine import HFEngine

    trajectories = []
    for question in questions:
        episode = Episode(question, 0, runtime, seed=seed)
        prompt = chat.prompt_ids(episode.messages(), episode.tools())
        episode.on_prompt_tokens(len(prompt))
        trajectories.append(Trajectory(uid=question.question_id, session_id="n000", episode=episode, prompt_ids=prompt))
    AgentLoop(HFEngine(model), chat, limits).run(trajectories, Sampling(temperature=temperature),
                                                 seed_parts=(seed, "sft-eval"))
    return summarize_episodes([t.episode.to_record_episode() for t in trajectories], cost_per_usd)


# ----------------------------------------------------------------------------- the build


def sample_questions(split: str, sample_seed: int = 0, per_benchmark: int | None = None) -> list[Question]:
    """The bundled sample's ``split`` questions, GPQA then LCB (as ``build_sample`` writes them);
    the first ``per_benchmark`` of each when given."""
    return [q for (bench, s), count in SAMPLE_COUNTS.items() if s == split
            for q in generate_questions(bench, split, count, sample_seed)[:per_benchmark]]


def _demo_stats(demos: Sequence[Demo]) -> dict:
    n = len(demos)
    return {
        "count": n,
        "by_benchmark": dict(sorted(Counter(d.benchmark for d in demos).items())),
        "explores": {str(k): v for k, v in sorted(Counter(d.explores for d in demos).items())},
        "strategies": dict(sorted(Counter(d.strategy for d in demos).items())),
        "acc": sum(d.acc for d in demos) / n,
        "cost_usd": sum(d.cost_usd for d in demos) / n,
        "objective": sum(d.acc - COST_PER_USD * d.cost_usd for d in demos) / n,
        "tokens": sum(len(d.input_ids) for d in demos),
        "trained_tokens": sum(sum(d.loss_mask) for d in demos),
        "max_length": max(len(d.input_ids) for d in demos),
    }


def _base_folder(staging: Path, base: Path | None, seed: int) -> Path:
    """The tiny model to start from: ``base`` (every model file there, or ``FileNotFoundError``
    naming those missing), else one built with ``build_tiny_model(seed=seed)`` inside ``staging``."""
    from atlas_lightning.demo.tiny_model import build_tiny_model

    if base is None:
        base_dir = staging / ".base"
        build_tiny_model(base_dir, seed=seed)
        return base_dir
    base_dir = Path(base)
    missing = [name for name in MODEL_FILES if not (base_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"build_tiny_orchestrator: base {base_dir} lacks {', '.join(missing)}")
    return base_dir


def _summary(out: Path, seed: int, sample_seed: int, base: Path | None, base_weights: str, recipe: SFTRecipe,
             demos: list, losses: list[float], evaluation: dict, seconds: dict, staging: Path) -> dict:
    """``sft_summary.json``'s content (module doc): inputs, recipe, losses, evaluation, timings, file digests."""
    import torch
    import transformers

    tail = losses[-20:]
    return {
        "out": str(out),
        "seed": seed,
        "sample_seed": sample_seed,
        "base": str(base) if base is not None else None,
        "base_weights_sha256": base_weights,
        "recipe": asdict(recipe),
        "limits": asdict(TINY_CPU_LIMITS),
        "demos": _demo_stats(demos),
        "steps": len(losses),
        "demos_seen": len(losses) * recipe.batch_size,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        LOSSES_KEY: [round(v, 5) for v in losses[::10]],
        "eval": evaluation,
        "seconds": seconds,
        "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "files": {name: sha256_file(staging / name) for name in MODEL_FILES},
    }


def weights_sha256(model) -> str:
    """sha256 over ``model``'s state (each tensor's name, dtype, shape and bytes, in name order):
    the trajectory's fingerprint (``TRAJECTORY_STEPS``)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@contextmanager
def _no_progress_bars():
    """transformers' progress bars off inside (loading a model prints one), as they were after."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _training_inputs(staging: Path, base: Path | None, recipe: SFTRecipe, seed: int,
                     sample_seed: int) -> tuple[Path, Any, list[Demo]]:
    """``(base folder, its ChatFormat, the demonstrations)`` the build trains on (``_base_folder``;
    module doc: 4 demonstrations per train question of the sample)."""
    from transformers import AutoTokenizer

    from atlas_lightning.rollout.chat import ChatFormat

    base_dir = _base_folder(staging, base, seed)
    chat = ChatFormat(AutoTokenizer.from_pretrained(base_dir))
    train_questions = sample_questions("train", sample_seed, recipe.train_questions)
    demos = build_demos(train_questions, chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME,
                        per_question=recipe.demos_per_question, seed=seed)
    return base_dir, chat, demos


def _fresh_model(base_dir: Path):
    """The base, in float32 with sdpa attention, as the build trains it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")


def replay_build_prefix(steps: int, seed: int = 0, *, recipe: SFTRecipe = DEFAULT_RECIPE,
                        sample_seed: int = 0) -> list[float]:
    """The first ``steps`` training steps of ``build_tiny_orchestrator(seed=seed, base=None)``,
    run again in a temporary folder (nothing else written): each step's loss, to compare with the
    whole build's ``sft_summary.json`` ``loss_every_10_steps`` within ``LOSS_RTOL``. A cheap
    check of the build (a few percent of it) that the test suite runs on any CPU; the whole
    rebuild is ``make verify-demo-model``."""
    import torch

    with tempfile.TemporaryDirectory(prefix="tiny-orchestrator-replay-") as staging, _no_progress_bars():
        base_dir, chat, demos = _training_inputs(Path(staging), None, recipe, seed, sample_seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _fresh_model(base_dir)
            return train_on_demos(model, demos, recipe, seed, chat.tokenizer.pad_token_id, max_steps=steps)


def save_as_loaded(model, base_dir: Path, folder: Path) -> None:
    """The trained model's weights and config into ``folder``, as transformers saves the
    ``*ForCausalLM`` it trained (the default of ``build_tiny_orchestrator``'s ``save_model``)."""
    model.save_pretrained(folder)


def build_tiny_orchestrator(out: Path, seed: int = 0, base: Path | None = None, *,
                            recipe: SFTRecipe = DEFAULT_RECIPE, sample_seed: int = 0,
                            save_model: Callable[..., None] = save_as_loaded, device: str = "cpu") -> dict:
    """SFT the tiny model on scripted episodes and save it under ``out`` (see the module docstring).

    ``base``: a tiny model folder (``build_tiny_model``'s layout) to start from; ``None`` builds
    one with ``build_tiny_model(seed=seed)``. ``sample_seed``: the bundled sample whose train
    questions are demonstrated and whose validation questions are evaluated. ``save_model(model,
    base folder, folder)`` writes the trained weights in the base's checkpoint format
    (``save_as_loaded``; a hybrid base: ``tiny_hybrid_orchestrator``). ``device``: where it trains
    (the CPU: the byte-identical build of the module doc; a card trains faster, not bit-exactly). The global torch
    RNG and thread settings are left as they were. Returns the summary also written to
    ``out/sft_summary.json``.
    """
    started = time.monotonic()
    out = Path(out)
    # what a killed build left beside out goes first; this build's staging goes when it ends
    with staging_folder(out.parent, out.name) as work, _no_progress_bars():
        staging = work / "out"
        staging.mkdir()
        return _build_in(staging, out, seed, base, recipe, sample_seed, save_model, device, started)


def _build_in(staging: Path, out: Path, seed: int, base: Path | None, recipe: SFTRecipe, sample_seed: int,
              save_model: Callable[..., None], device: str, started: float) -> dict:
    """``build_tiny_orchestrator``'s work in ``staging``, moved to ``out`` at the end."""
    import torch

    base_dir, chat, demos = _training_inputs(staging, base, recipe, seed, sample_seed)
    base_weights = sha256_file(base_dir / "model.safetensors")
    pad_id = chat.tokenizer.pad_token_id
    val_questions = sample_questions("val_full", sample_seed)
    val_demos = build_demos(sample_questions("val_full", sample_seed, recipe.val_loss_questions), chat,
                            TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=1, seed=seed)
    built_demos = time.monotonic()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _fresh_model(base_dir).to(device)
        trajectory = {}

        def record(step: int, loss: float) -> None:
            if step + 1 in TRAJECTORY_STEPS:
                trajectory[str(step + 1)] = weights_sha256(model)

        losses = train_on_demos(model, demos, recipe, seed, pad_id, on_step=record)
        trained = time.monotonic()
        save_model(model, base_dir, staging)
        for name in _TOKENIZER_FILES:
            shutil.copyfile(base_dir / name, staging / name)

        evaluation = {"val_demo_loss": mean_demo_loss(model, val_demos, pad_id)}
        if recipe.eval_questions:
            picked = [q for bench in ("gpqa", "lcb")
                      for q in [q for q in val_questions if q.benchmark == bench][: recipe.eval_questions]]
            evaluation["greedy"] = evaluate_policy(model, chat, picked, temperature=0.0, seed=seed)
            evaluation["sampled"] = evaluate_policy(model, chat, picked, temperature=1.0, seed=seed)
    evaluated = time.monotonic()
    shutil.rmtree(staging / ".base", ignore_errors=True)

    made = sorted(p.name for p in staging.iterdir())
    if made != sorted(MODEL_FILES):
        raise RuntimeError(f"tiny orchestrator build wrote {made}, expected {sorted(MODEL_FILES)}")
    summary = _summary(out, seed, sample_seed, base, base_weights, recipe, demos, losses, evaluation,
                       {"demos": round(built_demos - started, 2), "train": round(trained - built_demos, 2),
                        "eval": round(evaluated - trained, 2), "total": round(evaluated - started, 2)}, staging)
    summary[TRAJECTORY_KEY] = trajectory
    (staging / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in staging.iterdir():
        path.chmod(0o644)  # safetensors' temp file would leave the weights owner-only
    staging.chmod(0o755)
    replace_folder(staging, out, staging.parent)  # whole, by one rename (store/staging.py)
    return summary
