"""The benchmark on CPU at toy size: it runs end to end, and its two paths compute the same thing."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from atlas_lightning.bench.update_bench import main
from atlas_lightning.bench.flops import model_flops
from atlas_lightning.bench.shapes import build_model, shape_by_name, transformers_config
from atlas_lightning.bench.update import BaselineRunner, OursRunner, _pack, fit_model_config
from atlas_lightning.bench.workload import ppo_inputs, sample_micro_batch

CPU = torch.device("cpu")


def test_tiny_run_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "r" / "bench.json"
    assert main(["--tiny", "--models", "tiny", "--sweep", "ours,ours_selective,ours_mlp", "--reps", "1", "--tokens",
                 "1024", "--forward-tokens", "2048", "--batch-sequences", "6", "--batch-budgets", "1024,600",
                 "--sections", "peak,logprob,update,forward,sync,batch,profile,autotune", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    model = results["models"]["tiny"]
    for path in ("ours", "baseline"):
        update = model[path]["update"]
        assert "error" not in update, update
        assert update["real_tokens"] == model["update_inputs"]["real_tokens"] > 0
        assert update["tokens_per_s"] > 0 and 0 < update["useful_mfu"]
        assert set(model[path]["forward"]) >= {"actor", "critic"}
    assert model["ours"]["options"]["attention"] == "sdpa_varlen"
    assert model["sweep"]["ours_selective"]["layer_recompute"] == ["layer", "none"]
    assert model["sweep"]["ours_mlp"]["layer_recompute"] == ["mlp", "mlp"]
    batch = model["batch"]
    assert batch["sequences"] == 6 and batch["real_tokens"] > 0
    for path in ("ours", "baseline"):
        assert batch[path]["update"]["tokens_per_s"] > 0, batch[path]
    assert batch["ours"]["attempts"][0]["attempt"] == "every layer checkpointed"  # no card to size on CPU, as fit
    assert batch["ours"]["attention_backends"] == ["FLASH_ATTENTION"]  # PyTorch's CPU flash kernel, as it ran
    sync = model["ours"]["weight_sync"]
    assert sync["merged_packs"]["bytes"] == sync["merged_cat"]["bytes"] > 0
    # the batch's model is checked too, after its updates (adapters no longer zero): every merge
    # within one rounding of the float64 reference, the grouped launch giving the per-linear bits
    check = batch["ours"]["weight_sync"]["kernel_check"]
    assert check["linears"] > 0 and check["grouped_equals_per_linear"]
    assert 0 < check["merge_error_in_bounds"] <= 1 and check["grouped_error_in_bounds"] <= 1
    assert {r["kind"] for r in results["logprob_memory"]} == {"chunked", "full"}
    text = out.with_suffix(".md").read_text()
    assert "| tiny | ours |" in text and "| tiny | baseline |" in text
    assert text in capsys.readouterr().out


def test_beside_vllm_runs_after_vllm_s_platform_import_and_records_it(tmp_path):
    """``--beside-vllm`` (``same_batch.sh`` passes it): the update runs in a process that imported
    vLLM's platform as ``fit`` does, and the record names vLLM and the attention flags it left."""
    vllm = pytest.importorskip("vllm")
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--models", "tiny", "--sweep-layers", "0", "--sections", "batch", "--paths", "ours",
                 "--batch-sequences", "4", "--beside-vllm", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert re.fullmatch(rf"{re.escape(vllm.__version__)} \(\w+Platform\)", results["environment"]["vllm"])
    assert results["environment"]["sdpa_enabled"]["cudnn"] == torch.backends.cuda.cudnn_sdp_enabled()
    assert results["models"]["tiny"]["batch"]["ours"]["update"]["tokens_per_s"] > 0


def test_beside_vllm_without_vllm_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--tiny", "--models", "tiny", "--sections", "batch", "--beside-vllm", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "--beside-vllm: vLLM cannot be imported here" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("name", ["tiny", "tiny_hybrid"])
def test_baseline_and_ours_score_the_same_tokens(name):
    """With the adapters at zero both paths are the bare base: the baseline's padded full-logit
    log-probs and values must equal ours (fp32), which checks its index arithmetic."""
    shape = shape_by_name(name)
    inputs = ppo_inputs(sample_micro_batch(3, 600, scale=1 / 32), shape.vocab_size, CPU, seed=1)
    ours = OursRunner(fit_model_config(4, 1024, dtype="float32"), transformers_config(shape), 10_000, device=CPU)
    base = BaselineRunner(build_model(shape, device=CPU, dtype=torch.float32, attn_implementation="sdpa"), 4, 10_000)
    base.value_head.load_state_dict(ours.model.value_head.state_dict())
    with torch.no_grad():
        for name, p in list(ours.model.named_parameters()) + list(base.peft_model.named_parameters()):
            if "lora_" in name:
                p.zero_()
    packed = _pack(inputs, list(range(len(inputs.sequences))), CPU)
    with torch.no_grad(), base.kernels():
        torch.testing.assert_close(base.per_token("actor", packed), ours.model.actor_forward(packed)[0],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(base.per_token("critic", packed), ours.model.critic_forward(packed),
                                   rtol=1e-4, atol=1e-4)


def test_useful_flops_match_torch_flop_counter():
    """Matmul FLOPs of an actor forward (peft's LoRA path: plain mm calls) against torch's
    FlopCounterMode. Its CPU attention kernel is not counted by the counter, so attention is
    checked separately against the causal-half formula."""
    from torch.utils.flop_counter import FlopCounterMode

    shape = shape_by_name("tiny")
    base = build_model(shape, device=CPU, dtype=torch.float32, attn_implementation="sdpa_varlen")
    flops = model_flops(base, 4)
    runner = OursRunner(fit_model_config(4, 10_000, dtype="float32", fused_lora=False), transformers_config(shape),
                        10_000, device=CPU)
    runner.model.eval()
    inputs = ppo_inputs(sample_micro_batch(5, 400, scale=1 / 32), shape.vocab_size, CPU)
    packed = _pack(inputs, list(range(len(inputs.sequences))), CPU)
    seq_lens = [int(s.numel()) for s in inputs.sequences]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        runner.model.actor_forward(packed, compute_entropy=False)
    matmuls = flops.forward("actor", seq_lens, packed.num_response_tokens) - flops.attention(seq_lens)
    assert counter.get_total_flops() == matmuls
    config = shape.config
    heads_dim = config["num_attention_heads"] * config["head_dim"]
    assert flops.attention(seq_lens) == sum(4 * s * s * heads_dim / 2 for s in seq_lens) * config["num_hidden_layers"]
