"""The PPO maths (verl 0.9's semantics) and token-budget micro-batching; pure torch/Python.

``ppo``: GAE, policy/value losses, ``agg_loss`` (the twin of verl's ``core_algos.py``);
``functional``: masked reductions, entropy and log-probs from logits (verl's
``torch_functional.py``); ``kl``: KL estimators, controllers, in-reward KL penalty;
``partition``: micro-batches under a per-card token budget, on one card and over ranks.
"""

from .partition import (DataParallelPlan, MicroBatchPlan, plan_data_parallel, plan_micro_batches,
                        plan_padded_micro_batches, token_mean_weights)
from .ppo import *  # noqa: F403 (ppo.__all__ is the public PPO maths)
from .ppo import __all__ as _ppo_all

__all__ = [*_ppo_all, "DataParallelPlan", "MicroBatchPlan", "plan_data_parallel", "plan_micro_batches", "plan_padded_micro_batches",
           "token_mean_weights"]
