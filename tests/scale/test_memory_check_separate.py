"""Memory-check mode in the separate layout on CPU: the CPU vLLM server is started as ``fit``
starts it, the merged weights move to it in buckets of ``rollout.bucket_mb`` through vLLM's
weight-transfer API (gloo) by ``fit``'s own weight sync, verified, a generation burst runs on
it, and both sides' memory is reported; and the serving-side reader measures a known allocation
in a process tree."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from atlas_lightning.config import compose
from atlas_lightning.run.serving_memory import GIB, ServingMemory

ALLOCATE = 300 * 2**20

#: A parent that starts a child; the child waits for ``go``, then holds ALLOCATE bytes (touched)
#: for a second, frees them and waits again: a known peak inside a process tree.
_TREE = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
sys.stdout.write("ready\\\\n"); sys.stdout.flush()
sys.stdin.readline()
block = bytearray({ALLOCATE}); block[::4096] = b"x" * len(block[::4096])
time.sleep(1.0)
del block
sys.stdout.write("done\\\\n"); sys.stdout.flush()
time.sleep(60)
'''], stdin=sys.stdin, stdout=sys.stdout)
child.wait()
"""


def test_serving_memory_sees_a_known_peak_in_the_process_tree():
    tree = subprocess.Popen([sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert tree.stdout.readline().strip() == "ready"
        memory = ServingMemory(pid=tree.pid)
        with memory.window("receive_weights", 3) as record:
            tree.stdin.write("go\n")
            tree.stdin.flush()
            assert tree.stdout.readline().strip() == "done"
        assert record["measured"] and record["processes"] == 2 and record["step"] == 3
        assert record["peak_reset"] is True
        # the peak holds the block (VmHWM, exact per process); the end does not
        assert record["peak_gib"] - record["start_gib"] >= 0.95 * ALLOCATE / GIB
        assert record["end_gib"] < record["start_gib"] + 0.5 * ALLOCATE / GIB
        # samples see at most the peak (the kernel syncs its counters lazily: allow 1%)
        assert record["sampled_peak_gib"] <= 1.01 * record["peak_gib"]
        assert memory.records == [record] and "VmHWM" in memory.measures
    finally:
        for process in psutil.Process(tree.pid).children(recursive=True):
            process.kill()
        tree.kill()
        tree.wait()


class _FakeNVML:
    """NVML's three calls the reader makes, over cards whose used bytes the test sets."""

    def __init__(self, used: dict[int, int]) -> None:
        self.used = used

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.used:
            raise ValueError(index)
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        return type("Info", (), {"used": self.used[handle]})()


def test_serving_cards_are_read_per_card_and_the_peak_is_kept():
    from atlas_lightning.run.memory_check_separate import serving_rows

    nvml = _FakeNVML({4: 10 * GIB, 5: 11 * GIB})
    memory = ServingMemory(cards=["4", "5"], interval_s=0.005)
    memory._nvml, memory._handles = nvml, None
    memory._handles = memory._card_handles()
    with memory.window("receive_weights", 2) as record:
        nvml.used[5] = 15 * GIB  # the receive buffers arrive on card 5...
        time.sleep(0.2)
        nvml.used[5] = 12 * GIB  # ...and are freed before the window closes
    assert record["measured"] and record["cards_gib"] == {"4": 10.0, "5": 15.0}
    assert (record["start_gib"], record["peak_gib"], record["end_gib"]) == (11.0, 15.0, 12.0)
    assert "NVML" in memory.measures
    plan = type("Plan", (), {"phases": [type("Phase", (), {"name": "receive_weights", "cards": "serving cards",
                                                           "card": 14 * GIB})()]})()
    rows = serving_rows({"windows": memory.records}, plan)
    assert rows == [{"phase": "receive_weights", "step": 2, "measured": True, "peak_gib": 15.0, "end_gib": 12.0,
                     "start_gib": 11.0, "plan_card_gib": 14.0}]
    unknown = ServingMemory(cards=["9"])
    unknown._nvml = nvml
    unknown._handles = unknown._card_handles()
    assert unknown._handles == [] and "does not know the serving cards" in unknown.why_not()


def test_without_a_server_or_cards_nothing_is_invented():
    memory = ServingMemory()
    with memory.window("generation", 0) as record:
        pass
    assert record["measured"] is False and "rollout.server_url" in record["why"]
    assert "peak_gib" not in record


@pytest.mark.vllm
@pytest.mark.e2e
def test_separate_memory_check_moves_the_merged_weights_and_measures_both_sides(tiny_model_dir, sample_data_dir,
                                                                                 tmp_path):
    from atlas_lightning.run.memory_check import run_memory_check

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "layout=separate_cpu", "rollout=vllm_server_cpu",
                   "rollout.weight_sync=merged", "rollout.bucket_mb=1", "trainer.memory_check_steps=1",
                   "rollout.max_in_flight=4", "rollout.max_tokens_per_turn=16", "rollout.max_prompt_length=64",
                   "algorithm.ppo_max_token_len_per_gpu=512", "algorithm.forward_max_token_len_per_gpu=1024",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=2", "algorithm.ppo_epochs=1"])
    report = run_memory_check(cfg)
    serving = report["serving"]

    # fit's weight sync ran twice (the start, after step 1), merged, through gloo, in 1 MiB buckets
    from atlas_lightning.planning.shapes import safetensors_header

    weights = len(safetensors_header(tiny_model_dir / "model.safetensors"))  # the base's tensors
    transfers = serving["transfers"]
    assert [t["version"] for t in transfers] == [0, 1]
    for t in transfers:
        assert t["weight_sync"] == "merged" and t["backend"] == "gloo"
        assert t["tensors"] == weights  # what the server's worker received, verified against what was sent
        model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
        assert t["buckets"] >= model_bytes // 2**20 and t["largest_bucket_mib"] <= 1.0
        assert t["logprob_gap"] <= cfg.rollout.max_logprob_gap

    # training side: the usual phases plus the send side of the transfer, at every sync
    phases = {row["phase"] for row in report["summary"]}
    assert {"old_log_prob", "values", "update_critic", "update_actor", "update_weights"} <= phases
    sends = [p for p in report["ranks"][0]["phases"] if p["phase"] == "update_weights"]
    assert [p["step"] for p in sends] == [0, 1] and all(p["peak_rss_gib"] > 0.05 for p in sends)

    # serving side: the server's process tree, during generation and each receive
    assert "server process tree" in serving["measures"]
    windows = serving["windows"]
    assert [(w["phase"], w["step"]) for w in windows] == [("receive_weights", 0), ("generation", 0),
                                                           ("receive_weights", 1)]
    for window in windows:
        assert window["measured"] and window["processes"] >= 2  # API server + engine core
        assert 0.2 < window["peak_gib"] < 32 and window["end_gib"] > 0.2
    rows = {row["phase"]: row for row in serving["summary"]}
    assert set(rows) == {"generation", "receive_weights"}
    gen = serving["generation"]
    assert gen["measured"] and gen["requests_per_rank"] == 4 and gen["generated_tokens"] > 0
    assert report["generation"][0]["measured"] is False  # training cards never generate here

    # the server rank 0 started is gone, the report is on disk
    pid = serving["server_pid"]
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    written = json.loads((tmp_path / "outputs" / cfg.name / "memory_check.json").read_text())
    assert written["serving"]["transfers"] == transfers
