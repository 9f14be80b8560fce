"""A token budget below the longest sequence a rollout can make is one rule
(``planning.checks.token_budget_refusals``): ``plan`` (and ``preflight``, through it) refuses it
among its layout refusals, and ``fit`` refuses it before anything is written, in the same words:
exit 2, one line, no traceback. Before, ``fit`` trained with every such sequence alone in a
micro-batch over the budget, which the plan had refused as not sized."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atlas_lightning.config import ConfigError
from atlas_lightning.planning import make_plan
from atlas_lightning.planning.checks import token_budget_refusals

SAID = ("a single sequence can be rollout.max_prompt_length + rollout.max_response_length = 2,048 tokens, longer "
        "than algorithm.ppo_max_token_len_per_gpu=10: such a micro-batch would exceed the budget (set "
        "algorithm.ppo_max_token_len_per_gpu to at least 2048, or shorten the rollout's lengths)")


def test_plan_and_fit_refuse_the_same_sentence(tmp_path, cfg_of, tiny_model_dir, sample_data_dir):
    cfg = cfg_of("algorithm.ppo_max_token_len_per_gpu=10")
    assert token_budget_refusals(cfg) == [SAID]
    assert SAID in make_plan(cfg).refusals
    root = tmp_path / "root"
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"paths.root={root}",
               f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", "algorithm.ppo_max_token_len_per_gpu=10",
               "logger.mode=disabled"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert lines == [f"atlas-lightning fit: config error: {SAID}"], lines
    assert not root.exists()


def test_both_budgets_are_checked_and_named_together(cfg_of):
    from atlas_lightning.run.facts import check_inputs

    with pytest.raises(ConfigError) as refused:
        check_inputs(cfg_of("algorithm.ppo_max_token_len_per_gpu=100", "algorithm.forward_max_token_len_per_gpu=2047"))
    said = str(refused.value)
    assert "longer than algorithm.ppo_max_token_len_per_gpu=100:" in said
    assert "longer than algorithm.forward_max_token_len_per_gpu=2,047:" in said
    assert check_inputs(cfg_of("algorithm.ppo_max_token_len_per_gpu=2048",
                               "algorithm.forward_max_token_len_per_gpu=2048")).questions is not None


def test_verbs_that_run_no_update_of_real_sequences_are_not_refused(cfg_of):
    """``validate`` runs no update; ``memory-check`` measures synthetic micro-batches of exactly the
    budget (``run/memory_check.sequence_lengths``): what it measures is the budget, not a rollout."""
    from atlas_lightning.run.facts import check_inputs

    cfg = cfg_of("algorithm.ppo_max_token_len_per_gpu=10")
    assert check_inputs(cfg, training=False).questions is not None
    assert check_inputs(cfg, data=False, training=False).questions is None
