"""The proof that an engine applies what it was sent (``rollout/sync_probe.py``), on numbers alone:
the trainer's and the engine's probe log-probs at successive weight states, the engine carrying
a systematic error of its own (which the movement cancels) and a rounding noise (which it
does not). An ignored adapter, a stale engine, an engine that applies a change twice are
refused; clean syncs pass whether the movement is large or far below the noise (then the check
waits for the movement to accumulate, and still catches a lagging engine once it is
measurable). Also: the marked actor's shift, its exact restore, and the CLI's exit 2."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_lightning.errors import InputError
from atlas_lightning.rollout.sync_probe import (MEASURABLE, RESIDUAL_LIMIT, VERIFIABLE, MovementCheck, Reading,
                                                StartingCheckError, WeightSyncError, mark_shift, noise_floor)

TOKENS = 99
RNG = np.random.default_rng(0)
BASE = -RNG.uniform(0.5, 10.0, TOKENS)  # the probe's log-probs before any update
BIAS = RNG.normal(0.0, 3e-6, TOKENS)  # the engine's systematic error (kernels): the same at every state
DIRECTION = RNG.normal(0.0, 1.0, TOKENS) / np.sqrt(TOKENS)  # the update's direction over the probe, norm ~1


class Engine:
    """Serves a trainer state with its systematic error and fresh rounding noise, or not."""

    def __init__(self, seed: int = 1, rounding: float = 1e-6) -> None:
        self.rng = np.random.default_rng(seed)
        self.rounding = rounding

    def serve(self, trainer: np.ndarray) -> np.ndarray:
        return trainer + BIAS + self.rng.normal(0.0, self.rounding, trainer.size)


def _reading(version: int, trainer: np.ndarray, engine: np.ndarray) -> Reading:
    return Reading(version, trainer.copy(), engine.copy())


def _started(engine: Engine) -> MovementCheck:
    check = MovementCheck("lora")
    check.start(_reading(0, BASE, engine.serve(BASE)))
    return check


def test_the_noise_is_the_largest_verified_gap_and_never_below_float32_roundings():
    check = _started(Engine())
    assert check.noise == pytest.approx(max(noise_floor(BASE), float(np.linalg.norm(Engine().serve(BASE) - BASE))),
                                        rel=0.5)
    exact = MovementCheck("lora")
    exact.start(_reading(0, BASE, BASE))  # an engine that agrees to the bit still leaves a floor
    assert exact.noise == noise_floor(BASE) > 0


def test_a_clean_sync_with_a_large_movement_passes_with_a_small_residual():
    engine = Engine()
    check = _started(engine)
    after = BASE + 0.3 * DIRECTION  # a normal learning rate: far above the noise
    moved = check.check(_reading(1, after, engine.serve(after)))
    assert moved.measurable and moved.applied and moved.ratio < 1e-3
    assert check.reference.version == 1 and check.unverified_syncs == 0
    assert check.metrics()["rollout/applied_residual_ratio"] == moved.ratio


def test_a_clean_sync_with_a_tiny_movement_waits_and_decides_once_the_movement_is_measurable():
    engine = Engine()
    check = _started(engine)
    step = 2.0 * check.noise * DIRECTION  # each update moves the probe by 2 noises: not measurable alone
    trainer, decided_at = BASE.copy(), None
    for version in range(1, 20):
        trainer = trainer + step
        moved = check.check(_reading(version, trainer, engine.serve(trainer)))  # never a false alarm
        if moved.measurable:
            decided_at = version
            break
        assert check.reference.version == 0 and check.unverified_syncs == version  # judged against v0, not v-1
    # the cumulative movement from the last verified state decides, as soon as it is measurable
    assert decided_at == int(np.ceil(MEASURABLE / 2.0))
    assert moved.applied and moved.ratio < RESIDUAL_LIMIT / 4
    assert check.reference.version == decided_at and check.unverified_syncs == 0


@pytest.mark.parametrize("per_step", [0.3, 2.0], ids=["normal-lr", "tiny-lr"])
def test_a_stale_engine_is_refused_once_its_lag_is_measurable(per_step):
    """Reports what was sent, keeps serving v1: refused with a ratio ~1 whatever the step size."""
    engine = Engine()
    check = _started(engine)
    trainer = BASE + 0.3 * DIRECTION
    served = engine.serve(trainer)
    check.check(_reading(1, trainer, served))  # v1 verified
    step = (per_step if per_step < 1 else per_step * check.noise) * DIRECTION
    with pytest.raises(WeightSyncError, match=r"weight sync v\d+: since the verified v1 the trainer's probe "
                                              r"log-probs moved by .* and the engine's by .*; they differ by .*, "
                                              r"(0\.9\d|1\.0\d) of the expected movement .*refusing to roll out"):
        for version in range(2, 40):
            trainer = trainer + step
            check.check(_reading(version, trainer, engine.serve(BASE + 0.3 * DIRECTION)))
    assert check.last.measurable and check.last.ratio > 3 * RESIDUAL_LIMIT
    assert (version == 2) == (per_step < 1)  # a normal step decides at once; tiny ones when their sum is measurable


def test_an_ignored_adapter_is_refused_at_the_start_and_names_the_cause():
    engine = Engine()
    check = _started(engine)
    marked = BASE + 50 * check.noise * DIRECTION  # the marked adapter moves the trainer's probe
    with pytest.raises(StartingCheckError, match=r"weight sync v0, starting check: with the marked adapter the "
                                                 r"trainer's probe log-probs moved by .* the engine ignores the "
                                                 r"adapter it holds.*rollout\.weight_sync=merged.*refusing to train"):
        check.check(_reading(0, marked, engine.serve(BASE)), "the marked adapter", at_start=True)
    assert issubclass(StartingCheckError, InputError)  # the CLI's exit 2


def test_at_the_start_a_movement_too_small_to_decide_is_refused_not_waited_on():
    engine = Engine()
    check = _started(engine)
    barely = BASE + check.noise * DIRECTION
    with pytest.raises(StartingCheckError):
        check.check(_reading(0, barely, engine.serve(barely)), "the marked adapter", at_start=True)


class GrowingGapEngine:
    """A bf16 engine whose gap to the trainer grows with the distance from the actor: a fixed gap
    of norm ``ACTOR_GAP`` plus ``RELATIVE`` of the movement, as the 27B-shaped hybrid showed on
    an H100 (vLLM, fla in the trainer): the marked adapter moved the probe by 51.5, its gap was
    5.92, and the move back was off by 6.2 (a ratio of 0.12)."""

    ACTOR_GAP, RELATIVE = 1.6, 0.115

    def __init__(self, actor: np.ndarray) -> None:
        self.actor = actor
        self.bias = np.random.default_rng(3).normal(0.0, 1.0, actor.size)
        self.bias *= self.ACTOR_GAP / np.linalg.norm(self.bias)

    def serve(self, trainer: np.ndarray) -> np.ndarray:
        return trainer + self.bias + self.RELATIVE * (trainer - self.actor)


def _hybrid_start(keeps_the_mark: bool = False, ignores: bool = False):
    """The starting check's marked excursion on ``GrowingGapEngine``: the actor, the marked actor
    (moved by 51.5 in norm), the actor again; returns the check and the return move."""
    engine = GrowingGapEngine(BASE)
    check = MovementCheck("lora", "bfloat16")
    check.start(_reading(0, BASE, engine.serve(BASE)))
    marked = BASE + 51.5 * DIRECTION / np.linalg.norm(DIRECTION)
    check.check(_reading(0, marked, engine.serve(BASE if ignores else marked)), "the marked adapter", at_start=True)
    moved = check.check(_reading(0, BASE, engine.serve(marked if keeps_the_mark else BASE)),
                        "the actor served again after the marked adapter", at_start=True)
    return check, moved


def test_at_the_start_a_verifiable_move_within_the_limit_passes_where_the_gap_grows_with_the_movement():
    check, back = _hybrid_start()
    assert not back.measurable  # the marked gap became the noise: 8.7 noises, under MEASURABLE
    assert back.verifiable and back.applied and back.ratio == pytest.approx(0.115, rel=0.05)
    assert VERIFIABLE * back.noise <= back.expected < MEASURABLE * back.noise
    assert back.noise > 3 * GrowingGapEngine.ACTOR_GAP  # the marked state's gap
    assert check.reference.trainer is not None and check.unverified_syncs == 0 and check.last_ratio == back.ratio


def test_at_the_start_an_engine_that_keeps_the_marked_adapter_is_refused_on_the_way_back():
    with pytest.raises(StartingCheckError, match=r"the actor served again after the marked adapter .* "
                                                 r"(0\.9\d|1\.0\d) of the expected movement"):
        _hybrid_start(keeps_the_mark=True)


def test_at_the_start_an_engine_that_ignores_the_adapter_is_refused_where_the_gap_grows():
    with pytest.raises(StartingCheckError, match=r"with the marked adapter .* 1\.0\d of the expected movement"):
        _hybrid_start(ignores=True)


def test_after_the_start_a_verifiable_but_unmeasurable_move_still_waits():
    engine = Engine()
    check = _started(engine)
    after = BASE + (VERIFIABLE + MEASURABLE) / 2 * check.noise * DIRECTION / np.linalg.norm(DIRECTION)
    moved = check.check(_reading(1, after, engine.serve(after)))
    assert moved.verifiable and not moved.measurable and check.unverified_syncs == 1
    assert check.reference.version == 0


def test_an_engine_that_applies_the_change_twice_is_refused():
    engine = Engine()
    check = _started(engine)
    after = BASE + 0.3 * DIRECTION
    with pytest.raises(WeightSyncError, match=r"1\.0\d of the expected movement"):
        check.check(_reading(1, after, engine.serve(BASE + 0.6 * DIRECTION)))


def _marked(actor: np.ndarray) -> np.ndarray:
    """The marked actor: 51.5 from ``actor`` in norm, as on the card."""
    return actor + 51.5 * DIRECTION[::-1] / np.linalg.norm(DIRECTION)


def _marked_trip(engine: GrowingGapEngine, check: MovementCheck, version: int, actor: np.ndarray,
                 served_marked: np.ndarray, served_actor: np.ndarray):
    """A later sync's marked check on ``GrowingGapEngine``: the marked actor, then ``actor``; the
    engine serves ``served_marked`` and ``served_actor`` instead. Returns the move back."""
    check.check(_reading(version, _marked(actor), engine.serve(served_marked)), "the marked adapter")
    moved = check.check(_reading(version, actor, engine.serve(served_actor)), "the actor after the marked adapter")
    check.served(_reading(version, actor, engine.serve(served_actor)))
    return moved


def test_the_marked_check_decides_every_sync_whatever_the_learning_rate():
    """After the start, steps of 0.45 noises (the card's lr 1e-6, bf16) leave the norm rule
    undecided; the marked check verifies each sync, and refuses at its first sync an engine that
    keeps serving what it had (the previous version: it ignores the mark) or keeps the mark. (One
    that served the mark and then the previous version would differ by a step below the noise:
    all it could change in a rollout, module doc.)"""
    check, _ = _hybrid_start()
    engine = GrowingGapEngine(BASE)
    step = 0.45 * check.noise * DIRECTION / np.linalg.norm(DIRECTION)
    actor = BASE.copy()
    for version in (1, 2, 3):
        actor = actor + step
        back = _marked_trip(engine, check, version, actor, _marked(actor), actor)
        assert back.applied and check.unverified_syncs == 0 and check.reference.version == version
    stale, actor = actor, actor + step
    for served_marked, served_actor, where in ((_marked(actor), _marked(actor), "the actor after the marked adapter"),
                                               (stale, stale, "the marked adapter")):
        trial = MovementCheck("lora", "bfloat16")
        trial.start(check.reference)
        trial.noise = check.noise
        with pytest.raises(WeightSyncError, match=rf"weight sync v4, marked check: with {where} .*refusing to "
                                                  r"roll out") as info:
            _marked_trip(engine, trial, 4, actor, served_marked, served_actor)
        assert not isinstance(info.value, StartingCheckError)  # mid-run: a fault, not bad input


def test_a_known_move_between_verifiable_and_twice_verifiable_waits_rather_than_refuse_a_clean_engine():
    """At 5 noises a clean engine's residual may reach 2 noises (a ratio of 0.4): above the limit,
    within what a clean engine shows (``clean_ratio``), so the marked check leaves it undecided;
    a stale engine's ratio there is at least 0.6, and is refused."""
    engine = Engine(rounding=0.0)
    check = _started(engine)
    unit = DIRECTION / np.linalg.norm(DIRECTION)
    after = BASE + 5 * check.noise * unit
    off = after + 1.8 * check.noise * unit[::-1] / np.linalg.norm(unit[::-1])  # a clean engine at its worst
    moved = check.check(_reading(1, after, engine.serve(off)), "the marked adapter")
    assert moved.verifiable and not moved.measurable and RESIDUAL_LIMIT < moved.ratio <= moved.clean_ratio
    assert check.unverified_syncs == 1 and check.reference.version == 0
    with pytest.raises(WeightSyncError, match="marked check"):
        check.check(_reading(1, after, engine.serve(BASE + 0.5 * check.noise * unit)), "the marked adapter")


def test_an_engine_whose_probe_did_not_change_is_counted_between_actor_readings():
    """Reported, not judged: a lying engine (serves v0 while the trainer moves by a sixth of the
    measurable movement a step) is counted at every sync while the norm rule waits; a clean one
    never, nor one whose trainer did not move either."""
    clean, lying = Engine(), Engine(seed=2, rounding=0.0)
    checks = {name: _started(engine) for name, engine in (("clean", clean), ("lying", lying))}
    stale = lying.serve(BASE)
    for check, engine in ((checks["clean"], clean), (checks["lying"], lying)):
        check.served(_reading(0, BASE, stale if engine is lying else clean.serve(BASE)))
    trainer = BASE.copy()
    for version in (1, 2, 3):
        trainer = trainer + MEASURABLE / 6 * checks["clean"].noise * DIRECTION / np.linalg.norm(DIRECTION)
        for name, served in (("clean", clean.serve(trainer)), ("lying", stale)):
            reading = _reading(version, trainer, served)
            checks[name].check(reading)
            checks[name].served(reading)
        assert checks["clean"].metrics()["rollout/applied_engine_unmoved_syncs"] == 0
        lied = checks["lying"].metrics()
        assert lied["rollout/applied_engine_unmoved_syncs"] == version and lied["rollout/applied_unverified_syncs"]
    unmoved = MovementCheck("lora")
    unmoved.start(_reading(0, BASE, stale))
    unmoved.served(_reading(0, BASE, stale))
    unmoved.served(_reading(1, BASE, stale))  # the trainer did not move either: nothing to count
    assert unmoved.metrics()["rollout/applied_engine_unmoved_syncs"] == 0


def test_merged_refusals_name_the_merged_weights():
    check = MovementCheck("merged")
    check.start(_reading(0, BASE, Engine().serve(BASE)))
    with pytest.raises(WeightSyncError, match="does not serve the merged weights it was sent"):
        check.check(_reading(1, BASE + 0.3 * DIRECTION, Engine().serve(BASE)))


def test_the_marks_shift_is_sized_on_the_trainer_alone():
    noise = 1e-4
    calls = []

    def trainer_probe(shift):  # movement ~ linear in the shift, then saturating
        calls.append(shift)
        return BASE + np.tanh(3.0 * shift) * DIRECTION

    shift = mark_shift(trainer_probe, BASE, noise)
    moved = float(np.linalg.norm(trainer_probe(shift) - BASE))
    assert 32 * noise <= moved <= 128 * noise and len(calls) <= 6
    with pytest.raises(WeightSyncError, match="no lora_B perturbation moves the trainer's probe"):
        mark_shift(lambda shift: BASE, BASE, noise)  # an adapter that does not act on the probe
    blowing_up = mark_shift(lambda s: BASE + (np.inf if s > 1e-3 else s * 10) * DIRECTION, BASE, noise)
    assert blowing_up <= 1e-3  # a non-finite probe is a shift too large


def test_a_saturating_probe_marks_short_of_the_saturated_extreme():
    """A bf16 engine's noise is large: the probe's movement saturates (the hybrid on an H100 below
    the aimed 64 noises; the tiny bf16 hybrid near it). The scale is halved while half of it keeps
    SATURATED of the movement and MEASURABLE noises: the mark lies near the knee, not at the most
    extreme state; below that floor the refusal names the noise, not only the adapter."""
    from atlas_lightning.rollout.sync_probe import MARK_NOISES, SATURATED

    noise = 1.0

    def saturating(ceiling):
        return lambda shift: BASE + ceiling * np.tanh(shift) * DIRECTION

    for ceiling in (30.0, 40.0, 0.6 * MARK_NOISES / np.linalg.norm(DIRECTION)):
        probe = saturating(ceiling)
        shift = mark_shift(probe, BASE, noise)
        moved, halved = (float(np.linalg.norm(probe(s) - BASE)) for s in (shift, shift / 2))
        assert moved >= MEASURABLE * noise and np.tanh(shift) < 0.97, ceiling  # short of the extreme
        assert halved < max(MEASURABLE * noise, SATURATED * moved), ceiling  # the knee, to a factor of 2
    with pytest.raises(WeightSyncError, match=r"by 16 or more \(16 x the engine's noise 1,.* the most was 1[0-9.]+"):
        mark_shift(saturating(12.0), BASE, noise)


def test_the_marked_actor_moves_every_lora_b_randomly_and_is_restored_exactly(tiny_model_dir):
    """The mark: a seeded standard normal of scale ``shift`` on every actor ``lora_B`` entry (not
    one value: a constant shift makes each delta rank-1 with identical rows), the same on every
    call, nothing else touched, the exact tensors put back."""
    import torch

    from atlas_lightning.models.probe import marked_actor, probe_logprobs
    from tests.model_builds import actor_critic

    model = actor_critic(str(tiny_model_dir), {"rank": 4, "alpha": 8}, dtype="float32")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    probe = list(range(20, 60))
    actor = probe_logprobs(model, probe, "cpu")
    marks = []
    for _ in range(2):
        with marked_actor(model, 0.01):
            marks.append({name: param.detach() - before[name] for name, param in model.named_parameters()})
            assert probe_logprobs(model, probe, "cpu") != actor
    for name, delta in marks[0].items():
        assert torch.equal(delta, marks[1][name]), name  # the same mark on every call
        if ".lora_B.actor." in name:
            assert bool((delta != 0).all()) and 0.007 < float(delta.std()) < 0.013, name
            assert delta.shape[0] == 1 or float((delta - delta[:1]).abs().max()) > 1e-3, name  # rows differ
        else:
            assert not delta.any(), name
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    with pytest.raises(RuntimeError, match="inside"), marked_actor(model, 0.5):
        raise RuntimeError("inside")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_engines_adapter_is_written_in_the_dtype_the_engine_holds_it_in(tiny_model_dir, tmp_path):
    """The sync writes the engines' adapter in the model's dtype (peft's float32 masters cast):
    the folder holds that dtype, and the engine's form of it (cast, then B scaled, as vLLM loads
    it) is byte for byte the form of the masters: nothing the engine keeps is lost."""
    import torch
    from safetensors.torch import load_file

    from atlas_lightning.rollout.digest import lora_digest
    from atlas_lightning.rollout.sync import export_actor_adapter
    from tests.model_builds import actor_critic

    model = actor_critic(str(tiny_model_dir), {"rank": 4, "alpha": 8}, dtype="float32")
    with torch.no_grad():
        for param in model.actor_parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    masters = export_actor_adapter(model, tmp_path / "masters")
    cast = export_actor_adapter(model, tmp_path / "cast", dtype=torch.bfloat16)
    written = load_file(str(tmp_path / "cast" / "adapter_model.safetensors"))
    assert written and {t.dtype for t in written.values()} == {torch.bfloat16}
    assert {a.dtype for a, _, _ in cast.values()} == {torch.bfloat16}
    held = dict(dtype=torch.bfloat16, scale_b=True)
    assert lora_digest(cast, **held).total == lora_digest(masters, **held).total
    assert lora_digest(cast).total != lora_digest(masters).total  # as written, they differ


def test_a_starting_check_failure_exits_2_with_its_message_and_no_traceback(monkeypatch, capsys, tmp_path):
    from atlas_lightning import cli
    from atlas_lightning.run import verbs

    def fit(cfg):
        raise StartingCheckError("weight sync v0, starting check: the engine ignores the adapter it holds")

    monkeypatch.setattr(verbs, "fit", fit)
    assert cli.main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "atlas-lightning fit: weight sync v0, starting check: the engine ignores the adapter it holds" in err
    assert "Traceback" not in err


def test_a_merged_engine_that_cannot_answer_before_its_first_load_still_gets_the_starting_check(tiny_model_dir,
                                                                                                tmp_path):
    """A merged engine that slept without its weights (vLLM's level 2) has no base to compare
    before the first load: the check starts from the actor, and the marked move still decides.
    Through the real sync with the transformers reference engine (no vLLM)."""
    import torch
    from transformers import AutoModelForCausalLM
    from types import SimpleNamespace

    from atlas_lightning.config import compose
    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.rollout.engine import EngineError
    from atlas_lightning.rollout.engines.hf_engine import HFEngine

    class DroppedUntilLoaded(HFEngine):
        loaded = False

        def load_weights(self, weights):
            self.loaded = True
            return super().load_weights(weights)

        def prompt_logprobs(self, token_ids):
            if not self.loaded:
                raise EngineError("weights dropped: no probe possible")
            return super().prompt_logprobs(token_ids)

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}",
                   "rollout.weight_sync=merged"])
    module = PPOModule(cfg)
    module.configure_model()
    engine = DroppedUntilLoaded(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    serving = SimpleNamespace(engine=engine, probe_token_ids=lambda: list(range(20, 120)), weights_version=None)
    metrics = module.weight_sync.sync(module.model, serving, version=0)
    assert metrics["rollout/applied_residual_ratio"] < RESIDUAL_LIMIT / 4 and serving.weights_version == 0


@pytest.mark.parametrize("dtype, eps", [("float32", 2.0 ** -23), ("bfloat16", 2.0 ** -7), ("float16", 2.0 ** -10)])
def test_the_noise_floor_follows_the_compute_dtype(dtype, eps):
    """One rounding of the compute dtype on every token floors the noise (in norm: of a unit
    log-prob; per token, the absolute probe's floor: of the probe's largest log-prob); float32's
    floors are the float32 roundings as before, which the dtype term never exceeds there."""
    from atlas_lightning.rollout.sync_probe import probe_scale, rounding_floor

    scale = probe_scale(BASE)
    assert noise_floor(BASE, dtype) == pytest.approx(max(noise_floor(BASE), eps * np.sqrt(TOKENS)))
    assert rounding_floor(scale, dtype=dtype) == pytest.approx(max(rounding_floor(scale), scale * eps))
    check = MovementCheck("lora", dtype)
    check.start(_reading(0, BASE, BASE))  # an engine that agrees to the bit (the hf engine at the base)
    assert check.noise == noise_floor(BASE, dtype)
    if dtype == "float32":
        assert noise_floor(BASE, dtype) == noise_floor(BASE)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_probe_that_moves_in_rounding_steps_is_marked_where_it_follows_the_shift(dtype):
    """In a half-precision dtype the trainer's probe moves in steps (tiny model, bf16: a lora_B
    shift of 3e-7 moves it by 0, one of 1e-6 by 0.145, linear only from about 1e-2). Aimed from a
    float32 floor the mark is out of reach; from the dtype's floor it lands, and a clean engine
    that follows passes while one that ignores the mark is refused."""
    from atlas_lightning.rollout.sync_probe import DTYPE_EPS

    step = DTYPE_EPS[dtype] * np.sqrt(TOKENS)  # the probe's smallest movement in this dtype

    def stepped(shift):  # below about 1e-2: a rounding step at most; above: follows the shift
        linear = 270.0 * shift
        return BASE + (0.0 if shift < 1e-6 else max(step * 1.07, linear)) * DIRECTION

    with pytest.raises(WeightSyncError, match="no lora_B perturbation moves the trainer's probe"):
        mark_shift(stepped, BASE, noise_floor(BASE))
    check = MovementCheck("lora", dtype)
    check.start(_reading(0, BASE, BASE))
    shift = mark_shift(stepped, BASE, check.noise)
    marked = stepped(shift)
    assert np.linalg.norm(marked - BASE) >= MEASURABLE * check.noise
    moved = check.check(_reading(1, marked, marked + step * DIRECTION[::-1]), "the marked adapter", at_start=True)
    assert moved.ratio < RESIDUAL_LIMIT / 4
    ignoring = MovementCheck("lora", dtype)
    ignoring.start(_reading(0, BASE, BASE))
    with pytest.raises(StartingCheckError, match="1.00 of the expected movement"):
        ignoring.check(_reading(1, marked, BASE), "the marked adapter", at_start=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_starting_check_with_the_reference_engine_in_each_dtype(tiny_model_dir, tmp_path, dtype):
    """The real sync and the transformers reference engine in ``dtype`` (it agrees with the
    trainer to float32 roundings at the base, to bf16 ones once an adapter acts): a clean engine
    passes the starting check and clean updates; one that holds the adapter and applies none is
    refused."""
    import torch
    from types import SimpleNamespace

    from atlas_lightning.config import compose
    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.rollout.factory import hf_engine
    from tests.rollout.test_sync_applied import _update

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}",
                   f"model.dtype={dtype}", "rollout.engine=hf", "rollout.max_logprob_gap=0.3"])
    engine = hf_engine(cfg, rank=0, local_rank=0, world_size=1)
    probe = [(37 * i) % 1900 + 20 for i in range(300)]
    serving = SimpleNamespace(engine=engine, probe_token_ids=lambda: probe, weights_version=None)
    module = PPOModule(cfg)
    module.configure_model()
    sync = module.weight_sync
    metrics = sync.sync(module.model, serving, version=0)
    assert metrics["rollout/applied_residual_ratio"] < RESIDUAL_LIMIT / 4
    optimizer = torch.optim.AdamW(list(module.model.actor_parameters()), lr=2e-3)
    for version in (1, 2, 3):
        _update(module, optimizer)
        metrics = sync.sync(module.model, serving, version=version)
        assert metrics["rollout/logprob_gap"] <= metrics["rollout/logprob_gap_bound"]
        assert sync.movement.last.residual <= RESIDUAL_LIMIT / 2 * max(sync.movement.last.expected,
                                                                        MEASURABLE * sync.movement.noise)

    class Ignoring(type(engine)):
        def prompt_logprobs(self, token_ids):
            adapter = getattr(self.model, "disable_adapter", None)
            with adapter() if adapter is not None else __import__("contextlib").nullcontext():
                return super().prompt_logprobs(token_ids)

    engine.set_adapter(None)
    engine.__class__ = Ignoring
    module = PPOModule(cfg)
    module.configure_model()
    with pytest.raises(StartingCheckError, match="1.00 of the expected movement"):
        module.weight_sync.sync(module.model, serving, version=0)
