"""Names of the callbacks in a step report (``callbacks_s``) that its writer (``bench/step.py``)
and its reader (``bench/projection.py``) both set apart. Plain strings, so that the projection
reads a report without importing Lightning or the callbacks."""

#: the weight sync, in reports written while it was a callback (now the step's own ``update_weights``)
SYNC_CALLBACK = "WeightSyncCallback"
#: the callback whose seconds are validation (run every ``trainer.val_every`` steps)
VALIDATION_CALLBACK = "ValidationCallback"
#: the callbacks whose seconds are the checkpoint (written every ``trainer.save_every`` steps)
CHECKPOINT_CALLBACKS = ("StepCheckpoint", "HubCheckpointCallback")
