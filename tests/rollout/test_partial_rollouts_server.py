"""Partial rollouts through the datamodule and a real CPU vLLM server (streamed completions): a
weight sync (``engine_for_sync``, as ``rollout/sync.py`` holds it) that arrives while a training
rollout is in flight interrupts it; the rollout keeps every token it streamed with the version
that sampled it, continues under the new version by re-prefill, and its batch is complete:
some turns straddle two versions, the per-token arrays agree with the episodes' token counts, and
the re-prefill is counted."""

from __future__ import annotations

import threading
import time

import pytest

from atlas_lightning.config import compose
from atlas_lightning.rollout.datamodule import RolloutDataModule

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def streaming_server(tiny_engine_args, tmp_path_factory):
    pytest.importorskip("vllm")
    from atlas_lightning.rollout.engines.server_engine import ServerEngine
    from atlas_lightning.rollout.engines.server_process import VLLMServer

    server = VLLMServer(tiny_engine_args(), log_path=tmp_path_factory.mktemp("server") / "vllm-server.log",
                        start_timeout_s=300)
    engine = ServerEngine(server.url, server=server, max_in_flight=8, streaming=True)
    yield engine
    engine.close()


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


def test_a_sync_mid_rollout_interrupts_it_and_the_rollout_continues_on_the_new_version(
        streaming_server, tiny_model_dir, sample_data_dir, tmp_path):
    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "layout=separate_cpu", "rollout=vllm_server_cpu",
                   "layout.partial_rollouts=true", "trainer.total_steps=3", "rollout.n=2",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=256", "rollout.max_turns=3"])
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
