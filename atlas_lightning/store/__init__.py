"""The on-disk contract (README, "On-disk layout" and "Trajectory records"): atomic writes
(``atomic``, ``files``), trajectory records, step tensors and manifests (``records``), whole step
folders gathered from every rank (``step_folder``) and checkpoint folders (``checkpoints``)."""
