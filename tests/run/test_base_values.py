"""A base whose weight files hold a NaN or an inf anywhere is refused through the CLI before
anything is written (``run/base_values.py``): exit 2, one line naming ``model.path``, the file, the
tensor and how many values, no traceback, the run's root untouched. Whatever the tensor (the
embedding, a norm, a layer's weight), the value (NaN, +inf, -inf) and the files' layout (one
safetensors file, an indexed shard set, a ``*.bin``). Before this check such a base loaded on both
sides and stopped the run only at the starting weight sync, its files written."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas_lightning.cli import main
from atlas_lightning.models.build import BaseWeightsError
from atlas_lightning.run.base_values import check_finite_base


def _damaged_copy(tiny_model_dir, tmp_path, pick, value, layout="single"):
    """A copy of the tiny model with ``value`` at one element of the tensor ``pick`` chooses, laid
    out as ``layout``; returns (folder, tensor name, file name holding it)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tensors = load_file(model / "model.safetensors")
    name = pick(sorted(tensors))
    damaged = tensors[name].clone()
    damaged.view(-1)[damaged.numel() // 2] = value
    tensors[name] = damaged
    (model / "model.safetensors").unlink()
    if layout == "single":
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
        return model, name, "model.safetensors"
    if layout == "bin":
        torch.save(tensors, model / "pytorch_model.bin")
        return model, name, "pytorch_model.bin"
    # two shards and their index, the damaged tensor in the second
    names = sorted(tensors)
    second = set(names[len(names) // 2:]) | {name}
    shards = {"model-00001-of-00002.safetensors": [n for n in names if n not in second],
              "model-00002-of-00002.safetensors": sorted(second)}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model, name, "model-00002-of-00002.safetensors"


CASES = [
    ("embedding, NaN, one file", lambda names: next(n for n in names if "embed_tokens" in n), math.nan, "single"),
    ("final norm, +inf, shards", lambda names: next(n for n in names if n == "model.norm.weight"), math.inf,
     "shards"),
    ("a layer's MLP, -inf, .bin", lambda names: next(n for n in names if ".mlp.down_proj." in n), -math.inf, "bin"),
]


@pytest.mark.parametrize("pick, value, layout", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_non_finite_base_is_refused_through_the_cli_before_anything_is_written(pick, value, layout, tiny_model_dir,
                                                                                sample_data_dir, tmp_path, capsys):
    model, name, file = _damaged_copy(tiny_model_dir, tmp_path, pick, value, layout)
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={model}",
                 f"data.root={sample_data_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    counted = "1 NaN, 0 inf" if math.isnan(value) else "0 NaN, 1 inf"
    assert f"model.path={model}: the weights hold non-finite values ({name} in {file} ({counted} of " in err, err
    assert "Traceback" not in err
    assert not root.exists()


def test_a_finite_base_is_read_whole_and_passes(tiny_model_dir):
    assert check_finite_base(tiny_model_dir) == len(load_file(tiny_model_dir / "model.safetensors"))


def test_a_file_whose_data_its_header_does_not_match_is_named(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1024])  # the header intact, the last tensor's bytes cut short
    with pytest.raises(BaseWeightsError, match=r"model.safetensors cannot be read.*the file is damaged"):
        check_finite_base(model)


def test_one_process_a_machine_reads_the_base(tiny_model_dir, tmp_path, monkeypatch):
    """The other ranks of a launch build from the same files; the local rank 0 refuses for all."""
    model, _, _ = _damaged_copy(tiny_model_dir, tmp_path, lambda names: names[0], math.nan)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert check_finite_base(model) == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(BaseWeightsError):
        check_finite_base(model)
