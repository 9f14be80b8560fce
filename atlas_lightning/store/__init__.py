"""The on-disk contract (README, "On-disk layout" and "Trajectory records"): atomic writes
(``atomic``, ``files``), trajectory records, step tensors and manifests (``records``), whole step
folders gathered from every rank (``step_folder``), checkpoint folders (``checkpoints``) and the
LoRA shape each adapter trains, read from the PEFT folders it starts from (``lora_shapes``)."""
