"""Rollout engines behind ``rollout.engine.Engine``: in-process vLLM (``vllm_engine``), vLLM's
OpenAI-compatible server (``server_process`` runs it, ``server_engine`` is its client,
``server_http`` the HTTP exchange), merged weights to a server (``weight_transfer``,
``gloo_transfer``) and the transformers reference (``hf_engine``, tests)."""
