"""Proof that an engine applies the weights it was just sent: its probe log-probs move as the trainer's do.

A digest proves that tensors arrived, not that they act: vLLM may hold a LoRA adapter and leave
its outputs unchanged (reported on Qwen3.5/3.6 hybrids), and an engine may report what it was
sent while it serves what it had. The weight sync (``rollout/sync.py``) therefore also asks how
the probe sequence's log-probs MOVED between two weight states, on each side, and trusts
neither the engine's report nor the learning rate.

The rule. Between a verified state R (the reference) and the state S just served, over the
probe's tokens (vectors of per-token log-probs; norms are L2 norms over the tokens):

* expected ``e = T(S) - T(R)``: the trainer's movement, computed from the update itself;
* observed ``o = E(S) - E(R)``: the engine's, where its systematic error largely cancels;
* residual ``r = o - e``: the engine-trainer gap at S less the gap at R.

The engine applies what it was sent when ``|r| <= RESIDUAL_LIMIT * |e|``: the observed movement
lies within a quarter of the expected one's length of it. An engine that ignores the change
(an ignored adapter, a previous version still served) shows ``o ~ 0``, so ``|r| ~ |e|``: a ratio
of 1, four times the limit, whatever the learning rate; one that applies it twice shows 1 too.

Measurable. The ratio decides only when ``|e| >= MEASURABLE * noise``, ``noise`` being the
largest gap norm ``|E - T|`` of any verified state of this process (at least the rounding floor:
``NOISE_ULPS`` float32 roundings of the probe's largest log-prob on every token, and one rounding
of the model's compute dtype on every token, ``noise_floor``). Then even a clean engine
whose gaps did not cancel at all (``|r| <= 2 noise``) stays at half the limit. Below it (a tiny
learning rate) the sync is not decided and the reference stays the last VERIFIED state: the next
syncs are compared with it, so the trainer's movement accumulates until it is measurable, and an
engine that lags by a measurable movement is caught at the first sync where its lag is. An
engine is never judged against its own unverified output, and nothing passes forever unjudged
but a lag too small to tell from the engine's numerical noise, which is also all it could
change in a rollout. A failed decision raises ``WeightSyncError``.

Verifiable, at the start. The starting check cannot wait for a movement to grow, and a bf16
engine's gap grows with the movement itself, so a move of a given size may never reach
``MEASURABLE`` noises. Measured on the 27B-shaped hybrid (vLLM on an H100, bf16, fla in the
trainer): the move back from the marked adapter, 51.5 in norm, was 0.12 off (ratio, half the
limit), but the marked state's own gap (5.92) had become the noise, so the move was 8.7 noises
and the starting check refused a clean engine. There a move of ``VERIFIABLE`` noises whose ratio
is within the limit proves the engine applied it: an engine that did not shows ``o`` within
its own run-to-run change, at most two noises, so a ratio of at least ``1 - 2 / VERIFIABLE``
(0.5, twice the limit). A refusal still needs ``MEASURABLE`` noises, so no clean engine is
refused by a small move; later syncs keep the rule above (they can wait).

The starting check (this process's first sync, before anything samples). First, with and
without the adapter: the engine's log-probs before any load (the base it was built from, when
they agree with the trainer's base within ``rollout.max_logprob_gap``) are the reference, and
the move to the actor (its adapter, or merged into the base) is judged when it is measurable: a
starting adapter (``model.actor_adapter``, ``trainer.init_from``, a resume) that the engine
ignores is refused there. But a fresh adapter (``lora_B = 0``) does not act at all, and a starting
adapter may act below the noise. So the sync, from the actor (verified by digest and the
absolute probe), loads the MARKED actor (a seeded standard normal of one scale added to every
``lora_B`` entry, the scale sized on the trainer alone so that the probe moves by about
``MARK_NOISES`` noises, short of saturation: an adapter that acts through every adapted module
whatever the actor's state; with merged syncs, merged into the base), then the actor again. Both moves must pass the rule: an engine
that ignores the adapter fails the first, one that keeps what it served fails either, and the
run stops before any training with ``StartingCheckError``, an ``InputError`` (the CLI exits 2
with its message). It costs two extra loads; the marked check repeats the last two at later syncs.

The marked check, after the start (``rollout.marked_check_every``). Later syncs cannot rely on
the update's own movement: at the report's learning rate it stays below a bf16 engine's noise for
many steps. Measured on the card (H100, vLLM 0.26, the 16-layer 27B-shaped hybrid, bf16, LoRA r64,
lr 1e-6, three clean steps): each step moved the trainer's probe by 0.44-0.46 noises, so the norm
rule left every sync undecided, and the share of the trainer's step the engine showed along it
was 1.0 short of it (``|beta - 1|`` 0.97-1.02, standard error 0.04) for a CLEAN engine, exactly
what a stale one shows: in bf16 a step that small is the trainer's own rounding, not the update,
so nothing computed from the update tells a clean engine from a stale one. So every
``marked_check_every``-th sync (1, the default: every sync) serves the MARKED actor first (the
current actor with the starting check's perturbation, of the scale found at the start) and then
the actor, and judges both moves, each as large as the mark whatever the learning rate: an
engine that keeps what it served, or ignores a load, is refused at that sync. Such a known move
is decided at ``VERIFIABLE`` noises: it passes within ``RESIDUAL_LIMIT`` and is refused above the
largest ratio a clean engine can show there (``Movement.clean_ratio``: a residual of two noises);
between the two (a move of 4-8 noises) it waits, as a small move does, so no clean engine is
refused. The cost: one more load and one more probe a checked sync.

The mark. A bf16 engine's gap at the marked state grows with how extreme and how degenerate
that state is, not with the movement alone. On the card (H100, vLLM 0.26, bf16, fla in the
trainer, the 27B-shaped hybrid, LoRA r64) the mark then added ONE value to every ``lora_B``
entry (each delta rank-1 with identical output rows) and took the scale that moved the probe
most (1.12, where the movement saturated at 51.5 short of the aimed 64 noises): with merged sync
the marked state's gap was about 16 (the actor's 1.66) and the marked move was off by 16.18, a
ratio of 0.31, refusing a clean engine; with LoRA sync 5.92 and 0.12. Reproduced on CPU (tiny
bf16 hybrid, vLLM CPU engine, 99 probe tokens, fresh actor, noise 0.078, the actor's gap 0.010):
that mark (scale 2.97, movement 2.53, saturated) had gaps of 0.90 (LoRA) and 0.95 (merged) and
ratios 0.36 and 0.38, refused. Measured apart: the same constant mark short of saturation (the
movement at 68% of its ceiling) showed a gap of 0.03 and a ratio of 0.016-0.019; a random mark at
the saturated scale 0.07-0.11 and 0.03-0.04; the random mark short of saturation (now: halved
while half the scale keeps ``SATURATED`` of the movement, ``mark_shift``) 0.022 and 0.013-0.014
(23 noises, 18x below the limit), for both kinds. Not the cause: the merged engine's rounded
weights against the trainer's unmerged adapter (fp32 factors). Computing the trainer's probe
from the merged bf16 weights it sends moved it by about what separated it from the engine (at
the saturated constant mark 1.00 against 1.15-1.17; 0.01-0.06 elsewhere): rounding noise of an
ill-conditioned state, not a served-versus-trained difference; so the expected movement stays the
trainer's own forward.

Why not a version stamp the engine echoes: a stamp written into one tensor (a bias, an unused
token's row) proves that tensor was read, not that every adapted module acts (an engine that
applies LoRA to some layer kinds and not others would echo it), and LoRA cannot reach a tensor
the adapter does not target. The movement is what a rollout samples from. Its limit: an engine
that ignores only modules carrying less than about a quarter of the probe's movement passes.

Figures (tiny model, float32, the vLLM CPU engine, ``tests/rollout/test_sync_applied.py``; the
table is in atlas_lightning/bench/README.md, "The weight sync's proof of application"): a clean
residual stays at 0.42-0.45 noises, so clean syncs pass 9-10x below the limit at lr 1e-6
(decided at the fifth update) and about 4,000x below at lr 2e-3, the starting check 37-40x
below, for LoRA and merged syncs alike; an ignored adapter and a lying engine show a ratio of
1.00 (4x over) at both learning rates. By construction the false-alarm margin is at least 2x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from atlas_lightning import distributed as dist_utils
from atlas_lightning.config import DTYPE_EPS
from atlas_lightning.errors import InputError

#: The largest residual, as a share of the expected movement, of an engine that applies the weights.
RESIDUAL_LIMIT = 0.25
#: A movement decides once its norm is at least this many noises (module doc, "Measurable").
MEASURABLE = 16.0
#: At the start, a movement this many noises long with its residual within the limit is verified
#: (module doc, "Verifiable, at the start").
VERIFIABLE = 4.0
#: The marked adapter moves the trainer's probe by about this many noises (accepted within 2x).
MARK_NOISES = 64.0
#: Trainer-only tries to size the marked adapter's perturbation.
MARK_TRIES = 10
#: A mark is saturated while half its scale still moves the probe by this share of its movement
#: (where the movement follows the scale, half the scale moves it by half); it is then halved.
#: Measured (tiny bf16 hybrid, vLLM CPU engine): the constant mark's gap was 0.03 at 68% of the
#: saturated movement and 1.15-1.38 at 99% (module doc, "The mark").
SATURATED = 0.75
#: float32's relative resolution (2**-23): the finest gap two float32 log-probs can show.
FLOAT32_EPS = DTYPE_EPS["float32"]
#: A clean engine differs from the trainer by a few roundings of the largest probe log-prob
#: (a log-softmax over the vocabulary; seen: 3-5 float32 ulps on the tiny model, gaps 3.8e-6 to
#: 5.7e-6 at |log-prob| 10.7): the noise floor, so that a lucky first sync cannot set the bound
#: below what later clean syncs show.
NOISE_ULPS = 4


class WeightSyncError(RuntimeError):
    """The engines do not hold, or do not apply, the weights the trainer sent."""


class StartingCheckError(WeightSyncError, InputError):
    """The starting check failed: this engine does not apply what it is sent (the run cannot use
    this engine with this model and sync kind); raised before any training, the CLI exits 2."""


@dataclass(frozen=True)
class Reading:
    """One served weight state: ``version`` and the probe's per-token log-probs on each side."""

    version: int
    trainer: np.ndarray
    engine: np.ndarray

    def gap_norm(self) -> float:
        return float(np.linalg.norm(self.engine - self.trainer))


@dataclass(frozen=True)
class Movement:
    """Norms of the expected and observed movements between two readings, of the residual, and
    the noise they are judged against (module doc; the maximum over ranks)."""

    expected: float
    observed: float
    residual: float
    noise: float

    @property
    def measurable(self) -> bool:
        return self.expected >= MEASURABLE * self.noise

    @property
    def verifiable(self) -> bool:
        return self.expected >= VERIFIABLE * self.noise

    @property
    def ratio(self) -> float:
        """The residual as a share of the expected movement (inf when nothing was expected)."""
        return self.residual / self.expected if self.expected > 0 else math.inf

    @property
    def applied(self) -> bool:
        return self.ratio <= RESIDUAL_LIMIT

    @property
    def clean_ratio(self) -> float:
        """The largest ratio a clean engine can show: a residual of two noises, its gaps at both
        ends not cancelling at all (module doc, "Measurable")."""
        return 2 * self.noise / self.expected if self.expected > 0 else math.inf


def rounding_floor(scale: float, tokens: int = 1, dtype: str = "float32") -> float:
    """The rounding floor: ``NOISE_ULPS`` float32 roundings of a log-prob of magnitude ``scale``
    (``probe_scale``) on each of ``tokens`` tokens, as an L2 norm over them; with one token, the
    per-token floor (the weight sync's probe bound, ``sync.py``), there at least one rounding of
    that log-prob in the compute ``dtype``. No gap a clean engine shows is held to less.

    Why the dtype: a model computing in bf16 rounds its activations to 2**-7. Measured on the
    tiny model with the hf engine (bf16, 299 probe tokens, largest |log-prob| 11.3): the engine
    agrees with the trainer to 4e-6 at the base, a float32-sized first gap, yet once the adapter
    acts (a lora_B shift of 1e-4 to 0.1) the clean gap is 0.17-0.35 in norm and 0.03-0.08 a token
    (one bf16 rounding of the largest log-prob: 0.088); vLLM's bf16 gaps are 0.06-0.11 a token.
    A float32 floor let that first sync set the bound 4,000x below what later clean syncs show."""
    per_token = NOISE_ULPS * scale * FLOAT32_EPS
    if tokens <= 1:
        return max(per_token, scale * DTYPE_EPS.get(dtype, FLOAT32_EPS))
    return per_token * math.sqrt(tokens)


def probe_scale(trainer: np.ndarray) -> float:
    """The probe's largest |log-prob| (``trainer``: per token), at least 1."""
    return max(1.0, float(np.max(np.abs(trainer)))) if trainer.size else 1.0


def noise_floor(trainer: np.ndarray, dtype: str = "float32") -> float:
    """The rounding floor of the probe ``trainer`` over all its tokens, in norm: ``rounding_floor``,
    and at least one rounding of a unit log-prob in the compute ``dtype`` on every token.

    Why the second: in bf16 the trainer's own probe moves in steps. Measured (tiny model, bf16,
    299 tokens): a lora_B shift of 3e-7 moves it by 0, one of 1e-6 by 0.145 (2**-7 x sqrt(299)
    is 0.135), and it follows the shift only from about 1e-2 (2.7); a float32 floor (9e-5) set
    the marked adapter's aim at 0.006, below any movement the probe can show, and the starting
    check refused a clean engine. With this floor the aim (64 x 0.135) lies where the movement
    is linear. An engine's larger measured gap (the 27B-shaped hybrid on the H200: 1.64) still
    decides, as before."""
    floor = rounding_floor(probe_scale(trainer), trainer.size)
    return max(floor, DTYPE_EPS.get(dtype, FLOAT32_EPS) * math.sqrt(max(1, trainer.size)))


def movement(before: Reading, after: Reading, noise: float) -> Movement:
    """The movement from ``before`` to ``after`` (module doc). Collective: the residual, the
    observed movement and the noise are every rank's largest, the expected movement the least."""
    expected = after.trainer - before.trainer
    observed = after.engine - before.engine
    residual, observed_norm, noise, neg_expected = dist_utils.all_reduce_max(
        [float(np.linalg.norm(observed - expected)), float(np.linalg.norm(observed)), noise,
         -float(np.linalg.norm(expected))])
    return Movement(expected=-neg_expected, observed=observed_norm, residual=residual, noise=noise)


def engine_unmoved(before: Reading, after: Reading) -> bool:
    """Whether the engine's probe log-probs are ``before``'s to the bit while the trainer's moved
    beyond float32 roundings (``rounding_floor``): what an engine still serving the weights it had
    shows, and a clean one whose change the engine's dtype rounds away everywhere (a tiny learning
    rate on a small model). Collective: true when it holds on any rank. Reported, not judged."""
    moved = float(np.linalg.norm(after.trainer - before.trainer))
    unmoved = bool(np.array_equal(after.engine, before.engine)) and (
        moved > rounding_floor(probe_scale(after.trainer), after.trainer.size))
    return dist_utils.all_reduce_max([float(unmoved)])[0] > 0


class MovementCheck:
    """The rule over a process's syncs (module doc): the reference (the last verified reading) and
    the noise. ``kind``: the sync kind (``lora`` or ``merged``), named in its messages;
    ``dtype``: the model's compute dtype (``model.dtype``), for the noise floor (``noise_floor``)."""

    def __init__(self, kind: str, dtype: str = "float32") -> None:
        self.kind = kind
        self.dtype = dtype
        self.reference: Optional[Reading] = None
        self.noise = 0.0
        #: The last movement judged or deferred, and the syncs since the last verified one.
        self.last: Optional[Movement] = None
        self.last_ratio: Optional[float] = None
        self.unverified_syncs = 0
        #: The last actor reading (``served``), and the syncs whose engine probe stayed that one's
        #: to the bit while the trainer's moved: reported only.
        self.previous: Optional[Reading] = None
        self.engine_unmoved_syncs = 0

    def start(self, reading: Reading) -> None:
        """``reading`` is verified otherwise (digest and absolute probe): the first reference."""
        self.noise = 0.0
        self._verified(reading)

    def check(self, reading: Reading, loaded: Optional[str] = None, *, at_start: bool = False,
              may_wait: Optional[bool] = None) -> Movement:
        """Judge the move from the reference to ``reading``; a verified one becomes the reference.
        ``loaded``: what was served to make a move of known size (the marked actor, or the actor
        after it; module doc, "The marked check"), decided at ``VERIFIABLE`` noises; ``at_start``:
        the starting check's (a failure is then a ``StartingCheckError``, and a known move within
        the limit is verified, module doc, "Verifiable, at the start"); ``may_wait``: a move too
        small to decide is left undecided (default: outside the starting check). Raises
        ``WeightSyncError`` when the engine does not follow."""
        moved = movement(self.reference, reading, self.noise)
        self.last = moved
        known = loaded is not None and moved.verifiable
        decided = moved.measurable or (known and (moved.applied or (not at_start and moved.ratio > moved.clean_ratio)))
        if not decided and (not at_start if may_wait is None else may_wait):
            self.unverified_syncs += 1
            return moved
        if not (decided and moved.applied):
            raise (StartingCheckError if at_start else WeightSyncError)(
                self._refusal(moved, reading, loaded, at_start))
        self.last_ratio = moved.ratio
        self._verified(reading)
        return moved

    def served(self, reading: Reading) -> None:
        """``reading`` is the actor's (not a marked state's): counted in ``engine_unmoved_syncs``
        when the engine's probe is the previous actor reading's to the bit while the trainer's
        moved (``engine_unmoved``). Collective."""
        if self.previous is not None:
            self.engine_unmoved_syncs += engine_unmoved(self.previous, reading)
        self.previous = reading

    def _verified(self, reading: Reading) -> None:
        self.reference = reading
        self.unverified_syncs = 0
        floor = noise_floor(reading.trainer, self.dtype)
        self.noise = dist_utils.all_reduce_max([max(self.noise, floor, reading.gap_norm())])[0]

    def _refusal(self, moved: Movement, reading: Reading, loaded: Optional[str], at_start: bool) -> str:
        cause = ("ignores the adapter it holds, or serves one it held before (vLLM may leave a LoRA adapter "
                 "unapplied on some architectures, e.g. Qwen3.5/3.6 hybrids; rollout.weight_sync=merged "
                 "avoids LoRA in the engine)" if self.kind == "lora" else
                 "does not serve the merged weights it was sent (it still serves what it had)")
        since = f"with {loaded}" if loaded else f"since the verified v{self.reference.version}"
        check = "starting check" if at_start else "marked check" if loaded else ""
        head = f"weight sync v{reading.version}{', ' + check if check else ''}: "
        return (f"{head}{since} the trainer's probe log-probs moved by {moved.expected:.4g} (norm over the probe) "
                f"and the engine's by {moved.observed:.4g}; they differ by {moved.residual:.4g}, "
                f"{moved.ratio:.2f} of the expected movement (an engine that applies the weights stays within "
                f"{RESIDUAL_LIMIT}; noise {moved.noise:.3g}): the engine {cause}; "
                f"refusing to {'train' if at_start else 'roll out'}")

    def metrics(self) -> dict[str, float]:
        """``rollout/applied_residual_ratio`` (of the last verified move), ``rollout/applied_movement``
        (the last move's expected norm in noises), ``rollout/applied_unverified_syncs`` and, reported
        without being judged, ``rollout/applied_engine_unmoved_syncs`` (``served``, over the run)."""
        out = {"rollout/applied_unverified_syncs": float(self.unverified_syncs),
               "rollout/applied_engine_unmoved_syncs": float(self.engine_unmoved_syncs)}
        if self.last_ratio is not None:
            out["rollout/applied_residual_ratio"] = self.last_ratio
        if self.last is not None and self.last.noise > 0:
            out["rollout/applied_movement"] = self.last.expected / self.last.noise
        return out


def mark_shift(trainer_probe: Callable[[float], np.ndarray], actor: np.ndarray, noise: float) -> float:
    """The scale of the marked adapter's ``lora_B`` perturbation (``models.probe.marked_actor``):
    one that moves the trainer's probe log-probs (``trainer_probe(shift)``, the marked actor's;
    ``actor``: the actor's own) by about ``MARK_NOISES * noise`` in norm, within 2x. Trainer only:
    nothing reaches an engine.

    Where the movement saturates (below that aim, or within it), the scale is halved while half of
    it still moves the probe by ``SATURATED`` of its movement and by ``MEASURABLE`` noises: the
    mark is the least extreme state that still moves the probe about as far, since a bf16
    engine's gap grows with how extreme the marked state is (module doc, "The mark"). The rule
    decides at ``MEASURABLE`` noises, where a clean engine whose gaps did not cancel at all stays
    at half the limit. A bf16 engine's noise is large (the 27B-shaped hybrid on an H100: a gap
    norm of 1.66 over the probe, so 64 noises would be ~10 nats a token, more than any
    perturbation moves a log-prob). ``WeightSyncError`` when no scale reaches that floor, naming
    the movement and the noise."""
    target, floor = MARK_NOISES * noise, MEASURABLE * noise
    tried: dict[float, float] = {}

    def moved_by(shift: float) -> float:
        marked = trainer_probe(shift)
        moved = float(np.linalg.norm(marked - actor)) if np.all(np.isfinite(marked)) else math.inf
        tried[shift] = dist_utils.all_reduce_max([moved])[0]
        return tried[shift]

    shift = 1e-2
    for _ in range(MARK_TRIES):
        moved = moved_by(shift)
        if target / 2 <= moved <= 2 * target:
            break
        # the movement grows about linearly with a small shift
        shift *= 1e-3 if not math.isfinite(moved) else min(1e3, max(1e-3, target / moved if moved > 0 else 1e3))
    in_window = [moved for moved in tried.values() if target / 2 <= moved <= 2 * target]
    best = in_window[0] if in_window else max((m for m in tried.values() if m <= 2 * target), default=0.0)
    if best < floor:
        raise WeightSyncError(f"weight sync, starting check: no lora_B perturbation moves the trainer's probe "
                              f"log-probs by {floor:.3g} or more ({MEASURABLE:g} x the engine's noise {noise:.3g}, "
                              f"the largest trainer-engine gap norm over the probe); the most was {best:.3g}: the "
                              f"actor adapter does not act on the probe sequence, or the engine's numbers differ "
                              f"from the trainer's too much to prove that it applies it")
    shift = next(tried_shift for tried_shift, moved in tried.items() if moved == best)
    for _ in range(MARK_TRIES // 2):  # saturated: halving the scale keeps most of the movement
        if not max(floor, SATURATED * tried[shift]) <= moved_by(shift / 2) <= 2 * target:
            break
        shift /= 2
    return shift
