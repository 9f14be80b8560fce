"""The vLLM server engine (``rollout.engine=vllm-server``) on the tiny model, against the
in-process vLLM engine and the transformers reference: greedy tokens and log-probs agree,
seeded sampling gives the in-process engine's tokens, adapters replace each other and are never
served stale, and failures (bad adapter, dead or absent server) raise ``EngineError``; a weight
sync that arrives mid-rollout interrupts a streamed rollout of the datamodule (partial rollouts).

The tests on the real server are long runs (marked ``e2e``: ``make test-e2e``); the failures
without a server stay in ``make test``. One server serves the whole module (a server start costs
about 25 CPU-s: three processes, each importing vLLM); the last test kills it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from atlas_lightning.rollout.engine import AdapterVersion, EngineError, GenerationRequest, SamplingSpec
from atlas_lightning.rollout.engines.hf_engine import HFEngine
from atlas_lightning.rollout.digest import lora_digest

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 12, 8, 150, 64, 3], list(range(20, 60))]
TOL = 2e-4


def _greedy(engine, prompts, max_tokens=12, tag="g"):
    requests = [GenerationRequest(f"{tag}{i}", tuple(p), SamplingSpec(max_tokens=max_tokens, temperature=0.0))
                for i, p in enumerate(prompts)]
    return engine.generate(requests)


def _random_adapter(model_dir, folder, seed, rank=8):
    """A PEFT folder with random B factors (as test_engines.py), and its digest as written."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(folder)
    modules = {name: (m.lora_A["default"].weight, m.lora_B["default"].weight, m.scaling["default"])
               for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    return lora_digest(modules)


def _assert_same(results, reference, tol=TOL):
    for got, want in zip(results, reference):
        assert got.error is None, got.error
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < tol


@pytest.fixture(scope="module")
def server_engine(tiny_engine_args, tmp_path_factory, request):
    pytest.importorskip("vllm")
    from atlas_lightning.rollout.engines.server_engine import ServerEngine
    from atlas_lightning.rollout.engines.server_process import VLLMServer

    log_path = tmp_path_factory.mktemp("server") / "vllm-server.log"
    server = VLLMServer(tiny_engine_args(), log_path=log_path, start_timeout_s=300, wait=False)
    try:
        request.getfixturevalue("vllm_engine")  # the in-process engine starts while the server does
    except BaseException:
        server.close()
        raise
    server.wait_until_healthy()
    engine = ServerEngine(server.url, server=server, max_in_flight=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


@pytest.mark.e2e
def test_greedy_base_matches_in_process_and_reference(server_engine, vllm_engine, hf_engine):
    for engine in (server_engine, vllm_engine, hf_engine):
        engine.set_adapter(None)
    served = _greedy(server_engine, PROMPTS)
    _assert_same(served, _greedy(hf_engine, PROMPTS))
    _assert_same(served, _greedy(vllm_engine, PROMPTS))
    probe = PROMPTS[2]
    server_lp = server_engine.prompt_logprobs(probe)
    assert len(server_lp) == len(probe) - 1
    assert max(abs(a - b) for a, b in zip(server_lp, hf_engine.prompt_logprobs(probe))) < TOL


def _scaled_logprobs(model, prompt, tokens, temperature):
    """Teacher-forced log-probs of ``tokens`` under ``log_softmax(logits / temperature)``."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.e2e
def test_seeded_sampling_matches_in_process(server_engine, vllm_engine, hf_engine):
    """Same seed, same tokens and log-probs as the in-process engine, plain, tempered, and with
    top-p/top-k; tempered log-probs are of the scaled distribution; a stop token ends 'stop'."""
    hf_engine.set_adapter(None)
    specs = [SamplingSpec(max_tokens=16, temperature=1.0, seed=1234),
             SamplingSpec(max_tokens=16, temperature=0.7, seed=7),
             SamplingSpec(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=11)]
    requests = [GenerationRequest(f"s{i}-{j}", tuple(p), spec)
                for j, spec in enumerate(specs) for i, p in enumerate(PROMPTS)]
    for request in requests:
        server_engine.submit(request)
    assert server_engine.num_pending() == len(requests)
    results = {}
    while server_engine.num_pending():
        results.update((r.request_id, r) for r in server_engine.poll())
    served = [results[r.request_id] for r in requests]
    _assert_same(served, vllm_engine.generate(requests))
    for request, result in zip(requests[3:6], served[3:6]):  # temperature 0.7
        expected = _scaled_logprobs(hf_engine.model, request.prompt_ids, result.token_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < TOL

    stop = served[0].token_ids[3]
    stopped = server_engine.generate([GenerationRequest(
        "stop", tuple(PROMPTS[0]), SamplingSpec(max_tokens=16, temperature=1.0, seed=1234, stop_token_ids=(stop,)))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == served[0].token_ids[:served[0].token_ids.index(stop) + 1]


@pytest.mark.e2e
def test_abort_then_resubmit_returns_only_the_new_call(server_engine):
    request = GenerationRequest("a0", tuple(PROMPTS[1]), SamplingSpec(max_tokens=400, temperature=1.0, seed=3))
    server_engine.submit(request)
    server_engine.abort(["a0"])
    assert server_engine.num_pending() == 0
    again = GenerationRequest("a0", tuple(PROMPTS[1]), SamplingSpec(max_tokens=4, temperature=1.0, seed=3))
    result = server_engine.generate([again])[0]
    assert result.error is None and len(result.token_ids) == 4


@pytest.mark.e2e
def test_streamed_completions_equal_whole_ones_and_an_interrupted_one_keeps_its_tokens(server_engine):
    """Streamed (partial rollouts): the same tokens and log-probs as a whole reply, seeded; an
    interrupted request hands back a prefix of its generation with its log-probs, never comes
    back from ``poll``, and its continuation by re-prefill (prompt plus the kept tokens, the
    rest of the budget) under the same weights completes the uninterrupted greedy generation.
    The client draws nothing from this process's global generators, whose draws the trainer's
    LoRA dropout masks are while the separate layout's producer thread samples."""
    from atlas_lightning.rollout.engines.server_engine import ServerEngine

    streamed = ServerEngine(server_engine.url, max_in_flight=8, streaming=True)
    drawn = _global_generator_states()
    try:
        specs = [SamplingSpec(max_tokens=24, temperature=1.0, seed=5), SamplingSpec(max_tokens=24, temperature=0.0)]
        requests = [GenerationRequest(f"st{i}-{j}", tuple(p), spec)
                    for j, spec in enumerate(specs) for i, p in enumerate(PROMPTS)]
        _assert_same(streamed.generate(requests), server_engine.generate(requests), tol=1e-6)
        assert all(r.first_token_s is not None and r.first_token_s >= 0 for r in streamed.generate(requests[:1]))

        budget = 1200  # long enough that a loaded machine still reads 3 streamed tokens before the end
        full = server_engine.generate([GenerationRequest("full", tuple(PROMPTS[2]),
                                                         SamplingSpec(max_tokens=budget, temperature=0.0))])[0]
        cut = _interrupted_once_streaming(streamed, full, budget)
        kept = len(cut.token_ids)
        assert 3 <= kept < len(full.token_ids) and len(cut.logprobs) == kept
        assert cut.token_ids == full.token_ids[:kept]
        assert max(abs(a - b) for a, b in zip(cut.logprobs, full.logprobs)) < 1e-6
        assert streamed.num_pending() == 0 and streamed.poll() == []
        rest = streamed.generate([GenerationRequest("cut/s1", tuple(PROMPTS[2]) + tuple(cut.token_ids),
                                                    SamplingSpec(max_tokens=budget - kept, temperature=0.0))])[0]
        assert rest.error is None and rest.finish_reason == full.finish_reason
        assert cut.token_ids + rest.token_ids == full.token_ids
        assert max(abs(a - b) for a, b in zip(cut.logprobs + rest.logprobs, full.logprobs)) < TOL
        assert _global_generator_states() == drawn
    finally:
        streamed.close()


def _interrupted_once_streaming(streamed, full, budget: int, attempts: int = 5):
    """Greedy ``PROMPTS[2]`` submitted, then interrupted once 3 tokens have streamed: the cut
    result. A loaded machine can read the stream after the server finished the generation; the
    interrupt then hands back the whole generation (checked), and the request is sent again."""
    for attempt in range(attempts):
        rid = f"cut-{attempt}"
        streamed.submit(GenerationRequest(rid, tuple(PROMPTS[2]), SamplingSpec(max_tokens=budget, temperature=0.0)))
        deadline = time.monotonic() + 60
        while len(getattr(streamed._calls[rid].streamed, "token_ids", ())) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        cut = streamed.interrupt([rid])[0]
        assert cut.error is None, cut.error
        if cut.finish_reason == "interrupted":
            return cut
        assert cut.finish_reason == full.finish_reason and cut.token_ids == full.token_ids
    raise AssertionError(f"no interrupt in {attempts} tries arrived before the {len(full.token_ids)} tokens were generated")


def _global_generator_states() -> tuple:
    """This process's global torch, numpy and Python generator states, comparable with ``==``."""
    import random

    import numpy as np

    return torch.get_rng_state().tolist(), np.random.get_state()[1].tolist(), random.getstate()


@pytest.mark.e2e
def test_lora_matches_reference_and_is_never_stale(server_engine, hf_engine, tiny_model_dir, tmp_path):
    expected_1 = _random_adapter(tiny_model_dir, tmp_path / "v1", seed=1)
    expected_2 = _random_adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    server_engine.set_adapter(None)
    base = _greedy(server_engine, PROMPTS, tag="b")

    report = server_engine.set_adapter(AdapterVersion(str(tmp_path / "v1"), version=1))
    assert report.tensor_count == len(expected_1)
    assert report.digest.entries == expected_1.entries
    hf_engine.set_adapter(AdapterVersion(str(tmp_path / "v1"), version=1))
    v1 = _greedy(server_engine, PROMPTS, tag="v1")
    _assert_same(v1, _greedy(hf_engine, PROMPTS, tag="h1"))
    assert [r.token_ids for r in v1] != [r.token_ids for r in base]

    # the same version number again, from another folder: still a new name, never the old adapter
    report = server_engine.set_adapter(AdapterVersion(str(tmp_path / "v2"), version=1))
    assert report.digest.entries == expected_2.entries
    hf_engine.set_adapter(AdapterVersion(str(tmp_path / "v2"), version=2))
    v2 = _greedy(server_engine, PROMPTS, tag="v2")
    _assert_same(v2, _greedy(hf_engine, PROMPTS, tag="h2"))
    assert [r.logprobs for r in v2] != [r.logprobs for r in v1]
    probe = PROMPTS[2]  # the weight-sync probe sees the served adapter
    gap = max(abs(a - b) for a, b in zip(server_engine.prompt_logprobs(probe), hf_engine.prompt_logprobs(probe)))
    assert gap < TOL

    server_engine.set_adapter(None)
    hf_engine.set_adapter(None)
    _assert_same(_greedy(server_engine, PROMPTS, tag="b2"), base, tol=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_server_names_each_reply_after_its_request_and_prompt(server_engine, tiny_model_dir, stream):
    """What the engine's reply checks rely on (``server_completion.ReplyCheck``): vLLM names its
    reply ``cmpl-<X-Request-Id>`` and returns the prompt's ids, whole or streamed; the engine
    reads the model's vocabulary size from the base it serves."""
    import json

    from atlas_lightning.rollout.engines.server_http import http_call, http_stream

    payload = {**server_engine._payload(GenerationRequest("r", tuple(PROMPTS[0]), SamplingSpec(max_tokens=4, seed=3))),
               "stream": stream}
    if stream:
        events = list(http_stream(server_engine.url, "/v1/completions", json.dumps(payload).encode(),
                                  request_id="atlas-echo-s"))
        assert {event["id"] for event in events} == {"cmpl-atlas-echo-s"}
        assert events[0]["choices"][0]["prompt_token_ids"] == PROMPTS[0]
    else:
        status, body = http_call(server_engine.url, "POST", "/v1/completions", payload, request_id="atlas-echo-w")
        assert status == 200 and body["id"] == "cmpl-atlas-echo-w"
        assert body["choices"][0]["prompt_token_ids"] == PROMPTS[0]
    assert server_engine.vocab_size == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


@pytest.mark.e2e
def test_bad_adapter_folder_is_a_clear_error_and_serves_the_base(server_engine, tiny_model_dir, tmp_path):
    _random_adapter(tiny_model_dir, tmp_path / "good", seed=1)
    server_engine.set_adapter(None)
    base = _greedy(server_engine, PROMPTS[:1], tag="bb")
    server_engine.set_adapter(AdapterVersion(str(tmp_path / "good"), version=1))

    with pytest.raises(EngineError, match="missing"):
        server_engine.set_adapter(AdapterVersion(str(tmp_path / "missing"), version=2))
    _assert_same(_greedy(server_engine, PROMPTS[:1], tag="bm"), base, tol=1e-6)  # not the stale adapter

    _random_adapter(tiny_model_dir, tmp_path / "rank16", seed=3, rank=16)  # over the server's max rank 8
    with pytest.raises(EngineError, match="refused the adapter .*rank16") as refused:
        server_engine.set_adapter(AdapterVersion(str(tmp_path / "rank16"), version=3))
    assert "LoRA rank 16 is greater than max_lora_rank 8" in str(refused.value)  # the server's reason
    _assert_same(_greedy(server_engine, PROMPTS[:1], tag="br"), base, tol=1e-6)


def test_server_that_never_starts_names_its_log(tiny_engine_args, tmp_path):
    from atlas_lightning.rollout.engines.server_process import VLLMServer

    # an interpreter that cannot start: the exit path without paying for vLLM's import
    with pytest.raises(EngineError, match=r"exited with code .*server\.log") as failed:
        VLLMServer(tiny_engine_args(), log_path=tmp_path / "server.log", env={"PYTHONHOME": "/nonexistent"},
                   start_timeout_s=60)
    assert "Fatal Python error" in str(failed.value)  # the log's last lines are quoted


def test_server_refusing_its_arguments_names_the_config_key(tiny_engine_args, tmp_path):
    """A real server that exits refusing an argument at its start (a context longer than the
    model's positions) is a config error naming the key, as an in-process engine's refusal is."""
    pytest.importorskip("vllm")
    from atlas_lightning.config import ConfigError
    from atlas_lightning.rollout.engines.server_process import VLLMServer

    with pytest.raises(ConfigError) as refused:
        VLLMServer(tiny_engine_args(max_model_len=1_000_000), log_path=tmp_path / "server.log", start_timeout_s=300)
    message = str(refused.value)
    assert message.startswith("the rollout engine refused rollout.max_model_len (vLLM's max_model_len=1000000)")
    assert "max_position_embeddings" in message and "server.log" in message


def test_absent_server_raises():
    from atlas_lightning.rollout.engines.server_engine import ServerEngine
    from atlas_lightning.rollout.engines.server_http import free_port

    with pytest.raises(EngineError, match="is gone"):
        ServerEngine(f"http://127.0.0.1:{free_port()}")


@pytest.mark.e2e
def test_factory_attaches_to_server_url_and_refuses_what_it_cannot_serve(server_engine):
    from atlas_lightning.config import ConfigError, compose
    from atlas_lightning.rollout.factory import build_engine

    cfg = compose(["rollout=vllm_server_cpu", f"rollout.server_url={server_engine.url}"])
    attached = build_engine(cfg)
    try:
        assert attached.name == "vllm-server" and attached.server is None
        server_engine.set_adapter(None)
        _assert_same(_greedy(attached, PROMPTS, tag="at"), _greedy(server_engine, PROMPTS, tag="ow"), tol=1e-6)
    finally:
        attached.close()
    assert server_engine.server.alive()  # closing an attached engine leaves the server alone

    # refused by the config check, naming the keys, before anything is written; and by the
    # factory again for a config changed after composition
    with pytest.raises(ConfigError, match="rollout.weight_sync=merged with rollout.engine=vllm-server"):
        compose(["rollout=vllm_server_cpu", "rollout.weight_sync=merged"])
    with pytest.raises(NotImplementedError, match="weight_sync"):
        build_engine(_changed(["rollout=vllm_server_cpu"], {"rollout.weight_sync": "merged"}))
    with pytest.raises(ConfigError, match="layout.engine_tp=2 over 2 training processes"):
        compose(["rollout=vllm_server_cpu", "layout=colocated_2gpu", "trainer.devices=2"])
    with pytest.raises(NotImplementedError, match="separate layout"):
        build_engine(_changed(["layout=colocated_2gpu", "trainer.devices=2"], {"rollout.engine": "vllm-server"}),
                     rank=0, world_size=2)
    two_engines = ["rollout=vllm_server_cpu", "layout=colocated_2gpu", "layout.engine_tp=1", "trainer.devices=2"]
    with pytest.raises(ConfigError, match="2 engine"):
        compose([*two_engines, "rollout.server_url=http://127.0.0.1:1"])
    with pytest.raises(NotImplementedError, match="each needs its own server"):
        build_engine(_changed(two_engines, {"rollout.server_url": "http://127.0.0.1:1"}), rank=0, world_size=2)


def _changed(overrides: list[str], changes: dict):
    """A composed config changed afterwards (past the config check)."""
    from omegaconf import OmegaConf

    from atlas_lightning.config import compose

    cfg = OmegaConf.create(OmegaConf.to_container(compose(overrides)))
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


# -- partial rollouts: a weight sync that arrives mid-rollout (the module's server, streamed) ----------


def _streamed_tokens(engine) -> int:
    return sum(len(call.streamed.token_ids) for call in list(engine._calls.values()) if call.streamed is not None)


def _count_interrupted(engine) -> dict:
    """Counts the calls of ``engine.interrupt`` that cut a turn short (a spy on the real engine)."""
    cut = {"syncs": 0}
    interrupt = engine.interrupt

    def counting(request_ids):
        results = interrupt(request_ids)
        cut["syncs"] += any(result.finish_reason == "interrupted" for result in results)
        return results

    engine.interrupt = counting
    return cut


@pytest.mark.e2e
def test_a_sync_mid_rollout_interrupts_it_and_the_rollout_continues_on_the_new_version(
        server_engine, tiny_model_dir, sample_data_dir, tmp_path):
    """Partial rollouts through the datamodule, streamed from this module's server: a weight sync
    (``engine_for_sync``, as ``rollout/sync.py`` holds it) that arrives while a training rollout is
    in flight interrupts it; the rollout keeps every token it streamed with the version that
    sampled it, continues under the new version by re-prefill, and its batch is complete: some
    turns straddle two versions, the per-token arrays agree with the episodes' token counts, and
    the re-prefill is counted."""
    from atlas_lightning.config import compose
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.rollout.engines.server_engine import ServerEngine

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "layout=separate_cpu", "rollout=vllm_server_cpu",
                   "layout.partial_rollouts=true", "trainer.total_steps=3", "rollout.n=2",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=768",
                   "rollout.max_turns=3"])  # turns long enough for a sync to land mid-turn on a loaded machine
    streaming_server = ServerEngine(server_engine.url, max_in_flight=8, streaming=True)
    try:
        dm = RolloutDataModule(cfg, engine=streaming_server)
        dm.setup()
        dm.weights_version = 0
        out: dict = {}
        cut = _count_interrupted(streaming_server)
        producer = threading.Thread(target=lambda: out.update(batch=dm.rollout(1)))
        producer.start()
        # Syncs while tokens stream, until two of them have cut a turn short. A sync can find every
        # turn already finished on the server when a loaded machine delays the client's reading of the
        # stream, so it is repeated rather than trusted to land.
        version = 0
        while cut["syncs"] < 2 and producer.is_alive() and version < 12:
            deadline = time.monotonic() + 120
            while _streamed_tokens(streaming_server) < 4 and producer.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)
            version += 1
            with dm.engine_for_sync():
                assert streaming_server.num_pending() == 0  # the rollout gave the engine up
                dm.weights_version = version
        producer.join(timeout=300)
    finally:
        streaming_server.close()
    assert cut["syncs"] >= 1, "no sync found a turn in flight"
    batch = out["batch"]
    assert batch.weights_version == 0 and batch.stats.reprefill_tokens > 0
    assert batch.timing["reprefill"] >= 0.0
    versions_seen, straddling = set(), 0
    for record in batch.records:
        counts = record.episode["token_counts"]
        mask, versions = record.response_mask.tolist(), record.response_versions.tolist()
        assert len(record.response_ids) == len(mask) == len(versions) == len(record.response_logprobs)
        assert sum(mask) == counts["generated"] and len(mask) == counts["response"]
        assert all((v == -1) == (m == 0) for v, m in zip(versions, mask))
        generated = [v for v in versions if v != -1]
        assert generated == sorted(generated)  # a token's version never goes back
        versions_seen |= set(generated)
        for generation in record.episode["generations"]:
            first, last = generation["offsets"]
            straddling += len({versions[i] for i in range(first, last) if mask[i]}) > 1
    assert 0 in versions_seen and len(versions_seen) >= 2
    assert straddling >= 1


@pytest.mark.e2e
def test_dead_server_raises_engine_error(server_engine):
    """Last: kills the module's server."""
    server = server_engine.server
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    server_engine.submit(GenerationRequest("dead", tuple(PROMPTS[0]), SamplingSpec(max_tokens=4, temperature=0.0)))
    with pytest.raises(EngineError, match=str(server.log_path)):
        server_engine.poll()
    with pytest.raises(EngineError):  # and stays dead
        server_engine.poll()
    with pytest.raises(EngineError):
        server_engine.prompt_logprobs(PROMPTS[0])
