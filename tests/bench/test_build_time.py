"""The build start-up benchmark on CPU at toy size: every build goes through the one builder and
reports where it was built and what its kernels resolved to."""

from __future__ import annotations

import json

from atlas_lightning.bench.build_time import main


def test_tiny_builds_are_timed_and_report_their_kernels(tmp_path):
    out = tmp_path / "build.json"
    assert main(["--shape", "tiny_hybrid", "--folder", str(tmp_path / "folder"), "--host", "--device", "cpu",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [b["build"] for b in result["builds"]] == ["random", "folder", "host"]
    for build in result["builds"]:
        assert build["seconds"] > 0 and build["built_on"] == build["parameters_on"] == "cpu"
        assert (build["elementwise_kernels"], build["linear_attention_kernel"], build["attention_length_bucket"]) == (
            "torch", "torch", 0)
    assert result["folder_gib"] > 0 and not (tmp_path / "folder").exists()
