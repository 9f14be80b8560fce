"""The PPO step under Lightning: ``PPOModule`` (``module``) and the typed output each step
hands to the callbacks (``step_output``)."""
