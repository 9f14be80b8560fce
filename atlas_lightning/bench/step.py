"""The end-to-end RL step benchmark: ``atlas-lightning fit`` itself, timed phase by phase.

    python -m atlas_lightning.bench.step --out DIR -- experiment=h200-8b [overrides]
    python -m atlas_lightning.bench.step --out DIR --build dense8b --model-dir /tmp/dense8b \\
        --tokenizer-from ~/.cache/atlas-lightning/tiny-model -- experiment=h200-8b model.path=/tmp/dense8b
    python -m atlas_lightning.bench.step --out DIR --build qwen3_6_27b --layers 16 --model-dir /tmp/qwen3_6_27b \\
        --tokenizer-from ~/.cache/atlas-lightning/tiny-model -- experiment=h200-8b model.path=/tmp/qwen3_6_27b

What runs: the ``fit`` verb (``run.verbs.fit`` on the config composed from the overrides, as
``atlas-lightning fit`` runs it), with one callback more, ``StepBenchCallback``, added the documented way (``+callbacks.step_bench``).
Everything else is the run as configured: the engine, sleep and wake, the weight sync and its
checks, records, validation, checkpoints. ``--build SHAPE`` first writes a random-weight model
of that shape (``bench/shapes.py``, built on the GPU; the tokenizer of ``--tokenizer-from``) to
``--model-dir``, once, in the format of its real checkpoints (Qwen3.5/3.6 shapes as
``Qwen3_5ForConditionalGeneration``, what vLLM requires of them): trainer and engine then load
the same weights. A bad ``--build`` request exits 2 before anything is written (``check_build``).

What the callback measures, per RL step (rank 0's clocks; every rank runs the same phases):

* the step's wall time: from the start of its rollout to the start of the next one (the last
  step: to the end of training), so that the weight sync and every callback (records,
  validation, figures, checkpoint) are inside it;
* each phase's seconds and peak memory, as the run logs them (``timing_s/*`` and ``memory/*``
  of ``runs/<name>/<id>/history.csv``): ``wake_rollout``, ``gen`` (the agent loop), ``sleep``,
  ``assemble``, ``old_log_prob``, ``values``, ``ref``, ``adv``, ``update_critic``,
  ``update_actor``; ``wake`` and ``update_weights`` (the weight sync); ``testing`` (validation);
* each callback's own seconds (its ``on_train_batch_start`` and ``on_train_batch_end``), and the
  rest of the step (``other``: Lightning's loop, the data hand-over);
* shares: generation (``gen``), update compute (the five forward/backward phases) and the
  rest, with validation and the checkpoint apart (they run every ``trainer.val_every`` /
  ``trainer.save_every`` steps) and amortised over those periods;
* tokens/s/GPU as NeMo-RL publishes it (``tokens_per_gpu_second``): all tokens of the step's
  trajectories over the step's seconds times the run's GPUs (``layout.gpus``), also with the
  validation and checkpoint spread over the report's periods (the step goals').

A validation riding with the next rollout (``callbacks.validation.overlap``): step N's validation
runs in step N+1's agent loop run, beside its training trajectories, and is logged under step N at
step N+1's batch start (``timing_s/testing``: its marginal seconds; ``timing_s/testing_overlapped``:
its seconds under the training trajectories). Its seconds are in step N+1's wall: the tail of
N+1's ``gen`` after the training trajectories were done (the ridden batch's ``timing["tail"]``, read
as the datamodule's ``take_validation`` hands it over) and its recording in
``ValidationCallback.on_train_batch_start``.
Step N's row shows what it logged and costs it there (its deferral, that tail, that recording),
for the amortised figures; step N+1 counts those seconds as validation, its generation share and
rate are its training trajectories' (``validation_seconds``). How much the validation's company
slowed the training trajectories stays in N+1's ``gen``: nothing measures it.

Generation against plain vLLM: the train rollout of ``replay_step`` (default 1) is recorded
request by request (prompt tokens, sampling, the tokens each produced); at the end of that step
(after its weight sync and validation; its seconds are not counted in the step), on the same
engine with the step's new adapter and an emptied prefix cache, the same requests go through
one ``vllm.LLM.generate`` call, each forced to the length it had (``min_tokens = max_tokens``,
``ignore_eos``). ``gen_vs_plain`` is the agent loop's generated tokens a second over plain
``generate``'s on the same requests: what the loop's turn-by-turn scheduling and Python work
cost against an engine that gets everything at once.

Memory beside the plan: ``atlas-lightning plan``'s per-phase tensors for the same config, at the
configured token budgets and at the micro-batch sizes the step really ran (the planner's own
partition of the step's sequence lengths).

Where the updates' time goes (``profile_update_step``: ``+callbacks.step_bench.profile_update_step=N``):
step N's critic and actor updates (``PPOModule._update``) run under ``torch.profiler``
(``probes.profile_call``): their kernels by category and the card's idle share, beside what the
update benchmark's ``update-profile`` section measures on the same batch. A diagnostic: the
profiler's own costs are in step N's figures.

Around the steps (``fit_edges_s``, added once ``fit`` returns): its opening, from the call of
``fit`` to the first rollout (the engine's start, the trainer's build, the starting sync and its
checks, a step-0 validation), and its closing, from the end of training to ``fit``'s return (the
last checkpoint's wait, the engine's shutdown, the closing summary). A user waits for both; no step
holds them.

Output: ``DIR/step_bench.json`` (rewritten after every step, so a run cut short keeps what it
measured; with the model ``--build`` wrote, ``build``: its shape and ``--layers``, and the card's
HBM where ``bench/cards.py`` knows it, what ``bench/projection.py`` scales from) and
``DIR/step_bench.md`` (printed last).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L

from atlas_lightning.run.exit_codes import exit_code, report
from atlas_lightning.store.atomic import atomic_write_text

from .step_markdown import markdown
from .step_names import CHECKPOINT_CALLBACKS, VALIDATION_CALLBACK

GIB = 2**30
#: Phases of one step as the run logs them (``timing_s/<phase>``), in the order they run.
PHASES = ("wake_rollout", "gen", "sleep", "assemble", "old_log_prob", "values", "ref", "adv", "update_critic",
          "update_actor", "wake", "update_weights", "testing")
UPDATE_COMPUTE = ("old_log_prob", "values", "ref", "update_critic", "update_actor")
#: Logged under step N by a validation of step N that rode with step N+1's rollout
#: (``callbacks/validation.py``, "Overlapped"): its seconds under N+1's training trajectories.
RIDE_KEY = "timing_s/testing_overlapped"


class _RecordingEngine:
    """The run's engine, unchanged, with the requests of the labelled rollout recorded (and the
    token count each produced). Everything else is the wrapped engine's."""

    def __init__(self, engine) -> None:
        self.inner = engine
        self.label: Optional[str] = None
        self.requests: dict[str, dict[str, Any]] = {}
        self.produced: dict[str, dict[str, int]] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def submit(self, request) -> None:
        if self.label is not None:
            self.requests.setdefault(self.label, {})[request.request_id] = request  # a retry replaces
        self.inner.submit(request)

    def poll(self):
        results = self.inner.poll()
        if self.label is not None:
            produced = self.produced.setdefault(self.label, {})
            for result in results:
                if result.error is None:
                    produced[result.request_id] = len(result.token_ids)
        return results


class StepBenchCallback(L.Callback):
    """Times every phase of every RL step of a ``fit`` (module doc); writes ``out``."""

    def __init__(self, out: str, replay_step: int = 1, replay: bool = True, build: Optional[str] = None,
                 layers: Optional[int] = None, profile_update_step: Optional[int] = None) -> None:
        self.out = Path(out)
        #: the step whose updates run under the profiler (module doc), and what it found, by role
        self.profile_update_step = None if profile_update_step is None else int(profile_update_step)
        self.update_profile: dict[str, dict] = {}
        self._step_now: Optional[int] = None
        # the model the step runs, when ``--build`` wrote it (the projection scales from it)
        self.build = {"shape": build, "layers": None if layers is None else int(layers)} if build else None
        self.replay_step = int(replay_step)
        self.replay = bool(replay)
        self.recorder: Optional[_RecordingEngine] = None
        self.rollout_start: dict[int, float] = {}
        #: by step: the seconds of its rollout call and of its training_step (where ``other`` lies)
        self.rollout_s: dict[int, float] = {}
        self.training_step_s: dict[int, float] = {}
        self.callback_s: dict[int, dict[str, float]] = {}
        #: the part of ``callback_s`` spent in ``on_train_batch_start`` (a ridden validation's recording)
        self.callback_start_s: dict[int, dict[str, float]] = {}
        #: by validated step: a ridden validation's seconds at the end of the next step's ``gen``
        self.ride_tail_s: dict[int, float] = {}
        self.lengths: dict[int, list[int]] = {}
        self.responses: dict[int, list[int]] = {}
        self.generated: dict[int, int] = {}
        self.peak_tflops: Optional[float] = None
        #: by step: the card's bf16 matmul rate measured at the step's end (``card_rate_after``)
        self.card_tflops: dict[int, Optional[float]] = {}
        #: by step: seconds the benchmark itself spent inside it, taken out of its wall time
        self.excluded_s: dict[int, float] = {}
        self.ended: Optional[float] = None
        #: wall-clock stamps (``time.time()``) of the first rollout's start and of the end of
        #: training, for ``fit_edges_s`` (measured against ``fit``'s call and return)
        self.first_rollout_at: Optional[float] = None
        self.ended_at: Optional[float] = None
        self.replayed: dict[str, Any] = {"done": False, "why": "not run yet"}

    # -- wiring -----------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        import torch

        self.peak_tflops = card_matmul_rate()  # the MFU denominator
        dm = trainer.datamodule
        if dm is None or getattr(dm, "engine", None) is None:
            raise ValueError("StepBenchCallback needs the RolloutDataModule's engine (fit builds it in setup)")
        self.recorder = _RecordingEngine(dm.engine)
        dm.engine = self.recorder
        rollout = dm.rollout

        def timed_rollout(step: int):
            if self.first_rollout_at is None:
                self.first_rollout_at = time.time()
            self.rollout_start[step] = time.monotonic()
            self.recorder.label = f"train{step}" if step == self.replay_step else None
            try:
                return rollout(step)
            finally:
                self.recorder.label = None
                self.rollout_s[step] = time.monotonic() - self.rollout_start[step]

        dm.rollout = timed_rollout
        if pl_module is not None:
            self._time_training_step(pl_module)
            if self.profile_update_step is not None and torch.cuda.is_available():
                self._profile_updates(pl_module)

        take = getattr(dm, "take_validation", None)

        def taken(step: int):
            batch = take(step)
            if batch is not None:  # it rode: the datamodule measured its tail after the training trajectories
                self.ride_tail_s[step] = float(batch.timing.get("tail", 0.0))
            return batch

        if take is not None:
            dm.take_validation = taken
        for callback in trainer.callbacks:
            if callback is not self:
                self._time_hook(callback, "on_train_batch_end", step_of=lambda args: args[3].step)
                # a validation that rode with this step's rollout is recorded here, inside this step
                self._time_hook(callback, "on_train_batch_start", step_of=lambda args: args[2].step,
                                part=self.callback_start_s)
                self._time_hook(callback, "on_train_start", step_of=lambda args: 0)

    def _time_training_step(self, pl_module) -> None:
        """``pl_module.training_step`` timed into ``training_step_s`` by RL step."""
        training_step = pl_module.training_step

        def timed_training_step(batch, *args, **kwargs):
            self._step_now = batch.step
            started = time.monotonic()
            try:
                return training_step(batch, *args, **kwargs)
            finally:
                self.training_step_s[batch.step] = time.monotonic() - started

        pl_module.training_step = timed_training_step

    def _profile_updates(self, pl_module) -> None:
        """``pl_module._update`` of step ``profile_update_step`` run under the profiler, each
        role's summary into ``update_profile`` (module doc)."""
        from .probes import profile_call

        update = pl_module._update

        def profiled_update(role, *args, **kwargs):
            if self._step_now != self.profile_update_step:
                return update(role, *args, **kwargs)
            out, self.update_profile[role] = profile_call(lambda: update(role, *args, **kwargs))
            return out

        pl_module._update = profiled_update

    def _time_hook(self, callback, hook: str, step_of, part: Optional[dict] = None) -> None:
        """``callback``'s ``hook`` timed into ``callback_s`` under the step ``step_of(args)``
        names, and into ``part`` too when given (the hook's own share of those seconds)."""
        original = getattr(callback, hook)
        name = type(callback).__name__

        def timed(*args, **kwargs):
            started = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.monotonic() - started
                for into in (self.callback_s, part) if part is not None else (self.callback_s,):
                    seconds = into.setdefault(step_of(args), {})
                    seconds[name] = seconds.get(name, 0.0) + elapsed

        setattr(callback, hook, timed)

    # -- per step ---------------------------------------------------------------------------

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lengths[batch.step] = batch.sequence_lengths()
        self.responses[batch.step] = [len(r.response_ids) for r in batch.records]
        self.generated[batch.step] = int(batch.stats.generated_tokens)
        started = time.monotonic()
        self.card_tflops[batch.step] = card_rate_after()
        self.excluded_s[batch.step] = time.monotonic() - started
        if self.replay and batch.step == self.replay_step:
            if trainer.global_rank == 0:  # first the step's figures: a cap that falls in the replay keeps them
                self._write(trainer, pl_module)
            # now, so that a run cut short keeps it; its seconds are taken out of the step's wall time
            started = time.monotonic()
            self.replayed = self._replay()
            self.replayed["excluded_s"] = time.monotonic() - started
        if trainer.global_rank == 0:
            self._write(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.ended = time.monotonic()
        self.ended_at = time.time()
        if trainer.global_rank == 0:
            report = self._write(trainer, pl_module)
            print(markdown(report), file=sys.stderr)

    # -- plain vLLM on the same requests ----------------------------------------------------

    def _replay(self) -> dict[str, Any]:
        label = f"train{self.replay_step}"
        engine = self.recorder.inner if self.recorder is not None else None
        llm = getattr(engine, "llm", None)
        if llm is None:
            return {"done": False, "why": f"the engine ({type(engine).__name__}) is not an in-process vllm.LLM"}
        requests = self.recorder.requests.get(label, {})
        produced = self.recorder.produced.get(label, {})
        chosen = [(request, produced[rid]) for rid, request in requests.items() if produced.get(rid)]
        if not chosen:
            return {"done": False, "why": f"no finished request recorded for step {self.replay_step}"}
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for request, n in chosen:
            spec = request.sampling
            prompts.append(TokensPrompt(prompt_token_ids=list(request.prompt_ids)))
            params.append(SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p,
                                         top_k=spec.top_k if spec.top_k > 0 else 0, seed=spec.seed, max_tokens=n,
                                         min_tokens=n, ignore_eos=True, logprobs=0, detokenize=False,
                                         skip_special_tokens=False))
        engine.wake_up()
        llm.reset_prefix_cache()
        started = time.monotonic()
        outputs = llm.generate(prompts, params, lora_request=getattr(engine, "_lora", None), use_tqdm=False)
        seconds = time.monotonic() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"done": True, "step": self.replay_step, "requests": len(prompts), "generated_tokens": tokens,
                "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts), "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else None}

    # -- the report -------------------------------------------------------------------------

    def _write(self, trainer, pl_module) -> dict:
        report = build_report(pl_module.cfg, _history(trainer), rollout_start=self.rollout_start,
                              ended=self.ended, callback_s=self.callback_s, callback_start_s=self.callback_start_s,
                              ride_tail_s=self.ride_tail_s, lengths=self.lengths,
                              rollout_s=self.rollout_s, training_step_s=self.training_step_s,
                              generated=self.generated, replayed=self.replayed, responses=self.responses,
                              peak_tflops=self.peak_tflops, build=self.build, card_tflops=self.card_tflops,
                              excluded_s=self.excluded_s)
        report["fit_stamps"] = {"first_rollout_at": self.first_rollout_at, "train_ended_at": self.ended_at}
        if self.update_profile:
            report["update_profile"] = {"step": self.profile_update_step, **self.update_profile}
        model = getattr(pl_module, "model", None)
        if hasattr(model, "attention_backends"):  # the kernels fit's attention ran, as the update benchmark reports its own
            report["attention_backends"] = model.attention_backends()
        save_report(self.out, report)
        return report


def card_matmul_rate() -> Optional[float]:
    """The card's bf16 matmul rate (TFLOP/s) now (``measure.matmul_peak``, 10 repetitions); None
    off CUDA. One measurement for set-up and each step's end, so the two rates compare."""
    import torch

    if not torch.cuda.is_available():
        return None
    from .measure import matmul_peak

    return matmul_peak(torch.device("cuda"), reps=10)["tflops"]


def card_rate_after() -> Optional[float]:
    """``card_matmul_rate`` at a step's end; None also where the card has no room left for the
    measurement's three 8192-square matrices. Why: the step's MFU is reckoned on the rate
    measured at set-up, before the engine ran; a card that runs slower by the update (its
    clocks, its power) shows here, apart from what the code does."""
    import torch

    try:
        return card_matmul_rate()
    except torch.OutOfMemoryError:
        return None


def _history(trainer) -> dict[int, dict[str, float]]:
    """Every metric the run logged, by RL step (the run export's rows)."""
    for logger in trainer.loggers:
        if hasattr(logger, "history"):
            return {int(row["_step"]): {k: v for k, v in row.items() if not k.startswith("_")}
                    for row in logger.history()}
    return {}


def _plan_at(cfg, update_tokens: Optional[int], forward_tokens: Optional[int]) -> Optional[dict]:
    """``plan``'s per-phase tensors (GiB) for ``cfg``, with the token budgets replaced where given."""
    from omegaconf import OmegaConf

    from atlas_lightning.planning import make_plan

    try:
        import torch

        card = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None
        plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        if update_tokens:
            plain.algorithm.ppo_max_token_len_per_gpu = int(update_tokens)
        if forward_tokens:
            plain.algorithm.forward_max_token_len_per_gpu = int(forward_tokens)
        plan = make_plan(plain, card_gib=card)
    except Exception as err:  # a plan is a comparison, never a reason to lose the measurement
        return {"error": f"{type(err).__name__}: {err}"}
    return {phase.name: {"tensors_gib": phase.tensors / GIB, "card_gib": phase.card / GIB}
            for phase in plan.phases if phase.cards != "serving cards"}


def _micro_batch_figures(cfg, lengths: list[int], logged: dict[str, float]) -> dict[str, Any]:
    """A step's largest micro-batches (the update's as its own cut ran them, where it logged
    them: it may cut finer than the fewest, ``ppo/micro_batches.py``) and the plan's tensors at
    the configured budgets and at those sizes."""
    update_tokens, forward_tokens = _largest_micro_batches(cfg, lengths)
    ran = [logged[k] for k in ("perf/critic_micro_tokens_max", "perf/actor_micro_tokens_max") if k in logged]
    if ran:
        update_tokens = int(max(ran))
    return {"micro_batch_tokens": {"update": update_tokens, "forward": forward_tokens},
            "plan_tensors_gib": {"configured_budgets": _plan_at(cfg, None, None),
                                 "step_micro_batches": _plan_at(cfg, update_tokens, forward_tokens)}}


def _largest_micro_batches(cfg, lengths: list[int]) -> tuple[Optional[int], Optional[int]]:
    """Tokens of the largest update and forward micro-batch the step ran (the planner's own cut)."""
    from atlas_lightning.algorithms.partition import plan_micro_batches

    if not lengths:
        return None, None
    a = cfg.algorithm
    mini = a.train_batch_size // a.ppo_mini_batch_size
    size = -(-len(lengths) // mini)
    update = 0
    for start in range(0, len(lengths), size):
        chunk = lengths[start:start + size]
        for mb in plan_micro_batches(chunk, a.ppo_max_token_len_per_gpu, allow_oversized=True).micro_batches:
            update = max(update, sum(chunk[i] for i in mb))
    forward = max(sum(lengths[i] for i in mb) for mb in
                  plan_micro_batches(lengths, a.forward_max_token_len_per_gpu, allow_oversized=True).micro_batches)
    return update, forward


def phase_flops(cfg, lengths: list[int], responses: list[int]) -> Optional[dict[str, float]]:
    """Useful FLOPs (``bench/flops.py``) of the step's compute phases on these sequences: actor and
    critic forward passes over every sequence (scored: the response tokens), and ``ppo_epochs``
    forward + backward passes of each; None where the model's shape cannot be read."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from atlas_lightning.models.build import causal_lm_config

        from .flops import model_flops

        config = causal_lm_config(cfg.model.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        flops = model_flops(model, int(cfg.model.lora.rank))
    except Exception:  # noqa: BLE001 - a figure beside the measurement, never a reason to lose it
        return None
    scored, epochs = int(sum(responses)), int(cfg.algorithm.ppo_epochs)
    return {"old_log_prob": flops.forward("actor", lengths, scored), "values": flops.forward("critic", lengths, scored),
            "ref": flops.forward("base", lengths, scored),
            "update_critic": epochs * flops.train_step("critic", lengths, scored),
            "update_actor": epochs * flops.train_step("actor", lengths, scored)}


#: the training of record's periods (``r28-continued-cost-8gpu-n32``): a checkpoint every step,
#: validation every 5 steps; the step goals are stated at them
REPORT_SAVE_EVERY, REPORT_VAL_EVERY = 1, 5


def tokens_per_gpu_second(tokens: int, gpus: int, wall: float, periodic_s: float, amortised_s: float,
                          report_s: float) -> dict:
    """NeMo-RL's figure of a step: all tokens processed (every trajectory's prompt and response
    tokens, once) / (the step's seconds x the GPUs of the run); ``step``: as this step ran;
    ``without_periodic``: without its validation and checkpoint (``periodic_s``); ``amortised``:
    with those spread over the run's periods (``amortised_s``), what a long run averages;
    ``report_periods``: spread over the report's (``report_s``: ``REPORT_SAVE_EVERY``, ``REPORT_VAL_EVERY``)."""
    steady = wall - periodic_s

    def rate(extra: float):
        return tokens / ((steady + extra) * gpus) if steady + extra > 0 else None
    return {"step": tokens / (wall * gpus), "gpus": gpus, "without_periodic": rate(0.0),
            "amortised": rate(amortised_s), "report_periods": rate(report_s)}


def validation_seconds(step: int, measured: set[int], history: dict[int, dict[str, float]],
                       callback_s: dict[int, dict[str, float]], callback_start_s: dict[int, dict[str, float]],
                       ride_tail_s: dict[int, float]) -> dict[str, Any]:
    """Where step ``step``'s validation seconds are (module doc, "A validation riding with the next
    rollout"); ``measured``: the steps the report has a row for.

    ``in_step_s``: validation seconds inside this step's wall (``ValidationCallback``'s hooks, plus
    ``rider_tail_s``: the previous step's ridden validation's tail in this step's ``gen``, from
    ``ride_tail_s``, by validated step; of the hooks, ``rider_recorded_s`` is that validation's
    recording at this step's batch start; ``carried``: whether one rode with this step's rollout).
    ``cost_s``: what this step's own validation cost the run, wherever it was spent: alone, its
    ``on_train_batch_end``; riding (``rides``), its deferral there, then in step ``step + 1`` its tail
    in ``gen`` and its recording at the batch start (the logged marginal ``timing_s/testing`` where
    that step or the tail is not measured). With both measured, the ``cost_s`` of a run's steps sum
    to their ``in_step_s``: every validation second is counted once.
    ``testing_s``, ``overlapped_s``: ``timing_s/testing`` and ``timing_s/testing_overlapped`` as logged."""
    logged = history.get(step, {})
    own = callback_s.get(step, {}).get(VALIDATION_CALLBACK, 0.0)
    carried = RIDE_KEY in history.get(step - 1, {})
    tail = ride_tail_s.get(step - 1, 0.0) if carried else 0.0
    # the batch start records the previous step's ride: that step's cost, not this one's
    recorded = callback_start_s.get(step, {}).get(VALIDATION_CALLBACK, 0.0)
    cost = own - recorded
    rides = RIDE_KEY in logged
    if rides and step + 1 in measured and step in ride_tail_s:
        cost += ride_tail_s[step] + callback_start_s.get(step + 1, {}).get(VALIDATION_CALLBACK, 0.0)
    elif rides:  # where in the next step its seconds lie is not known: the marginal it logged
        cost += logged.get("timing_s/testing", 0.0)
    return {"rides": rides, "carried": carried, "testing_s": logged.get("timing_s/testing"),
            "overlapped_s": logged.get(RIDE_KEY), "rider_tail_s": tail, "rider_recorded_s": recorded,
            "in_step_s": own + tail, "cost_s": cost}


def _step_shares(phases: dict[str, float], gen: float, callbacks: dict[str, float], wall: float,
                 validation: dict[str, Any], tokens: int, gpus: int, val_every: int, save_every: int) -> dict[str, Any]:
    """A step's ``other_s``, ``shares`` and ``tokens_per_s_per_gpu`` (module doc) from its phases,
    ``gen`` (its training trajectories' generation: ``gen`` less a ridden validation's tail), its
    callbacks' seconds and where its validation seconds are (``validation_seconds``)."""
    # the weight sync (wake, update_weights) is the step's last phase, not a callback
    inside = sum(phases.get(p, 0.0) for p in ("wake_rollout", "gen", "sleep", "assemble") + UPDATE_COMPUTE
                 + ("adv", "wake", "update_weights")) + sum(callbacks.values())
    update = sum(phases.get(p, 0.0) for p in UPDATE_COMPUTE)
    # validation and checkpoints run every val_every / save_every steps: a step that has one
    # shows it apart, and the amortised share spreads each over its period (a ridden validation:
    # its cost, wherever spent, at its own step)
    in_step = validation["in_step_s"]
    checkpoint = sum(callbacks.get(name, 0.0) for name in CHECKPOINT_CALLBACKS)
    overhead = wall - gen - update - in_step - checkpoint
    periodic = validation["cost_s"] / max(val_every, 1) + checkpoint / max(save_every, 1)
    at_report = validation["cost_s"] / REPORT_VAL_EVERY + checkpoint / REPORT_SAVE_EVERY
    return {"other_s": wall - inside,
            "shares": {"generation": gen / wall, "update_compute": update / wall, "overhead": overhead / wall,
                       "validation": in_step / wall, "checkpoint": checkpoint / wall,
                       "overhead_with_periodic_amortised": (overhead + periodic)
                       / (wall - in_step - checkpoint + periodic)},
            "tokens_per_s_per_gpu": tokens_per_gpu_second(tokens, gpus, wall, in_step + checkpoint, periodic,
                                                                  at_report)}


#: The phases inside the datamodule's rollout call and inside ``training_step``.
ROLLOUT_PHASES = ("wake_rollout", "gen", "sleep", "assemble")
TRAINING_STEP_PHASES = ("old_log_prob", "values", "ref", "adv", "update_critic", "update_actor", "wake",
                        "update_weights")


def other_parts(other: float, phases: dict[str, float], rollout: Optional[float],
                training_step: Optional[float]) -> dict[str, Optional[float]]:
    """Where a step's ``other`` seconds lie: in its rollout call outside the rollout's phases
    (sampling questions, building the batch), in ``training_step`` outside its phases (packing
    the sequences, the step's metrics and records), and the rest (``loop``: Lightning's loop, the
    hand-over between them, callback hooks the benchmark does not time). None where unmeasured."""
    def outside(total: Optional[float], names: tuple[str, ...]) -> Optional[float]:
        return None if total is None else total - sum(phases.get(p, 0.0) for p in names)

    in_rollout = outside(rollout, ROLLOUT_PHASES)
    in_step = outside(training_step, TRAINING_STEP_PHASES)
    loop = None if in_rollout is None or in_step is None else other - in_rollout - in_step
    return {"rollout": in_rollout, "training_step": in_step, "loop": loop}


def build_report(cfg, history: dict[int, dict[str, float]], *, rollout_start: dict[int, float],
                 ended: Optional[float], callback_s: dict[int, dict[str, float]], lengths: dict[int, list[int]],
                 generated: dict[int, int], replayed: dict[str, Any], responses: Optional[dict[int, list[int]]] = None,
                 peak_tflops: Optional[float] = None, build: Optional[dict] = None,
                 callback_start_s: Optional[dict[int, dict[str, float]]] = None,
                 ride_tail_s: Optional[dict[int, float]] = None, rollout_s: Optional[dict[int, float]] = None,
                 training_step_s: Optional[dict[int, float]] = None,
                 card_tflops: Optional[dict[int, Optional[float]]] = None,
                 excluded_s: Optional[dict[int, float]] = None) -> dict:
    """The benchmark's figures (module doc) from what the run logged and the callback timed;
    ``build``: the ``bench/shapes.py`` shape and layer count the model was built from (None: a
    model folder the benchmark did not write); ``callback_start_s``: the part of ``callback_s``
    spent in ``on_train_batch_start``; ``ride_tail_s``: by validated step, a ridden validation's
    seconds at the end of the next step's ``gen`` (both place a ridden validation's seconds in the
    next step; absent: its logged marginal is costed, nothing set apart there); ``rollout_s``,
    ``training_step_s``: by step, the seconds of its rollout call and its ``training_step``
    (``other_parts``: where ``other`` lies); ``card_tflops``: by step, the card's matmul rate at
    its end (``card_rate_after``; the update phases' MFU on it beside the set-up rate's);
    ``excluded_s``: by step, the benchmark's own seconds inside it, out of its wall time."""
    steps = sorted(s for s in rollout_start if s in lengths)
    responses = responses or {}
    val_every = int(cfg.trainer.val_every) or int(cfg.trainer.total_steps)
    save_every = int(cfg.trainer.save_every) or int(cfg.trainer.total_steps)
    rows = []
    for i, step in enumerate(steps):
        logged = history.get(step, {})
        end = rollout_start.get(steps[i + 1]) if i + 1 < len(steps) else ended
        # the benchmark's own seconds inside the step (the replay, the card's rate) are not the step's
        own = (excluded_s or {}).get(step, 0.0) + (replayed.get("excluded_s", 0.0) if replayed.get("step") == step else 0.0)
        wall = end - rollout_start[step] - own if end is not None else None
        phases = {p: logged.get(f"timing_s/{p}") for p in PHASES if f"timing_s/{p}" in logged}
        callbacks = dict(callback_s.get(step, {}))
        validation = validation_seconds(step, set(steps), history, callback_s, callback_start_s or {},
                                        ride_tail_s or {})
        # the training trajectories' generation: a ridden validation's tail after them is inside
        # gen, and is validation's seconds, counted once, there
        gen = phases.get("gen", 0.0) - validation["rider_tail_s"]
        row: dict[str, Any] = {
            "step": step, "wall_s": wall, "phases_s": phases, "callbacks_s": callbacks, "validation": validation,
            "memory_gib": {k[len("memory/"):]: v for k, v in logged.items() if k.startswith("memory/")},
            "trajectories": len(lengths[step]), "tokens": int(sum(lengths[step])),
            "generated_tokens": generated.get(step), "longest_sequence": max(lengths[step], default=0),
            "metrics": {k: v for k, v in logged.items() if k.startswith(("perf/", "rollout/", "response_length/",
                                                                           "critic/score", "actor/", "critic/"))},
        }
        # known once the generation ended, even in a step that did not
        row["gen_tokens_per_s"] = (generated.get(step) or 0) / gen if gen else None
        if wall:
            row.update(_step_shares(phases, gen, callbacks, wall, validation, row["tokens"], int(cfg.layout.gpus),
                                    val_every, save_every))
            row["other_parts"] = other_parts(row["other_s"], phases, (rollout_s or {}).get(step),
                                             (training_step_s or {}).get(step))
        row["sync_s"] = {k[len("sync_s/"):]: v for k, v in logged.items() if k.startswith("sync_s/")}
        flops = phase_flops(cfg, lengths[step], responses.get(step, [])) if step in responses else None
        if flops:
            row.update(_flop_figures(flops, phases, peak_tflops, (card_tflops or {}).get(step)))
        row.update(_micro_batch_figures(cfg, lengths[step], logged))
        rows.append(row)
    if replayed.get("done"):
        step_row = next((r for r in rows if r["step"] == replayed["step"]), None)
        if step_row and step_row.get("gen_tokens_per_s") and replayed.get("tokens_per_s"):
            replayed["gen_vs_plain"] = step_row["gen_tokens_per_s"] / replayed["tokens_per_s"]
    return {
        "name": cfg.name, "model": cfg.model.path, "engine": {
            "weight_sync": cfg.rollout.weight_sync, "enforce_eager": bool(cfg.rollout.enforce_eager),
            "sleep_mode": bool(cfg.rollout.enable_sleep_mode), "max_in_flight": int(cfg.rollout.max_in_flight),
            "gpu_memory_utilization": float(cfg.rollout.gpu_memory_utilization)},
        "batch": {"questions": int(cfg.algorithm.train_batch_size), "samples": int(cfg.rollout.n),
                  "mini_batch_questions": int(cfg.algorithm.ppo_mini_batch_size),
                  "ppo_epochs": int(cfg.algorithm.ppo_epochs),
                  "ppo_max_token_len_per_gpu": int(cfg.algorithm.ppo_max_token_len_per_gpu),
                  "forward_max_token_len_per_gpu": int(cfg.algorithm.forward_max_token_len_per_gpu),
                  "max_tokens_per_turn": int(cfg.rollout.max_tokens_per_turn)},
        "build": build, "environment": _environment(), "peak_bf16_tflops": peak_tflops, "steps": rows,
        "plain_generate": replayed,
    }


def _flop_figures(flops: dict[str, float], phases: dict[str, float], peak_tflops: Optional[float],
                  card_rate: Optional[float]) -> dict[str, Any]:
    """A step's useful TFLOP a phase and its MFU on the set-up rate ``peak_tflops`` and on the
    card's rate at the step's end ``card_rate`` (``card_rate_after``; None: not measured)."""
    def mfu(rate: float) -> dict[str, float]:
        return {p: f / phases[p] / (rate * 1e12) for p, f in flops.items() if phases.get(p)}

    figures: dict[str, Any] = {"useful_tflop": {p: f / 1e12 for p, f in flops.items() if p in phases},
                               "card_tflops_after": card_rate}
    if peak_tflops:
        figures["useful_mfu"] = mfu(peak_tflops)
    if card_rate:
        figures["useful_mfu_at_card_rate_after"] = mfu(card_rate)
    return figures


def _environment() -> dict[str, Any]:
    import platform

    import torch

    from .cards import hbm_tbs

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("vllm", "transformers", "peft", "lightning"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception:  # noqa: BLE001 - absent is a fine answer here
            out[name] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
        out["card_hbm_tbs"] = hbm_tbs(out["gpu"])  # the vendor's figure (bench/cards.py), None when unknown
    return out


# ----------------------------------------------------------------------------- the command


#: The tokenizer files a model folder takes from ``--tokenizer-from`` (those that exist there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def check_build(shape: str, layers: Optional[int], tokenizer_from: Path) -> None:
    """``InputError`` naming the option, before anything is written: ``--build`` must be a known
    shape, ``--layers`` within its decoder, and ``--tokenizer-from`` must hold a tokenizer
    (``tokenizer.json``) whose every id is inside the shape's vocabulary."""
    from transformers import AutoTokenizer

    from atlas_lightning.errors import InputError

    from .shapes import shape_by_name

    try:
        named = shape_by_name(shape)
    except ValueError as err:
        raise InputError(f"--build {shape}: {err}") from None
    if layers is not None and not 1 <= layers <= named.num_layers:
        raise InputError(f"--layers {layers}: {shape} has {named.num_layers} decoder layers (1..{named.num_layers})")
    if not (tokenizer_from / "tokenizer.json").is_file():
        raise InputError(f"--tokenizer-from {tokenizer_from}: no tokenizer.json there (a model folder's tokenizer)")
    vocab = named.vocab_size
    size = len(AutoTokenizer.from_pretrained(str(tokenizer_from)))
    if size > vocab:
        raise InputError(f"--tokenizer-from {tokenizer_from}: its {size:,} tokens do not fit {shape}'s vocabulary "
                         f"of {vocab:,}")


def build_model_folder(shape: str, folder: Path, tokenizer_from: Optional[Path], layers: Optional[int] = None) -> Path:
    """A random-weight model of ``shape`` (first ``layers`` decoder layers; bf16, built on the GPU
    where there is one) saved as its real checkpoints are (``shapes.build_checkpoint_model``:
    Qwen3.5/3.6 shapes as ``Qwen3_5ForConditionalGeneration``, text model under
    ``model.language_model.*`` beside a vision tower, the full vocabulary), with
    ``tokenizer_from``'s tokenizer files (``TOKENIZER_FILES``, those there); written under a
    temporary name and renamed into place; kept when it exists."""
    import torch

    from .shapes import build_checkpoint_model, shape_by_name

    if (folder / "config.json").is_file():
        return folder
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_checkpoint_model(shape_by_name(shape), device=device, dtype=torch.bfloat16, layers=layers)
    tmp = folder.parent / f".{folder.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if tokenizer_from is not None and (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, tmp / name)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.bench.step", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where step_bench.json and step_bench.md go")
    parser.add_argument("--build", default=None, help="a bench/shapes.py shape to build into --model-dir first")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=None, help="with --build: the first N decoder layers")
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="with --build: a model folder's tokenizer")
    parser.add_argument("--replay-step", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="the fit's overrides (after --)")
    args = parser.parse_args(argv)
    if args.build and (args.model_dir is None or args.tokenizer_from is None):
        parser.error("--build needs --model-dir and --tokenizer-from")
    return exit_code(parser.prog, lambda: _build_and_fit(args, parser.prog))


def bench_overrides(out: Path, replay_step: int, build: Optional[str], layers: Optional[int]) -> list[str]:
    """The overrides that add ``StepBenchCallback`` to the fit (``+callbacks.step_bench``), with
    the shape and layer count ``--build`` wrote, for its report."""
    built = [f"+callbacks.step_bench.build={build}"] if build else []
    if build and layers is not None:
        built.append(f"+callbacks.step_bench.layers={layers}")
    return ["+callbacks.step_bench._target_=atlas_lightning.bench.step.StepBenchCallback",
            f"+callbacks.step_bench.out={out}", f"+callbacks.step_bench.replay_step={replay_step}", *built]


def save_report(out: Path, report: dict) -> None:
    """``report`` as ``out/step_bench.json`` and its table as ``out/step_bench.md``, each atomically."""
    atomic_write_text(out / "step_bench.json", json.dumps(report, indent=1) + "\n")
    atomic_write_text(out / "step_bench.md", markdown(report) + "\n")


def add_fit_edges(out: Path, called: float, returned: float) -> Optional[dict]:
    """Add ``fit_edges_s`` (module doc) to rank 0's report under ``out``, from the wall-clock
    times ``fit`` was called and returned and the stamps the callback wrote; the markdown is
    rewritten with it. None (nothing written) on another rank, or where no report of this call
    exists (none, or one an earlier run left in ``out``, whose first rollout precedes ``called``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    path = out / "step_bench.json"
    if getattr(rank_zero_only, "rank", 0) != 0 or not path.is_file():
        return None
    report = json.loads(path.read_text())
    stamps = report.get("fit_stamps") or {}
    first, ended = stamps.get("first_rollout_at"), stamps.get("train_ended_at")
    if first is None or first < called:
        return None
    report["fit_edges_s"] = {"opening": first - called, "closing": None if ended is None else returned - ended}
    save_report(out, report)
    return report["fit_edges_s"]


def _build_and_fit(args: argparse.Namespace, program: str) -> int:
    """``--build``'s model folder, then ``fit`` on the overrides with the benchmark's callback; a
    clean stop part-way prints its line, then the steps measured (``step_bench.md``). A bad option
    or override raises (``InputError``, ``ConfigError``) before anything is built or written."""
    from atlas_lightning.config import compose
    from atlas_lightning.errors import RunStopped

    started = time.monotonic()
    if args.build:
        check_build(args.build, args.layers, args.tokenizer_from)
    out = args.out.resolve()
    cfg = compose([*args.overrides, *bench_overrides(out, args.replay_step, args.build, args.layers)])
    if args.build:
        build_model_folder(args.build, args.model_dir, args.tokenizer_from, args.layers)
        print(f"model folder {args.model_dir} ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    from atlas_lightning.run.verbs import fit  # after compose: a bad override is refused before fit's imports load

    called = time.time()
    try:
        code = fit(cfg)
    except RunStopped as err:  # a clean stop part-way (``run/faults.py``): its line, then the steps measured
        code = report(program, err)
    add_fit_edges(out, called, time.time())
    report_file = out / "step_bench.md"
    if report_file.is_file():
        print(report_file.read_text())
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
