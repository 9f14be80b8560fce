"""Which step of the in-process engine's life a GPU fault comes from: the engine ``fit`` builds
(``rollout.factory.build_engine`` on the composed config, under a world-1 process group as
Lightning makes it), driven through one ``--order`` of its calls, each printed before and after
it runs, so that a process that dies (a CUDA fault aborts it) names the last call it reached.

    python -m atlas_lightning.bench.engine_graphs --order sleep-first -- experiment=h200-8b \
        model.path=/tmp/qwen3_6_27b rollout.enforce_eager=false

Orders: ``probe`` (a prompt-logprobs prefill of ``--probe-tokens`` tokens, then a generation),
``sleep-first`` (sleep and wake at once, as ``fit`` does before the trainer's build, then the
same), ``probe-sleep`` (the probe, a sleep and wake, the probe again, a generation),
``build-between`` (sleep, the trainer's model built on the card as ``fit`` builds it while the
engine sleeps, wake, probe, generation) and ``train-between`` (the same with one forward and
backward of the trainer on the probe while the engine sleeps: its kernels, fla's under fit, run
and tune first). Why: on an
H100 the 27B-shaped hybrid with CUDA graphs died at its first request after the wake (the
starting sync's probe; the bench README's seventh attempt on the hybrid), where the dense 8B
runs; each order separates one suspect. An engine alone through sleep, wake and the probe did not
fault (a standalone reproduction on an H100, seventeenth and eighteenth sessions): what ``fit``
does between the sleep and the wake (the trainer's build, its first passes) is the suspect the
last two orders isolate. They passed (run 7); ``fit`` itself then faulted under LoRA sync only,
and not with ``torch.cuda.empty_cache`` disabled (``bench/fit_trace.py``; bench README, "Ninth
attempt"). ``bench/card/engine_graphs.sh`` runs the orders in separate processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PROGRAM = "python -m atlas_lightning.bench.engine_graphs"
ORDERS = {"probe": ("probe", "generate"), "sleep-first": ("sleep", "wake", "probe", "generate"),
          "probe-sleep": ("probe", "sleep", "wake", "probe", "generate"),
          "build-between": ("sleep", "build", "wake", "probe", "generate"),
          "train-between": ("sleep", "build", "train", "wake", "probe", "generate")}


def _say(message: str) -> None:
    print(f"[engine_graphs {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _generate(engine, prompt: list[int], count: int, max_tokens: int) -> int:
    """``count`` sampled requests of ``prompt``, to the end; the tokens generated."""
    from atlas_lightning.rollout.engine import GenerationRequest, SamplingSpec

    done = engine.generate([GenerationRequest(f"graphs-{index}", tuple(prompt), SamplingSpec(max_tokens=max_tokens, seed=index))
                            for index in range(count)])
    failed = [result.error for result in done if result.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return sum(len(result.token_ids) for result in done)


def run(order: str, overrides: list[str], probe_tokens: int, requests: int, max_tokens: int) -> None:
    """Build the engine as ``fit`` does and make the calls of ``order`` (module doc)."""
    import torch
    import torch.distributed as dist

    from atlas_lightning.config import compose
    from atlas_lightning.rollout.factory import build_engine

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    cfg = compose(overrides)
    _say(f"building the engine: {cfg.model.path}, enforce_eager={cfg.rollout.enforce_eager}")
    engine = build_engine(cfg)
    prompt = [(17 * i) % 1000 + 10 for i in range(probe_tokens)]
    model = None
    for call in ORDERS[order]:
        _say(f"{call}: start")
        started = time.monotonic()
        detail = ""
        if call == "build":
            model = _build_trainer(cfg)
        elif call == "train":
            detail = f"loss {_train_once(model, prompt):.4g}"
        elif call == "probe":
            logprobs = engine.prompt_logprobs(prompt)
            detail = f"{len(logprobs)} log-probs, finite {all(map(lambda x: x == x and abs(x) < 1e9, logprobs))}"
        elif call == "generate":
            detail = f"{_generate(engine, prompt[:64], requests, max_tokens)} tokens"
        else:
            getattr(engine, "wake_up" if call == "wake" else call)()
        _say(f"{call}: done in {time.monotonic() - started:.2f} s {detail}")
    engine.close()
    _say(f"order {order}: every call returned")


def _build_trainer(cfg):
    """The trainer's ``ActorCritic`` on the card (the CPU without one), as ``PPOModule.configure_model`` builds it
    (``checkpoint_layers=auto`` left to the build's default: the plan does not change which
    kernels run)."""

    from atlas_lightning.models.build import build_actor_critic

    return build_actor_critic(cfg.model, seed=int(cfg.seed), device=_device())


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _train_once(model, prompt: list[int]) -> float:
    """One forward and backward of the actor on ``prompt`` (the kernels an update runs)."""
    import torch

    from atlas_lightning.models.packing import pack_sequences

    packed = pack_sequences([torch.tensor(prompt, dtype=torch.int64)], [1]).to(_device())
    model.train()
    log_probs, _ = model.actor_forward(packed, temperature=1.0, compute_entropy=False)
    loss = -log_probs.float().mean()
    loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", choices=sorted(ORDERS), required=True)
    parser.add_argument("--probe-tokens", type=int, default=585, help="the probe's length (the crash's: 585)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("overrides", nargs="*", help="fit overrides, after --")
    args = parser.parse_args(argv)
    run(args.order, args.overrides, args.probe_tokens, args.requests, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
