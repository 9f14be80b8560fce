"""The one error kind every floor raises for input the user named: ``InputError``.

A config value, a question file, an adapter or a checkpoint folder that cannot be used is an
``InputError`` (``config.ConfigError``, ``questions.rows.DataError``, ``models.adapters.AdapterError``,
``store.checkpoints.CheckpointError``) whose message names what is wrong and where; the CLI
exits 2 with it. This module imports nothing, so every floor may import it.
"""


class InputError(ValueError):
    """Something the user named that cannot be used (a config value, a question file, an adapter
    or checkpoint folder); the message names it and what is wrong. The CLI exits 2 with it."""
