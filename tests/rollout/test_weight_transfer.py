"""Merged weights into a vLLM server through vLLM's own weight-transfer API, on CPU (the ``gloo``
backend registered in the server, ``weight_transfer.py`` on the trainer side): the server then
serves exactly the trainer's merged model, sync after sync, in buckets no larger than asked."""

from __future__ import annotations


import pytest
import torch

from atlas_lightning.rollout.digest import bucket_digest
from atlas_lightning.rollout.engine import GenerationRequest, SamplingSpec
from atlas_lightning.rollout.engines.hf_engine import HFEngine

pytestmark = pytest.mark.vllm

PROBE = [5, 17, 42, 99, 7, 300, 12, 12, 8, 150, 64, 3]
TOL = 2e-4
BUCKET = 96 * 1024  # small, so that the tiny model travels in many buckets


@pytest.fixture(scope="module")
def transfer_server(tiny_engine_args, tmp_path_factory):
    pytest.importorskip("vllm")
    from atlas_lightning.rollout.engines.server_engine import ServerEngine
    from atlas_lightning.rollout.engines.server_process import VLLMServer
    from atlas_lightning.rollout.engines.weight_transfer import ServerWeightTransfer

    log_path = tmp_path_factory.mktemp("transfer") / "vllm-server.log"
    server = VLLMServer(tiny_engine_args(lora_rank=None), log_path=log_path, start_timeout_s=300,
                        weight_transfer="gloo")
    engine = ServerEngine(server.url, server=server, max_in_flight=4)
    transfer = ServerWeightTransfer(server.url, backend="gloo", bucket_bytes=BUCKET)
    yield engine, transfer
    transfer.close()
    engine.close()


def _reference(tiny_model_dir, merged: dict) -> HFEngine:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(merged, strict=False)
    assert not unexpected
    return HFEngine(model)


def _greedy(engine, tag):
    return engine.generate([GenerationRequest(f"{tag}", tuple(PROBE), SamplingSpec(max_tokens=10, temperature=0.0))])[0]


@pytest.mark.e2e
def test_merged_weights_reach_the_server_exactly_in_bounded_buckets(transfer_server, tiny_model_dir, randomize):
    from tests.model_builds import actor_critic
    from atlas_lightning.models.weights import merged_weight_packs, merged_weights
    from atlas_lightning.rollout.engines.server_http import http_call

    engine, transfer = transfer_server
    model = actor_critic(str(tiny_model_dir), {"rank": 8, "alpha": 16}, dtype="float32")
    base_lp = engine.prompt_logprobs(PROBE)  # cached in the server's prefix cache from here on
    for version, seed in ((1, 11), (2, 22)):
        randomize(model, seed=seed, scale=0.2)
        merged = {name: t.clone() for name, t in merged_weights(model, "actor")}
        sizes, sent = [], {}

        def packs():
            for buffer, views in merged_weight_packs(model, "actor", BUCKET):
                sizes.append((buffer.numel(), len(views)))
                sent[f"bucket{len(sent)}"] = bucket_digest(views)
                yield buffer, views

        report = transfer.send(packs(), version=version)
        # what the server's worker received, digested there, bucket by bucket
        assert report.tensor_count == len(merged)
        assert report.digest.entries == sent and report.form == {"kind": "buckets"}
        assert report.extra["buckets"] == len(sizes) > 3
        assert all(n <= BUCKET or k == 1 for n, k in sizes)  # over the cap only a lone tensor
        # the server serves the merged model (and not its cached prefix of the old weights)
        reference = _reference(tiny_model_dir, merged)
        served = engine.prompt_logprobs(PROBE)
        assert max(abs(a - b) for a, b in zip(served, reference.prompt_logprobs(PROBE))) < TOL
        assert max(abs(a - b) for a, b in zip(served, base_lp)) > 100 * TOL
        got, want = _greedy(engine, f"g{version}"), _greedy(reference, f"r{version}")
        assert got.token_ids == want.token_ids
        status, body = http_call(engine.url, "GET", "/weight_info")
        assert status == 200 and body["weight_version"] == str(version)


def test_the_plan_accounts_the_buffers_vllm_keeps():
    """``plan`` sizes the nccl transfer's send and receive buffers as vLLM allocates them."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_NUM_BUFFERS

    from atlas_lightning.planning.estimate import NCCL_NUM_BUFFERS as planned
    from atlas_lightning.rollout.engines.weight_transfer import NCCL_NUM_BUFFERS

    assert planned == NCCL_NUM_BUFFERS == DEFAULT_PACKED_NUM_BUFFERS


def test_bucket_info_cuts_a_pack_back_into_its_tensors(qwen3_base, randomize):
    """What the server is told about a bucket (names, dtypes, shapes, offsets) rebuilds every
    tensor from the raw bytes, as ``gloo_transfer.unpack`` does in the server."""
    pytest.importorskip("vllm")
    from tests.model_builds import actor_critic
    from atlas_lightning.models.weights import merged_weight_packs
    from atlas_lightning.rollout.engines.gloo_transfer import GlooUpdateInfo, unpack
    from atlas_lightning.rollout.engines.weight_transfer import bucket_info

    model = actor_critic(qwen3_base, {"rank": 4, "alpha": 8}, dtype="bfloat16")
    randomize(model)
    for buffer, views in merged_weight_packs(model, "actor", 8 * 1024):
        info = GlooUpdateInfo(**bucket_info(views, buffer))
        received = buffer.clone()  # what arrives: the same bytes, another buffer
        for (name, want), (got_name, got) in zip(views, unpack(received, info)):
            assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_what_the_trainer_sends_parses_as_the_installed_vllm_backend_reads_it(backend):
    """The init and per-bucket messages are built for the vLLM that is installed (0.32 carries the
    packing in the init info, 0.26 in each bucket's): the backend's own info classes take them whole,
    and the packing the trainer broadcasts with is the one the worker is told."""
    pytest.importorskip("vllm")
    from atlas_lightning.rollout.engines.weight_transfer import ServerWeightTransfer, api_generation

    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
        init_cls, update_cls = NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
    else:
        from atlas_lightning.rollout.engines.gloo_transfer import GlooInitInfo, GlooUpdateInfo
        init_cls, update_cls = GlooInitInfo, GlooUpdateInfo
    transfer = ServerWeightTransfer("http://127.0.0.1:9", backend=backend, bucket_bytes=BUCKET, workers=2)
    buffer = torch.zeros(64, dtype=torch.uint8)
    views = [("a.weight", buffer[:32].view(torch.bfloat16).view(4, 4)), ("b.bias", buffer[32:].view(torch.float32))]
    init = init_cls(**transfer.worker_init_info(29555))
    update = update_cls(**transfer.update_info(buffer, views))
    assert (init.master_port, init.rank_offset, init.world_size) == (29555, 1, 3)
    assert update.names == ["a.weight", "b.bias"] and update.shapes == [[4, 4], [8]]
    assert update.dtype_names == ["bfloat16", "float32"]
    if backend == "nccl":
        packing = init if api_generation() >= 32 else update
        assert (packing.packed, packing.packed_buffer_size_bytes) == (True, BUCKET)
