"""Compare ``atlas_lightning.algorithms`` with verl's own code on the same random tensors.

Also compared: the tests' reference copies of verl functions the step does not run
(``verl_reference.py``: full-logits entropy and log-probs, the entropy loss,
``compute_rewards``, the adaptive KL controller), and verl's old-style
``compute_policy_loss`` against the step's ``compute_policy_loss_vanilla`` given the same
clip ranges as a config.

Not collected by pytest (verl is not a dependency). Run it by hand against a verl checkout
or an unpacked verl wheel (0.9.x):

    PYTHONPATH=/path/to/verl-root .venv/bin/python tests/algorithms/verl_parity.py [--stub-missing]

``/path/to/verl-root`` is the folder that holds the ``verl`` package. A full ``import verl``
pulls Ray, tensordict and more; ``--stub-missing`` instead loads only
``verl/utils/torch_functional.py`` and ``verl/trainer/ppo/core_algos.py`` by file path,
with in-memory stand-ins for the handful of names they import at module level (nothing is
written to disk). ``apply_kl_penalty`` is taken from ``verl/trainer/ppo/ray_trainer.py``
by compiling that one function's source (ray_trainer itself is never imported).

Prints, for each function, the largest absolute difference over all cases (0 means bit
identical) and compares signatures; exits 1 if a difference exceeds 1e-6 or a signature
differs.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import math
import sys
import types
from pathlib import Path

import torch

import verl_reference as reference  # this file's folder, on sys.path when run as a script
from atlas_lightning.algorithms import functional as ours_F
from atlas_lightning.algorithms import ppo as ours

TOLERANCE = 1e-6
#: Functions of verl's ``torch_functional.py`` (the rest are ``core_algos.py``'s).
VERL_FUNCTIONAL = (*ours_F.__all__, "entropy_from_logits", "logprobs_from_logits")
#: Ours in ``ppo.py`` and the reference's, compared by signature with verl's ``core_algos.py``.
CORE_ALGOS = ("compute_gae_advantage_return", "agg_loss", "compute_policy_loss_vanilla", "compute_value_loss",
              "kl_penalty", "kl_penalty_forward", "compute_entropy_loss", "compute_rewards")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- loading verl


def _verl_root(explicit: str | None) -> Path:
    candidates = [explicit] if explicit else sys.path
    for entry in candidates:
        if entry and (Path(entry) / "verl" / "trainer" / "ppo" / "core_algos.py").is_file():
            return Path(entry)
    raise SystemExit("verl not found: put the folder holding the verl package on PYTHONPATH or pass --verl-root")


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []  # a package, so that submodules can be registered under it
    sys.modules[name] = module
    return module


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_verl(stub_missing: bool, verl_root: str | None):
    """Return (core_algos, torch_functional, apply_kl_penalty, version) from verl."""
    root = _verl_root(verl_root)
    version_file = root / "verl" / "version" / "version"
    version = version_file.read_text().strip() if version_file.is_file() else "unknown"
    if not stub_missing:
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        verl_F = importlib.import_module("verl.utils.torch_functional")
    else:
        def _unavailable(*_args, **_kwargs):
            raise RuntimeError("stubbed out by verl_parity.py")

        def deprecated(replacement: str = ""):
            return lambda obj: obj

        class _Config:  # stand-ins for isinstance checks only
            pass

        _module("verl")
        _module("verl.utils", as_torch_index=_unavailable, group_mean_std=_unavailable)
        _module("verl.utils.import_utils", deprecated=deprecated)
        _module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
        _module("verl.trainer")
        _module("verl.trainer.ppo")
        _module("verl.trainer.config", AlgoConfig=type("AlgoConfig", (_Config,), {}))
        _module("verl.workers")
        _module("verl.workers.config", ActorConfig=type("ActorConfig", (_Config,), {}))
        if importlib.util.find_spec("tensordict") is None:
            _module("tensordict", TensorDict=type("TensorDict", (), {}))
        verl_F = _load_file("verl.utils.torch_functional", root / "verl" / "utils" / "torch_functional.py")
        sys.modules["verl.utils"].torch_functional = verl_F
        core_algos = _load_file("verl.trainer.ppo.core_algos", root / "verl" / "trainer" / "ppo" / "core_algos.py")
    apply_kl_penalty = _function_from_source(
        root / "verl" / "trainer" / "ppo" / "ray_trainer.py",
        "apply_kl_penalty",
        {"core_algos": core_algos, "masked_mean": verl_F.masked_mean, "torch": torch, "DataProto": object},
    )
    return core_algos, verl_F, apply_kl_penalty, version


def _function_from_source(path: Path, name: str, namespace: dict):
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)
    return namespace[name]


# ----------------------------------------------------------------------------- cases


def random_case(seed: int, dtype: torch.dtype, bs: int = 6, length: int = 17):
    """Per-token tensors with a mid-response tool span, right padding and one all-masked row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(bs, length, dtype=torch.int64)
    for row in range(bs):
        end = int(torch.randint(length // 2, length + 1, (1,), generator=g))
        mask[row, end:] = 0
        start = int(torch.randint(1, max(2, end - 3), (1,), generator=g))
        mask[row, start : start + int(torch.randint(0, 4, (1,), generator=g))] = 0
    mask[bs - 1] = 0  # a row the mask removes entirely
    rand = lambda scale=1.0: (torch.randn(bs, length, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa: E731
    old = -rand().abs() - 0.1
    return {
        "mask": mask,
        "rewards": rand() * (torch.rand(bs, length, generator=g) < 0.2),
        "values": rand(),
        "old_log_prob": old,
        "log_prob": old + rand(0.4),
        "ref_log_prob": old + rand(2.0),
        "advantages": rand(1.5),
        "returns": rand(),
        "vpreds": rand(),
        "logits": torch.randn(bs, length, 11, generator=g, dtype=torch.float64).to(dtype) * 3,
        "labels": torch.randint(0, 11, (bs, length), generator=g),
    }


def max_abs_diff(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(max_abs_diff(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return math.inf
        return max(max_abs_diff(a[k], b[k]) for k in a)
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf
    same_nan = torch.isnan(a) == torch.isnan(b)
    if not bool(same_nan.all()):
        return math.inf
    finite = ~torch.isnan(a)
    if not bool(finite.any()):
        return 0.0
    return float((a[finite] - b[finite]).abs().max())


class ActorLikeConfig(dict):
    """What verl's vanilla loss reads from its ActorConfig: attributes, ``.get`` and global_batch_info."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(key) from err


class Batch(dict):
    """The slice of a DataProto that ``apply_kl_penalty`` touches."""

    def __init__(self, tensors: dict, batch_size: int):
        super().__init__(tensors)
        self.batch_size = (batch_size,)


def _kl_diff(core_algos, c, name: str) -> float:
    """Value and gradient (w.r.t. log_prob) of one estimator, ours against verl's."""
    mine = c["log_prob"].clone().requires_grad_(True)
    theirs = c["log_prob"].clone().requires_grad_(True)
    mine_value = ours.kl_penalty(mine, c["ref_log_prob"], name)
    their_value = core_algos.kl_penalty(theirs, c["ref_log_prob"], name)
    mine_value.sum().backward()
    their_value.sum().backward()
    return max_abs_diff((mine_value.detach(), mine.grad), (their_value.detach(), theirs.grad))


def _old_style_policy_diff(core_algos, policy_args, clip: dict, clip_ratio_c: float, mode: str) -> float:
    """verl's ``compute_policy_loss(cliprange...)`` against ours, the vanilla loss with those
    clip ranges as its config: loss, clip fraction, k1 KL, dual-clip fraction."""
    config = {"clip_ratio": clip.get("cliprange"), "clip_ratio_low": clip.get("cliprange_low"),
              "clip_ratio_high": clip.get("cliprange_high"), "clip_ratio_c": clip_ratio_c}
    loss, metrics = ours.compute_policy_loss_vanilla(*policy_args, mode, config)
    mine = (loss, *(metrics[f"actor/{k}"] for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")))
    theirs = core_algos.compute_policy_loss(*policy_args, clip_ratio_c=clip_ratio_c, loss_agg_mode=mode, **clip)
    return max_abs_diff(mine, theirs)


def _apply_kl_diff(core_algos, verl_apply_kl_penalty, c, name: str) -> float:
    """Rewards, metrics and the adapted coefficient after one in-reward KL penalty."""
    mask = c["mask"].to(c["rewards"].dtype)
    mine_ctrl = reference.AdaptiveKLController(0.1, 0.02, 100)
    their_ctrl = core_algos.AdaptiveKLController(0.1, 0.02, 100)
    rewards, metrics = ours.apply_kl_penalty(c["rewards"], c["old_log_prob"], c["ref_log_prob"], mask, mine_ctrl, name)
    tensors = {"response_mask": mask, "token_level_scores": c["rewards"], "old_log_probs": c["old_log_prob"], "ref_log_prob": c["ref_log_prob"]}
    data = types.SimpleNamespace(batch=Batch(tensors, mask.shape[0]))
    data, their_metrics = verl_apply_kl_penalty(data, their_ctrl, kl_penalty=name)
    return max_abs_diff((rewards, metrics, mine_ctrl.value), (data.batch["token_level_rewards"], their_metrics, their_ctrl.value))


def compare(core_algos, verl_F, verl_apply_kl_penalty) -> dict[str, float]:
    """Largest |ours - verl| per function over float32/float64 cases, masks of each kind, every mode."""
    results: dict[str, float] = {}
    errors: dict[str, str] = {}

    def check(label: str, diff_of_case) -> None:
        """Record the case's difference; an exception (e.g. verl lacks a mode) counts as a mismatch."""
        try:
            diff = diff_of_case()
        except Exception as err:  # noqa: BLE001 (reported below, never swallowed)
            errors.setdefault(label, f"{type(err).__name__}: {err}")
            diff = math.inf
        results[label] = max(results.get(label, 0.0), diff)

    def same(label: str, name: str, *args, **kwargs) -> None:
        """Call the function ``name`` of ours (or the reference's) and of verl on the same arguments."""
        mine = getattr(ours_F, name, None) or getattr(ours, name, None) or getattr(reference, name)
        theirs = getattr(verl_F, name) if name in VERL_FUNCTIONAL else getattr(core_algos, name)
        check(label, lambda: max_abs_diff(mine(*args, **kwargs), theirs(*args, **kwargs)))

    for dtype in (torch.float32, torch.float64):
        for seed in range(4):
            c = random_case(seed, dtype)
            values, m, fm = c["values"], c["mask"], c["mask"].to(dtype)
            for mask in (m, fm, m.bool()):
                same("masked_sum", "masked_sum", values, mask, axis=-1)
                same("masked_mean", "masked_mean", values, mask)
                same("masked_mean(axis=-1)", "masked_mean", values, mask, axis=-1)
                same("masked_var", "masked_var", values, mask)
                same("masked_var(unbiased=False)", "masked_var", values, mask, False)
                for shift in (True, False):
                    same("masked_whiten", "masked_whiten", values, mask, shift)
            same("entropy_from_logits", "entropy_from_logits", c["logits"])
            same("logprobs_from_logits", "logprobs_from_logits", c["logits"], c["labels"])
            same("logprobs_from_logits(bf16)", "logprobs_from_logits", c["logits"].to(torch.bfloat16), c["labels"])
            same("clip_by_value", "clip_by_value", c["vpreds"], values - 0.3, values + 0.3)

            for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.5)):
                for mask in (m, fm):
                    same(
                        "compute_gae_advantage_return", "compute_gae_advantage_return",
                        token_level_rewards=c["rewards"], values=values, response_mask=mask, gamma=gamma, lam=lam,
                    )

            dp_info = {"dp_size": 4, "batch_num_tokens": 123, "global_batch_size": 9, "loss_scale_factor": 50}
            for mode in AGG_MODES:
                same(f"agg_loss[{mode}]", "agg_loss", values, m, mode)
                same(f"agg_loss[{mode}](dp)", "agg_loss", values, fm, mode, **dp_info)

            policy_args = (c["old_log_prob"], c["log_prob"], c["advantages"], m)
            clips = ({"cliprange": 0.2}, {"cliprange": 0.2, "cliprange_low": 0.1, "cliprange_high": 0.28},
                     {"cliprange_low": 0.2, "cliprange_high": 0.3})
            for clip in clips:
                for clip_c in (3.0, 1.5):
                    for mode in AGG_MODES:
                        check("compute_policy_loss", lambda: _old_style_policy_diff(core_algos, policy_args, clip, clip_c, mode))
            for info in ({}, {"dp_size": 2, "batch_num_tokens": 77, "global_batch_size": 12}):
                config = ActorLikeConfig(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5, global_batch_info=info)
                for weights in (None, torch.rand(m.shape, dtype=dtype)):
                    same("compute_policy_loss_vanilla", "compute_policy_loss_vanilla", *policy_args, "token-mean", config, weights)

            for mode in AGG_MODES:
                for extra in ({}, {"dp_size": 2, "batch_num_tokens": 70, "global_batch_size": 8, "loss_scale_factor": 20}):
                    same("compute_value_loss", "compute_value_loss", c["vpreds"], c["returns"], values, m, 0.5, mode, **extra)
            same("compute_entropy_loss", "compute_entropy_loss", c["logits"], m)

            for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+", "abs+", "k2+"):
                check(f"kl_penalty[{name}] (value, grad)", lambda: _kl_diff(core_algos, c, name))
            same("compute_rewards", "compute_rewards", c["rewards"], c["old_log_prob"], c["ref_log_prob"], 0.05)
            for name in ("kl", "low_var_kl", "mse"):
                check(f"apply_kl_penalty[{name}]", lambda: _apply_kl_diff(core_algos, verl_apply_kl_penalty, c, name))
    for label, message in errors.items():
        print(f"ERROR {label}: {message}")
    return results


def compare_signatures(core_algos, verl_F) -> list[str]:
    """Parameter names, order, kinds and defaults; our keyword-only additions are allowed."""
    problems = []
    pairs = [(getattr(ours_F, n, None) or getattr(reference, n), getattr(verl_F, n)) for n in VERL_FUNCTIONAL]
    pairs += [(getattr(ours, n, None) or getattr(reference, n), getattr(core_algos, n)) for n in CORE_ALGOS]
    for mine, theirs in pairs:
        mine_params = [p for p in inspect.signature(inspect.unwrap(mine)).parameters.values() if p.kind != p.KEYWORD_ONLY]
        their_params = list(inspect.signature(inspect.unwrap(theirs)).parameters.values())
        mine_view = [(p.name, p.default) for p in mine_params]
        their_view = [(p.name, p.default) for p in their_params]
        if mine_view != their_view:
            problems.append(f"{mine.__name__}: ours {mine_view} != verl {their_view}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stub-missing", action="store_true", help="load core_algos.py/torch_functional.py by path with stand-in imports")
    parser.add_argument("--verl-root", help="folder holding the verl package (default: search sys.path)")
    args = parser.parse_args()
    core_algos, verl_F, apply_kl_penalty, version = load_verl(args.stub_missing, args.verl_root)
    print(f"verl {version} from {Path(core_algos.__file__).resolve()}")
    results = compare(core_algos, verl_F, apply_kl_penalty)
    width = max(map(len, results))
    for name, diff in results.items():
        print(f"  {name:<{width}}  max |ours - verl| = {diff:.3g}{'  (bit identical)' if diff == 0 else ''}")
    problems = [f"{name}: {diff}" for name, diff in results.items() if not diff <= TOLERANCE]
    problems += compare_signatures(core_algos, verl_F)
    for problem in problems:
        print("MISMATCH", problem)
    print("OK" if not problems else f"{len(problems)} mismatch(es)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
