"""verl's config keys and the keys here that hold the same setting (README, "From verl: the
report's runs in verl's keys", whose table this mirrors): an override in verl's spelling is
answered with ours instead of a bare "Key not in struct". Keys spelt the same in both
(``algorithm.gamma``, ``trainer.val_before_train``) are not listed; a verl setting with no
equivalent maps to the reason."""

from __future__ import annotations

AR = "actor_rollout_ref"

#: verl key -> the key (or keys) here, or why there is none.
VERL_KEYS: dict[str, str] = {
    "data.train_batch_size": "algorithm.train_batch_size",
    f"{AR}.rollout.n": "rollout.n",
    f"{AR}.actor.ppo_mini_batch_size": "algorithm.ppo_mini_batch_size",
    "critic.ppo_mini_batch_size": "algorithm.ppo_mini_batch_size",
    f"{AR}.actor.ppo_epochs": "algorithm.ppo_epochs",
    "critic.ppo_epochs": "algorithm.ppo_epochs",
    f"{AR}.actor.use_dynamic_bsz": "none: micro-batches are always packed to algorithm.ppo_max_token_len_per_gpu",
    f"{AR}.actor.ppo_max_token_len_per_gpu": "algorithm.ppo_max_token_len_per_gpu",
    "critic.ppo_max_token_len_per_gpu": "algorithm.ppo_max_token_len_per_gpu",
    f"{AR}.rollout.log_prob_max_token_len_per_gpu": "algorithm.forward_max_token_len_per_gpu",
    f"{AR}.ref.log_prob_max_token_len_per_gpu": "algorithm.forward_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu": "algorithm.forward_max_token_len_per_gpu",
    f"{AR}.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    f"{AR}.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    f"{AR}.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    f"{AR}.actor.loss_agg_mode": "algorithm.loss_agg_mode",
    f"{AR}.actor.entropy_coeff": "algorithm.entropy_coeff",
    f"{AR}.actor.use_kl_loss": "algorithm.use_kl_loss",
    f"{AR}.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    f"{AR}.actor.kl_loss_type": "algorithm.kl_loss_type",
    "algorithm.adv_estimator": "none: GAE only",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "critic.cliprange_value": "algorithm.cliprange_value",
    f"{AR}.actor.optim.lr": "algorithm.actor_lr",
    "critic.optim.lr": "algorithm.critic_lr",
    f"{AR}.actor.optim.weight_decay": "algorithm.weight_decay",
    "critic.optim.weight_decay": "algorithm.weight_decay",
    f"{AR}.actor.optim.betas": "algorithm.betas",
    "critic.optim.betas": "algorithm.betas",
    f"{AR}.actor.grad_clip": "algorithm.grad_clip",
    "critic.grad_clip": "algorithm.grad_clip",
    "trainer.critic_warmup": "algorithm.critic_warmup",
    f"{AR}.actor.shuffle": "none: mini-batch j is the j-th contiguous chunk, as verl's default",
    f"{AR}.rollout.tensor_model_parallel_size": "layout.engine_tp",
    f"{AR}.rollout.max_num_seqs": "rollout.max_in_flight",
    f"{AR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{AR}.rollout.free_cache_engine": "rollout.enable_sleep_mode",
    f"{AR}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{AR}.rollout.max_model_len": "rollout.max_model_len",
    "data.max_prompt_length": "rollout.max_prompt_length",
    "data.max_response_length": "rollout.max_response_length",
    f"{AR}.rollout.multi_turn.max_assistant_turns": "rollout.max_turns",
    f"{AR}.rollout.temperature": "rollout.temperature",
    f"{AR}.rollout.top_p": "rollout.top_p",
    f"{AR}.rollout.top_k": "rollout.top_k",
    f"{AR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{AR}.rollout.val_kwargs.n": "rollout.val_n",
    f"{AR}.model.path": "model.path",
    f"{AR}.model.lora_rank": "model.lora.rank",
    f"{AR}.model.lora_alpha": "model.lora.alpha",
    f"{AR}.model.target_modules": "model.lora.target_modules",
    "critic.model.lora_rank": "model.critic_lora.rank",
    "critic.model.lora_alpha": "model.critic_lora.alpha",
    "critic.model.target_modules": "model.critic_lora.target_modules",
    f"{AR}.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    f"{AR}.model.lora_adapter_path": "trainer.init_from (a step's two adapters), or model.actor_adapter",
    "data.train_files": "data.root, data.benchmarks and data.train_split",
    "data.val_files": "data.root, data.benchmarks and data.val_split",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.val_every",
    "trainer.save_freq": "trainer.save_every",
    "trainer.n_gpus_per_node": "layout.gpus and trainer.devices",
    "trainer.nnodes": "trainer.num_nodes",
    "trainer.resume_mode": "trainer.resume (null, auto, or a global_step_N folder)",
    "trainer.resume_from_path": "trainer.resume",
    "trainer.project_name": "logger.project",
    "trainer.experiment_name": "name",
    "trainer.default_local_dir": "paths.root",
    "trainer.logger": "logger.mode (W&B: auto, online, offline or disabled; the console's line a step is always printed)",
}

#: verl's top-level groups that have no group of the same name here: any key under them is verl's.
VERL_GROUPS = (AR, "critic", "reward_model", "custom_reward_function", "ray_init", "ray_kwargs")


def ours_for(verl_key: str) -> str | None:
    """The key here for ``verl_key`` (or why there is none); None when it is not a verl key: a
    key of ``VERL_KEYS``, or any key under one of ``VERL_GROUPS`` (those the table does not map
    have no counterpart here)."""
    key = verl_key.lstrip("+~")
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    if key.split(".", 1)[0] in VERL_GROUPS:
        return "none: this verl setting has no counterpart here"
    return None
