"""What builds the embedded default (``experiment=tiny-cpu``) locally, never from a hub: the
generated sample question data (``sample``, ``sample_texts``), the tiny Qwen3 model and its
tokenizer (``tiny_model``, ``tiny_tokenizer``, ``tiny_corpus``, ``tiny_causal_lm``), the
demonstrations the runtime renders (``demos``) and the SFT warm start on them
(``tiny_orchestrator``). ``atlas-lightning data ...`` and ``make demo`` call it."""
