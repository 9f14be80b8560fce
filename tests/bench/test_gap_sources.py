"""``atlas-lightning bench gap-sources``: the CPU vLLM engine samples from the tiny model (float32,
``experiment=tiny-cpu``) and the benchmark's float32 reference scores those tokens as transformers
does, at the rollout temperature and at 1; the engine's own log-probs agree with it to float32's
rounding, and every pair the report names covers every response token. Bad options and overrides
are refused (exit 2, one line) before the engine starts.

The engine runs once for the module (vLLM's start-up is the cost): ``gap_run``."""

from __future__ import annotations

import json

import pytest
import torch

from atlas_lightning.bench import gap_sources

#: not 1: the scores at the rollout temperature and at 1 (the prefill's) both run
TEMPERATURE = 0.8
PROGRAM = "atlas-lightning bench gap-sources"


@pytest.fixture(scope="module")
def gap_run(tiny_model_dir, tmp_path_factory):
    """The benchmark run once on the CPU: ``(report, scores file)``."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("gap-sources")
    argv = ["--requests", "2", "--prompt-tokens", "16", "--max-tokens", "8", "--score-batch", "1",
            "--out", str(out / "report.json"), "--scores", str(out / "scores.json"), "--",
            "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"rollout.temperature={TEMPERATURE}"]
    assert gap_sources.main(argv) == 0
    return json.loads((out / "report.json").read_text()), json.loads((out / "scores.json").read_text())


def _scores(scores_file: dict, source: str, temperature: float) -> list[float]:
    """One source's log-probs at ``temperature``, all responses' tokens in order."""
    found = [entry for entry in scores_file["scores"]
             if entry["source"] == source and entry["temperature"] == temperature]
    assert len(found) == 1, (source, temperature, [(e["source"], e["temperature"]) for e in scores_file["scores"]])
    return [value for row in found[0]["logprobs"] for value in row]


def _transformers_logprobs(folder, prompts: list[list[int]], responses: list[list[int]],
                           temperature: float) -> list[float]:
    """Each response token's log-prob of softmax(logits / temperature) under transformers' float32
    model, one sequence a forward (no packing, no ``ActorCritic``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    values = []
    for prompt, response in zip(prompts, responses):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        predicting = (logits[len(prompt) - 1:-1] / temperature).log_softmax(-1)  # position t scores token t + 1
        values += predicting.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
    return values


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [TEMPERATURE, 1.0])
def test_the_reference_scores_the_engines_tokens_as_transformers_does(gap_run, tiny_model_dir, temperature):
    _, scores_file = gap_run
    expected = _transformers_logprobs(tiny_model_dir, scores_file["prompts"], scores_file["responses"], temperature)
    reference = _scores(scores_file, "reference", temperature)
    assert len(reference) == len(expected) == sum(map(len, scores_file["responses"]))
    assert torch.allclose(torch.tensor(reference), torch.tensor(expected), atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_the_engine_in_float32_agrees_with_the_reference(gap_run):
    report, scores_file = gap_run
    assert report["model"]["dtype"] == "float32"  # tiny-cpu's: every side runs float32
    assert report["model"]["head_dtype"] == "model"  # the logits as verl computes them, unless set
    gaps = {(row["a"], row["b"], row["temperature"]): row for row in report["pairs"]}
    for pair in (("engine_sampled", "reference", TEMPERATURE), ("engine_prefill", "reference", 1.0)):
        assert gaps[pair]["mean"] < 1e-4 and gaps[pair]["max"] < 1e-3, gaps[pair]
    # and the sampled log-probs are those of the sampled tokens, not of a neighbour
    sampled = torch.tensor(_scores(scores_file, "engine_sampled", TEMPERATURE))
    assert torch.allclose(sampled, torch.tensor(_scores(scores_file, "reference", TEMPERATURE)), atol=1e-3, rtol=0)


@pytest.mark.vllm
def test_every_pair_covers_every_response_token_and_the_facts_are_named(gap_run, tiny_model_dir):
    report, scores_file = gap_run
    tokens = sum(map(len, scores_file["responses"]))
    assert tokens == report["engine"]["response_tokens"] and 2 <= tokens <= 2 * 8
    assert [len(prompt) for prompt in scores_file["prompts"]] == [16, 16]
    expected = {("engine_sampled", "trainer", TEMPERATURE), ("engine_sampled", "reference", TEMPERATURE),
                ("trainer", "reference", TEMPERATURE), ("engine_prefill", "trainer", 1.0),
                ("engine_prefill", "reference", 1.0), ("trainer", "reference", 1.0)}
    assert {(row["a"], row["b"], row["temperature"]) for row in report["pairs"]} == expected
    assert all(row["tokens"] == tokens for row in report["pairs"])
    assert report["model"]["path"] == str(tiny_model_dir)
    assert report["model"]["layers"] == 4 and report["model"]["layer_types"] == {"full_attention": 4}
    variants = report["variants"]
    assert variants["trainer_torch"] == {"skipped": "dense model: no linear-attention layers"}
    assert variants["reference"]["dtype"] == "float32" and variants["reference"]["tf32"] is False
    assert variants["trainer"]["linear_attention_kernel"] is None  # dense: nothing to resolve
    assert set(report["seconds"]) == {"compose", "engine_phase", "trainer_phase", "total"}


@pytest.mark.parametrize("option", ["--requests", "--prompt-tokens", "--max-tokens", "--score-batch"])
def test_a_bad_option_exits_2_naming_it_before_anything_runs(option, monkeypatch, capsys):
    monkeypatch.setattr(gap_sources, "run_engine_phase", lambda *a: pytest.fail("the engine phase started"))
    monkeypatch.setattr("atlas_lightning.config.compose", lambda *a: pytest.fail("the config was composed"))
    assert gap_sources.main([option, "0", "--", "experiment=tiny-cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"{PROGRAM}: {option} must be at least 1, got 0"]


@pytest.mark.parametrize("options, overrides, named", [
    ([], ["trainer.max_step=3"], "config error: "),
    ([], ["rollout.temperature=0"], "rollout.temperature=0"),
    (["--prompt-tokens", "2000", "--max-tokens", "100"], [],
     "--prompt-tokens 2000 + --max-tokens 100 exceed rollout.max_model_len=2048"),
], ids=["unknown key", "greedy", "too long"])
def test_a_config_it_cannot_run_exits_2_before_the_engine_starts(options, overrides, named, monkeypatch, capsys):
    monkeypatch.setattr(gap_sources, "run_engine_phase", lambda *a: pytest.fail("the engine phase started"))
    assert gap_sources.main([*options, "--", "experiment=tiny-cpu", *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{PROGRAM}: ") and named in err, err
    if overrides == ["trainer.max_step=3"]:
        assert "trainer.max_step" in err
