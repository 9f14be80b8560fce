"""Loggers at the RL step: W&B (``wandb_logger``: ``build_loggers``) and the run export
(``run_export``: ``runs/<name>/<id>/{history.csv, config.json, summary.json}``)."""
