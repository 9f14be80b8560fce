"""Bad config values are refused before any work, naming the key (exit 2): non-finite numbers
anywhere, values out of their range, unknown choices, unsafe names; and a model folder that is
not one is refused by every verb before it writes a config or a log."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import typing

import pytest
from omegaconf import OmegaConf

from atlas_lightning.cli import main
from atlas_lightning.config import ConfigError, RootConfig, compose, validate
from atlas_lightning.constraints import CONSTRAINTS
from tests.conftest import write_fake_model_folder, write_fake_safetensors


@pytest.mark.parametrize("override, named", [
    ("reward.cost_per_usd=nan", "reward.cost_per_usd=nan: must be a finite number"),
    ("reward.cost_per_usd=inf", "reward.cost_per_usd=inf: must be a finite number"),
    ("reward.cost_per_usd=-0.1", "reward.cost_per_usd"),
    ("reward.cost_per_usd=1e300", "reward.cost_per_usd"),
    ("reward.no_submit_reward=-inf", "reward.no_submit_reward"),
    ("algorithm.clip_ratio_low=nan", "algorithm.clip_ratio_low"),
    ("algorithm.clip_ratio_low=1.0", "algorithm.clip_ratio_low"),
    ("algorithm.clip_ratio_c=1.0", "algorithm.clip_ratio_c"),
    ("algorithm.actor_lr=-0.001", "algorithm.actor_lr=-0.001: must be within (0, 1]"),
    ("algorithm.critic_lr=0", "algorithm.critic_lr"),
    ("algorithm.critic_lr=inf", "algorithm.critic_lr"),
    ("algorithm.betas=[0.9]", "algorithm.betas=[0.9]: must hold exactly 2 values"),
    ("algorithm.betas=[0.9,1.0]", "algorithm.betas"),
    ("algorithm.betas=[0.9,nan]", "algorithm.betas[1]=nan"),
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("algorithm.grad_clip=0", "algorithm.grad_clip"),
    ("algorithm.entropy_coeff=nan", "algorithm.entropy_coeff"),
    ("algorithm.weight_decay=-1", "algorithm.weight_decay"),
    ("algorithm.critic_warmup=-1", "algorithm.critic_warmup"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5: must be within (0, 1]"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.val_temperature=-1", "rollout.val_temperature"),
    ("rollout.top_k=-2", "rollout.top_k"),
    ("rollout.request_timeout_s=nan", "rollout.request_timeout_s"),
    ("rollout.max_logprob_gap=0", "rollout.max_logprob_gap"),
    ("rollout.logprob_gap_factor=0.5", "rollout.logprob_gap_factor"),
    ("rollout.max_explores=65", "rollout.max_explores"),
    ("rollout.server_url=localhost:8000", "rollout.server_url"),
    ("model.lora.dropout=1.5", "model.lora.dropout=1.5: must be within [0, 1)"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.rank=0", "model.lora.rank"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("model.lora.target_modules=[q_proj,q_proj]", "model.lora.target_modules"),
    ("model.lora.target_modules='q proj'", "model.lora.target_modules"),
    ("model.checkpoint_layers=-1", "model.checkpoint_layers=-1: must be null, auto or an integer >= 0"),
    ("model.checkpoint_layers=all", "model.checkpoint_layers='all': must be null, auto or an integer >= 0"),
    ("model.checkpoint_layers=AUTO", "model.checkpoint_layers"),
    ("model.checkpoint_layers=2.5", "model.checkpoint_layers"),
    ("model.checkpoint_layers=true", "model.checkpoint_layers"),
    ("model.sequence_layout=ragged", "model.sequence_layout"),
    ("data.benchmarks=[mmlu]", "data.benchmarks=['mmlu']: item 0 ('mmlu') is not one of gpqa, lcb"),
    ("data.benchmarks=[]", "data.benchmarks"),
    ("data.benchmarks=[gpqa,gpqa]", "data.benchmarks"),
    ("data.train_split=../train", "data.train_split"),
    ("data.val_max_questions=0", "data.val_max_questions"),
    ("seed=-1", "seed"),
    ("name=../../x", "name="),
    ("name=a/b", "name="),
    ("name=..", "name="),
    ("name=.hidden", "name="),
    ("name=''", "name="),
    ("trainer.val_every=-1", "trainer.val_every"),
    ("trainer.precision=fp8", "trainer.precision"),
    ("hub.repo_id=noslash", "hub.repo_id"),
    # an empty path would read as the working directory
    ("model.path=''", "model.path='': must be a path (not empty)"),
    ("data.root=", "data.root='': must be a path"),
    ("paths.root=''", "paths.root='': must be a path"),
    ("paths.logs=''", "paths.logs='': must be a path"),
    ("model.critic_adapter=''", "model.critic_adapter='': must be null or a path"),
    ("rollout.engine=''", "rollout.engine='' is neither one of vllm, vllm-server, hf nor a class"),
    # beyond 64 bits: len(), torch and numpy would fail deep inside the run
    ("trainer.total_steps=99999999999999999999", "trainer.total_steps=99999999999999999999: must be an integer >= 1 "
                                                 "that fits in 64 bits"),
    ("rollout.max_in_flight=9223372036854775808", "rollout.max_in_flight"),
    ("seed=18446744073709551616", "seed=18446744073709551616: must be an integer within 0..4294967295"),
    ("+callbacks.timer.duration=nan", "callbacks.timer.duration=nan"),
])
def test_bad_values_are_refused_naming_the_key(override, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        compose(["experiment=tiny-cpu", override])


@pytest.mark.parametrize("override", ["reward.cost_per_usd=nan", "rollout.top_p=1.5", "name=../../x",
                                      "algorithm.betas=[0.9]", "logger.project=''", "logger.project='  '",
                                      "model.checkpoint_layers=all"])
def test_the_cli_exits_2_and_writes_nothing(override, tmp_path, capsys):
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", override]) == 2
    assert override.split("=")[0] in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_every_report_run_passes_its_rules():
    for experiment in ("r28-continued-cost-8gpu-n32", "r28-base-cost-2gpu", "tiny-cpu",
                       "r28-continued-cost-8gpu-t49152-n16-separate4-4-memory"):
        compose([f"experiment={experiment}"])


def _numeric_leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(kind):
            yield from _numeric_leaves(kind, key + ".")
            continue
        args = set(typing.get_args(kind)) - {type(None)}
        inner = args | {kind}
        if inner & {int, float} or any(typing.get_args(a) and set(typing.get_args(a)) & {int, float} for a in inner):
            yield key


def test_every_numeric_key_of_the_schema_has_a_rule():
    numeric = set(_numeric_leaves(RootConfig))
    assert numeric, "the walk found no numeric field"
    missing = sorted(numeric - set(CONSTRAINTS))
    assert not missing, f"numeric config keys without a rule in constraints.py: {missing}"


def _string_leaves(cls, prefix=""):
    """``(key, is_list)`` of every field of the schema that holds a string or a list of strings."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(kind):
            yield from _string_leaves(kind, key + ".")
            continue
        options = set(typing.get_args(kind)) if typing.get_origin(kind) is typing.Union else {kind}
        if str in options:
            yield key, False
        elif any(typing.get_origin(a) is list and typing.get_args(a) == (str,) for a in options):
            yield key, True
        elif any(typing.get_origin(a) is dict and typing.get_args(a)[0] is str for a in options):
            yield key, None  # a mapping: its keys and values are checked where it is read


#: String keys whose rule lives in ``config.validate`` (a class path: ``_check_target``; each
#: callback's ``_target_``) or the loader (``data.columns``: our name -> the file's,
#: ``questions.loader._check_mapping``).
_CHECKED_ELSEWHERE = {"rollout.engine", "reward._target_", "data.columns", "callbacks"}


def test_every_string_key_of_the_schema_has_a_rule():
    strings = {key for key, _ in _string_leaves(RootConfig)}
    assert {"logger.project", "name", "data.subset_columns"} <= strings, "the walk missed string fields"
    assert not sorted(strings - set(CONSTRAINTS) - _CHECKED_ELSEWHERE)


@pytest.mark.parametrize("key, is_list", sorted((k, is_list) for k, is_list in _string_leaves(RootConfig)
                                                  if is_list is not None))
@pytest.mark.parametrize("blank", ["", "   "])
def test_an_empty_or_blank_name_is_refused_naming_its_key(key, is_list, blank, composed):
    """No key that names something (a W&B project or entity, the run, a path, a column, a tag,
    a class) takes an empty or a blank string: each is refused by its key before any work (the
    mappings: ``test_a_blank_column_mapping_is_refused_naming_the_key``, and a callback needs a
    ``_target_`` naming a class). The value is set on one composed config and checked by
    ``config.validate``, which ``compose`` runs last (a hydra compose a case made this the suite's
    costliest test); ``test_a_blank_value_through_compose_is_refused_by_its_key`` takes compose's
    whole path."""
    cfg = copy.deepcopy(composed)
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.update(cfg, key, [blank] if is_list else blank, merge=False)
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}="):
        validate(cfg)


@pytest.mark.parametrize("key, value", [("logger.project", "'   '"), ("data.subset_columns", "['']"),
                                        ("model.path", "'  '")])
def test_a_blank_value_through_compose_is_refused_by_its_key(key, value):
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}="):
        compose(["experiment=tiny-cpu", f"{key}={value}"])


@pytest.fixture(scope="module")
def composed():
    """``experiment=tiny-cpu`` composed once for the module's checks of single values."""
    return compose(["experiment=tiny-cpu"])


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_column_mapping_is_refused_naming_the_key(blank, tmp_path, sample_data_dir):
    from atlas_lightning.questions.loader import DataError, load_splits

    cfg = compose(["experiment=tiny-cpu", f"data.root={sample_data_dir}", f"+data.columns={{problem:'{blank}'}}"])
    with pytest.raises(DataError, match=re.escape(f"data.columns.problem: expected the file's column name, got "
                                                  f"{blank!r}")):
        load_splits(cfg.data)


def test_every_rule_names_a_key_of_the_schema():
    schema = OmegaConf.structured(RootConfig)
    absent = [key for key in CONSTRAINTS if OmegaConf.select(schema, key, default="<absent>") == "<absent>"]
    assert not absent


# -- the model folder ------------------------------------------------------------------------


def _model_folder(tmp_path):
    return write_fake_model_folder(tmp_path / "model")


def _shard_folder(path, damage):
    """Two shards, ``w`` and ``v`` in the first and ``u`` in the second, and an index damaged as
    ``damage`` says (the whole class of an index that does not account for the weights)."""
    (path / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write_fake_safetensors(path / first, ("w", "v"))
    write_fake_safetensors(path / second, ("u",))
    weight_map = {"w": first, "v": first, "u": second}
    if damage == "shard_left_out":
        weight_map = {"w": first, "v": first}
    elif damage == "tensor_unmapped":
        weight_map["v"] = second
    elif damage == "tensor_absent":
        weight_map["x"] = first
    if damage != "unindexed_shards":
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


_FOLDER_DAMAGE = [("missing", "no such folder"), ("no_config", "no config.json"),
                  ("bad_config", "config.json is not readable JSON")]
_WEIGHTS_DAMAGE = [("no_tokenizer", "no tokenizer"), ("no_weights", "no weight files"),
                   ("truncated", "model.safetensors is truncated"), ("bad_tokenizer", "tokenizer.json is not readable JSON"),
                   ("missing_shard", "model.safetensors.index.json names shard(s) not in the folder: "
                                     "model-00002-of-00002.safetensors"),
                   ("shard_left_out", "model.safetensors.index.json leaves out weight file(s) "
                                      "model-00002-of-00002.safetensors"),
                   ("tensor_unmapped", "model-00001-of-00002.safetensors does not match model.safetensors.index.json: "
                                       "it holds 1 tensor(s) the index does not map to it (v)"),
                   ("tensor_absent", "model-00001-of-00002.safetensors does not match model.safetensors.index.json: "
                                     "it lacks 1 tensor(s) the index maps to it (x)"),
                   ("unindexed_shards", "2 *.safetensors files and no model.safetensors.index.json"),
                   ("json_not_tokenizer", "tokenizer.json is not a tokenizer the tokenizers library can load")]


# plan reads config.json alone (it may run before the weights are fetched)
@pytest.mark.parametrize("verb, damage, message",
                         [(v, d, m) for v in ("fit", "validate", "memory-check", "plan") for d, m in _FOLDER_DAMAGE]
                         + [(v, d, m) for v in ("fit", "validate", "memory-check") for d, m in _WEIGHTS_DAMAGE])
def test_every_verb_refuses_a_bad_model_folder_before_writing(verb, damage, message, tmp_path, capsys):
    root = tmp_path / "root"
    if damage == "missing":
        path = tmp_path / "no-such-model"
    else:
        path = _model_folder(tmp_path)
        if damage == "no_config":
            (path / "config.json").unlink()
        elif damage == "bad_config":
            (path / "config.json").write_text("{not json")
        elif damage == "no_tokenizer":
            (path / "tokenizer.json").unlink()
        elif damage == "no_weights":
            (path / "model.safetensors").unlink()
        elif damage == "bad_tokenizer":
            (path / "tokenizer.json").write_text('{"model": ')  # cut short in the copy
        elif damage == "missing_shard":
            shards = {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}
            (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
        elif damage in ("shard_left_out", "tensor_unmapped", "tensor_absent", "unindexed_shards"):
            _shard_folder(path, damage)
        elif damage == "json_not_tokenizer":
            (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": []}))
        else:
            data = (path / "model.safetensors").read_bytes()
            (path / "model.safetensors").write_bytes(data[:-4])
    code = main([verb, "experiment=tiny-cpu", f"paths.root={root}", f"model.path={path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.path=" in err and message in err
    assert not root.exists() or not any(root.rglob("*"))  # no config, no log


def test_a_bad_question_file_exits_2_before_anything_is_written(tmp_path, sample_data_dir, capsys):
    import shutil

    import pyarrow.parquet as pq

    data = tmp_path / "data"
    shutil.copytree(sample_data_dir, data)
    table = pq.read_table(data / "gpqa" / "val_full.parquet").to_pylist()
    table[5]["ground_truth"] = "H"
    pq.write_table(__import__("pyarrow").Table.from_pylist(table), data / "gpqa" / "val_full.parquet")
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={_model_folder(tmp_path)}",
                 f"data.root={data}"])
    err = capsys.readouterr().err
    assert code == 2 and "gpqa/val_full.parquet row 5 " in err and "field ground_truth: 'H' is not one of" in err
    assert not root.exists()


def _data_with(tmp_path, sample_data_dir, change):
    """A copy of the sample under ``tmp_path/data`` whose files ``change(benchmark, split, rows)``
    edits in place (rows as ``pyarrow``'s ``to_pylist`` gives them)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    shutil.copytree(sample_data_dir, data)
    for path in sorted(data.glob("*/*.parquet")):
        rows = pq.read_table(path).to_pylist()
        change(path.parent.name, path.stem, rows)
        pq.write_table(pa.Table.from_pylist(rows), path)
    return data


def _fit_refused(tmp_path, capsys, data, *overrides) -> str:
    """``fit`` on ``data`` (a model folder the checks before the data pass): exit 2, one line of
    stderr without a traceback, and nothing under ``paths.root``; returns that line."""
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={_model_folder(tmp_path)}",
                 f"data.root={data}", *overrides])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert not root.exists()
    return lines[0]


def _shared_ids(count, benchmark):
    """Give the first ``count`` validation rows of ``benchmark`` the ids of training rows 7, 8, ..."""
    def change(bench, split, rows):
        if bench == benchmark and split == "val_full":
            for k in range(count):
                rows[3 + k]["question_id"] = f"{benchmark}-train-{7 + k:04d}"
    return change


@pytest.mark.parametrize("count, benchmark", [(1, "gpqa"), (3, "lcb")])
def test_a_question_in_both_the_train_and_the_val_split_exits_2_before_anything_is_written(
        count, benchmark, tmp_path, sample_data_dir, capsys):
    line = _fit_refused(tmp_path, capsys, _data_with(tmp_path, sample_data_dir, _shared_ids(count, benchmark)))
    assert (f"{benchmark}/train.parquet row 7 and {benchmark}/val_full.parquet row 3 "
            f"(question_id={benchmark}-train-0007) field question_id: the same question in the training and the "
            f"validation split") in line
    assert (f"({count - 1} more id(s) of {benchmark} are in both)" in line) == (count > 1)


def test_preflight_names_a_question_in_both_splits(tmp_path, sample_data_dir, capsys):
    from atlas_lightning.run.preflight import main as preflight_main

    data = _data_with(tmp_path, sample_data_dir, _shared_ids(1, "gpqa"))
    assert preflight_main(["experiment=tiny-cpu", "--cpu-preflight", f"paths.root={tmp_path / 'root'}",
                           f"model.path={_model_folder(tmp_path)}", f"data.root={data}"]) == 2
    line = next(line for line in capsys.readouterr().out.splitlines() if "] data " in line)
    assert line.startswith("[FAIL] data") and "(question_id=gpqa-train-0007) field question_id: the same question" in line


def test_one_file_named_as_both_splits_exits_2_before_anything_is_written(tmp_path, sample_data_dir, capsys):
    line = _fit_refused(tmp_path, capsys, sample_data_dir, "data.val_split=train")
    assert "data.train_split and data.val_split both name 'train'" in line


def test_a_shared_question_beyond_the_validation_cap_is_not_one_validation_scores(tmp_path, sample_data_dir):
    """Only the questions validation scores count (``data.val_max_questions``, the first of each file)."""
    from atlas_lightning.questions.loader import DataError, load_splits

    def change(bench, split, rows):
        if split == "val_full":
            rows[-1]["question_id"] = f"{bench}-train-0000"
    data = _data_with(tmp_path, sample_data_dir, change)
    assert load_splits(compose(["experiment=tiny-cpu", f"data.root={data}", "data.val_max_questions=8"]).data).val
    with pytest.raises(DataError, match="row 0 and gpqa/val_full.parquet row 47.*or load them as they are with "
                                        "data.split_overlap=allow"):
        load_splits(compose(["experiment=tiny-cpu", f"data.root={data}"]).data)
    allowed = load_splits(compose(["experiment=tiny-cpu", f"data.root={data}", "data.split_overlap=allow"]).data)
    assert allowed.val[47].question_id == allowed.train[0].question_id == "gpqa-train-0000"  # loaded as they are
    with pytest.raises(DataError, match="both name 'train'"):  # one file as both splits: whatever the switch
        load_splits(compose(["experiment=tiny-cpu", f"data.root={data}", "data.split_overlap=allow",
                             "data.val_split=train"]).data)


@pytest.mark.parametrize("split", ["train", "val_full"])
@pytest.mark.parametrize("truth", ["42", "b", "(B)", "Answer: B", ""])
def test_a_gpqa_ground_truth_that_is_no_letter_exits_2_before_anything_is_written(split, truth, tmp_path,
                                                                                   sample_data_dir, capsys):
    def change(bench, name, rows):
        if (bench, name) == ("gpqa", split):
            rows[11]["ground_truth"] = truth
    line = _fit_refused(tmp_path, capsys, _data_with(tmp_path, sample_data_dir, change))
    assert (f"gpqa/{split}.parquet row 11 (question_id=gpqa-{split}-0011) field ground_truth: GPQA needs one capital "
            f"letter A-Z, got {truth!r}") in line


def test_a_paths_root_that_is_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path / 'afile' / 'below'}",
                 f"model.path={_model_folder(tmp_path)}"])
    assert code == 2 and "is not a folder" in capsys.readouterr().err


def test_a_config_file_that_is_not_yaml_exits_2_naming_file_and_line(tmp_path, capsys):
    user = tmp_path / "conf" / "experiment"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text("defaults:\n  - tiny-cpu\n  bad: [\n")
    root = tmp_path / "root"
    assert main(["fit", "experiment=mine", f"paths.root={root}", "--config-dir", str(tmp_path / "conf")]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and f"{user / 'mine.yaml'}\", line 3" in err
    assert not root.exists()


def test_a_complete_sharded_folder_passes_the_model_folder_check(tmp_path):
    from atlas_lightning.planning.model_folder import check_model_folder

    path = write_fake_model_folder(tmp_path / "model")
    _shard_folder(path, "complete")
    assert check_model_folder(path)["model_type"] == "qwen3"


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=atlas_lightning.rollout.factory.no_such_engine",
     "rollout.engine='atlas_lightning.rollout.factory.no_such_engine': atlas_lightning.rollout.factory has no 'no_such_engine'"),
    ("reward._target_=atlas_lightning.reward.NoSuchReward",
     "reward._target_='atlas_lightning.reward.NoSuchReward': atlas_lightning.reward has no 'NoSuchReward'"),
    ("+callbacks.mine._target_=atlas_lightning.callbacks.validation.NoSuchCallback",
     "callbacks.mine._target_='atlas_lightning.callbacks.validation.NoSuchCallback': "
     "atlas_lightning.callbacks.validation has no 'NoSuchCallback'"),
    ("+callbacks.mine._target_=no_such_pkg.Callback", "callbacks.mine._target_='no_such_pkg.Callback': no module no_such_pkg"),
    ("reward._target_=atlas_lightning.reward.scorer.CostReward.no_method",
     "atlas_lightning.reward.scorer.CostReward has no 'no_method'"),
    ("reward._target_=atlas_lightning.reward.scorer.REQUIRED_FIELDS", "names a tuple, not a class or factory"),
    ("rollout.engine=builtins.len", "rollout.engine='builtins.len' cannot be called as builtins.len(cfg, rank=, "
                                    "local_rank=, world_size=)"),
    ("rollout.engine=atlas_lightning.rollout.factory.engine_world",
     "rollout.engine='atlas_lightning.rollout.factory.engine_world' cannot be called as"),
    ("rollout.engine=collections.OrderedDict.fromkeys", "cannot be called as collections.OrderedDict.fromkeys("),
])
def test_every_target_must_name_an_object_before_anything_is_written(override, message, tmp_path, capsys):
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}", override])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("where", ["root", "outputs", "checkpoints", "logs", "artifacts"])
def test_a_run_folder_that_cannot_be_written_exits_2_before_anything_is_written(where, tmp_path, capsys):
    root = tmp_path / "root"
    blocked = {"root": root, "outputs": root / "outputs" / "tiny", "checkpoints": root / "checkpoints" / "tiny",
               "logs": root / "logs", "artifacts": root / "artifacts" / "tiny"}[where]
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("a file where the run needs a folder")
    model = write_fake_model_folder(tmp_path / "model")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", "name=tiny", f"model.path={model}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{blocked} is not a folder" in err and "Traceback" not in err
    assert f"paths.{where}=" in err and f"choose another paths.{where}" in err  # the key to change
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_paths_root_on_a_read_only_place_exits_2(tmp_path, capsys):
    code = main(["fit", "experiment=tiny-cpu", "paths.root=/proc/atlas",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err
    assert code == 2 and "paths.root=/proc/atlas: /proc is not writable" in err, err


@pytest.mark.parametrize("override, key", [("name=$(whoami)", "name"), ("trainer.total_steps=[1,", "trainer.total_steps"),
                                           ("+model.x='open", "model.x"), ("no_equals_sign", "no_equals_sign")])
def test_an_override_hydra_cannot_parse_is_named_with_its_key(override, key, tmp_path, capsys):
    root = tmp_path / "root"
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={root}", override]) == 2
    err = capsys.readouterr().err
    assert f"override {override!r} (key {key}): hydra cannot parse it" in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("args, message", [
    (["fit", "experiment=tiny-cpu", "actor_rollout_ref.actor.optim.lr=1e-6"],
     "actor_rollout_ref.actor.optim.lr is verl's key; here it is algorithm.actor_lr"),
    (["fit", "experiment=tiny-cpu", "data.train_batch_size=8"], "here it is algorithm.train_batch_size"),
    (["fit", "experiment=tiny-cpu", "trainer.logger=[console,wandb]"], "trainer.logger is verl's key; here it is "
                                                                        "logger.mode"),
    (["fit", "experiment=tiny-cpu", "actor_rollout_ref.actor.fsdp_config.param_offload=true"],
     "actor_rollout_ref.actor.fsdp_config.param_offload is verl's key; here it is none"),
    (["fit", "experiment=tiny-cpu", "+reward_model.enable=false"], "reward_model.enable is verl's key"),
    (["fit", "experiment=tiny-cpu", "hydra.run.dir=./x"], "hydra's own settings are not used here"),
    (["fit", "-m", "experiment=tiny-cpu"], "-m/--multirun: sweeps are not run here"),
    (["fit", "--cfg", "hydra", "experiment=tiny-cpu"], "there is no hydra runtime config here"),
])
def test_hydra_and_verl_habits_are_answered_before_anything_is_written(args, message, tmp_path, capsys):
    root = tmp_path / "root"
    assert main(args + [f"paths.root={root}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not root.exists()


def test_every_verl_key_mapped_is_no_key_here_and_points_at_one(tmp_path):
    from atlas_lightning.verl_keys import VERL_KEYS

    schema = OmegaConf.structured(RootConfig)
    assert not [key for key in VERL_KEYS if OmegaConf.select(schema, key, default="<absent>") != "<absent>"]
    single = [ours for ours in VERL_KEYS.values() if " " not in ours]
    assert not [key for key in single if OmegaConf.select(schema, key, default="<absent>") == "<absent>"]


def test_cfg_job_prints_the_config_and_version_is_there(capsys):
    assert main(["fit", "experiment=tiny-cpu", "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("name: tiny-cpu\n") and "\nalgorithm:" in printed and "\nrollout:" in printed
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("atlas-lightning ")
    for library in ("torch", "vllm", "transformers", "peft", "lightning", "flash-linear-attention", "liger-kernel"):
        assert f"\n  {library} " in out, out  # what is installed, as the README's Install says


@pytest.mark.parametrize("overrides, message", [
    (["trainer.accelerator=gpu"], "trainer.accelerator=gpu with trainer.devices=1: this machine has no CUDA GPU"),
    (["experiment=h200-tiny"], "this machine has no CUDA GPU"),
    (["logger.mode=online"], "logger.mode=online but W&B has no API key here: set WANDB_API_KEY or run `wandb login`"),
    (["rollout=vllm_server_cpu", "rollout.server_url=http://127.0.0.1:9"],
     "rollout.server_url=http://127.0.0.1:9: no server answers there"),
])
def test_what_this_machine_cannot_run_is_refused_before_anything_is_written(overrides, message, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    root = tmp_path / "root"
    experiment = [] if any(o.startswith("experiment=") for o in overrides) else ["experiment=tiny-cpu"]
    code = main(["fit", *experiment, *overrides, f"paths.root={root}",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("args, message", [
    (["data", "sample", "--out", "{file}"], "--out {file}: {file} is not a folder"),
    (["data", "sample", "--out", "{file}/below"], "--out {file}/below: {file} is not a folder"),
    (["data", "tiny-model", "--out", "{file}"], "--out {file}: {file} is not a folder"),
    (["data", "demo-model", "--out", "/proc/atlas-model"], "--out /proc/atlas-model: /proc is not writable"),
    (["data", "tiny-orchestrator", "--base", "{tmp}/nope", "--out", "{tmp}/out"], "--base {tmp}/nope: no such folder"),
    (["data", "tiny-orchestrator", "--base", "{tmp}", "--out", "{tmp}/out"], "lacks config.json"),
])
def test_data_verbs_refuse_bad_folders_by_argument(args, message, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    fill = {"file": tmp_path / "afile", "tmp": tmp_path}
    assert main([a.format(**fill) for a in args]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("offline, message", [
    (False, "hub.publish_checkpoints=true but there is no Hub token here: set HF_TOKEN"),
    (True, "hub.publish_checkpoints=true uploads to the Hub, but HF_HUB_OFFLINE=1 (environment) switches it off"),
])
def test_checkpoint_uploads_that_cannot_happen_are_refused_before_anything_is_written(offline, message, tmp_path,
                                                                                    capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once, at import
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", "hub.publish_checkpoints=true", "hub.repo_id=a/b",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("verb, replaced", [("sample", "gpqa/train.parquet"), ("demo-model", "config.json"),
                                           ("demo-model", "model.safetensors")])
def test_a_data_verb_replaces_no_file_of_other_bytes(verb, replaced, tmp_path, capsys):
    """A user's own file where the verb writes one (their questions, their model) is never
    overwritten: refused naming it, the folder as it was; the verb's own output (the same bytes,
    ``make demo`` run again) is replaced freely."""
    out = tmp_path / "out"
    assert main(["data", verb, "--out", str(out)]) == 0
    assert main(["data", verb, "--out", str(out)]) == 0  # again, the same bytes
    (out / replaced).write_bytes(b"the user's own file")
    (out / "theirs.txt").write_text("left alone")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["data", verb, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {out / replaced} exists and holds other bytes than this verb writes" in err, err
    assert "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "nothing left beside it"


def test_a_resume_folder_that_does_not_exist_is_named_so(tmp_path, sample_data_dir, capsys):
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"trainer.resume={tmp_path}/nope/global_step_5",
                 f"data.root={sample_data_dir}",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err
    assert code == 2 and f"trainer.resume={tmp_path}/nope/global_step_5: no such folder" in err, err


@pytest.mark.parametrize("entry", [
    ["+callbacks.weight_sync._target_=atlas_lightning.callbacks.weight_sync.WeightSyncCallback"],
    ["+callbacks.sync._target_=atlas_lightning.callbacks.weight_sync.WeightSyncCallback"],
])
def test_a_config_that_still_lists_the_weight_sync_callback_exits_2(tmp_path, capsys, entry):
    """A config saved while the weight sync was a callback: refused before anything is written,
    saying that the sync is now the step's and the entry goes."""
    root = tmp_path / "root"
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={root}", *entry]) == 2
    err = capsys.readouterr().err
    name = entry[0].split(".")[1]
    assert f"callbacks.{name}: the weight sync is no longer a callback but a stage of the PPO step" in err
    assert f"remove callbacks.{name} from the config" in err
    assert not root.exists()


@pytest.mark.parametrize("override, unmatched", [("model.lora.target_modules=[q_prj]", "q_prj"),
                                                 ("model.lora.target_modules=[q_proj,v_prj]", "v_prj"),
                                                 ("model.critic_lora.target_modules=[o_projj]", "o_projj")])
def test_lora_targets_that_name_no_module_of_the_base_are_refused_before_anything_is_written(
        override, unmatched, tmp_path, capsys):
    model = write_fake_model_folder(tmp_path / "model", tensors=())
    header = json.dumps({f"model.layers.0.self_attn.{m}.weight": {"dtype": "F32", "shape": [2, 1],
                                                                   "data_offsets": [8 * i, 8 * i + 8]}
                          for i, m in enumerate(("q_proj", "k_proj", "v_proj", "o_proj"))}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 32)
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={model}", override])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"target_modules: {unmatched} names no module of the base" in err and "q_proj" in err
    assert not root.exists()


def test_a_base_folder_that_lacks_weights_of_its_architecture_is_refused_before_anything_is_written(
        tiny_model_dir, sample_data_dir, tmp_path, capsys):
    """The whole class: whatever tensor is absent (here one MLP weight, with the index consistent),
    transformers' own mapping of the checkpoint onto the architecture names it."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tensors = load_file(model / "model.safetensors")
    dropped = sorted(name for name in tensors if ".mlp.down_proj." in name)[0]
    del tensors[dropped]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={model}",
                 f"data.root={sample_data_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"its weight files lack 1 tensor(s) the model has ({dropped})" in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("target", ["collections.OrderedDict", "pathlib.PurePosixPath",
                                    "atlas_lightning.config.RootConfig"])
def test_a_callback_target_that_builds_no_lightning_callback_is_refused_before_anything_is_written(target, cfg_of,
                                                                                                  tmp_path):
    """It resolves and builds, so only its type tells: Lightning would fail on its first hook,
    with the run's files written."""
    from atlas_lightning.run.wiring import build_callbacks

    with pytest.raises(ConfigError, match=rf"callbacks.mine._target_={target} built a \w+, not a Lightning callback"):
        build_callbacks(cfg_of(f"+callbacks.mine._target_={target}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, named", [
    ("name=${nope}", "name=${nope}: Interpolation key 'nope' not found"),
    ("paths.logs=${paths.nope}/x", "paths.logs=${paths.nope}/x: Interpolation key 'paths.nope' not found"),
    ("algorithm.betas=[0.9,${nope}]", "algorithm.betas[1]=${nope}: Interpolation key 'nope' not found"),
    ("name=${oc.env:ATLAS_TEST_NO_SUCH_VARIABLE}", "name=${oc.env:ATLAS_TEST_NO_SUCH_VARIABLE}: "),
])
def test_an_interpolation_that_does_not_resolve_is_named_with_its_key(override, named):
    with pytest.raises(ConfigError) as refused:
        compose(["experiment=tiny-cpu", override])
    assert str(refused.value).startswith(named), str(refused.value)


@pytest.mark.parametrize("variable, value, message", [
    ("WANDB_MODE", "garbage", "WANDB_MODE='garbage' (environment): W&B refuses it: Input should be 'online'"),
    ("WANDB_BASE_URL", "notaurl", "WANDB_BASE_URL='notaurl' (environment): W&B refuses it"),
    ("WANDB_RUN_ID", "a/b", "WANDB_RUN_ID='a/b' (environment): W&B refuses it: Run ID cannot contain"),
    ("WANDB_INIT_TIMEOUT", "soon", "WANDB_INIT_TIMEOUT='soon' (environment): W&B refuses it"),
    (None, "logger.project=a/b", "logger.project='a/b': W&B refuses it: Invalid project name"),
    (None, "logger.tags=[" + "x" * 65 + "]", "logger.tags"),
])
@pytest.mark.parametrize("mode", ["auto", "offline"])
def test_what_wandb_would_refuse_at_its_start_is_refused_before_anything_is_written(variable, value, message, mode,
                                                                                   tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if variable:
        monkeypatch.setenv(variable, value)
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"logger.mode={mode}", f"paths.root={root}",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}", *([] if variable else [value])])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("override, message", [
    ("data.root={tmp}/nope", "data.root={tmp}/nope: no such folder"),
    ("data.root={model}/config.json", "data.root={model}/config.json: not a folder"),
    ("data.root={model}", "data.root={model}: no gpqa, lcb folder there"),
    ("model.shape=qwen9", "model.shape='qwen9' is not one of dense8b, qwen3_6_27b"),
    ("layout.mode=separate", "layout.mode=separate with layout.serve_gpus=0: a separate layout serves on cards"),
    ("hub.endpoint=huggingface.co", "hub.endpoint='huggingface.co': must be null or the Hub's http(s):// URL"),
])
def test_keys_that_name_what_the_run_cannot_use_are_refused_by_key_before_anything_is_written(override, message,
                                                                                             tmp_path, capsys):
    model = write_fake_model_folder(tmp_path / "model")
    fill = {"tmp": tmp_path, "model": model}
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={model}", override.format(**fill)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(**fill) in err and "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_starting_adapter_that_is_no_peft_folder_is_named_by_its_key(role, tiny_model_dir, sample_data_dir, tmp_path,
                                                                      capsys):
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={tiny_model_dir}",
                 f"data.root={sample_data_dir}", f"model.{role}_adapter={tiny_model_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"model.{role}_adapter={tiny_model_dir}: no adapter_config.json there" in err and "Traceback" not in err
    assert not root.exists()


def test_a_plan_json_that_cannot_be_written_exits_2_naming_the_folder(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "afile").write_text("x")
    code = main(["plan", "experiment=tiny-cpu", f"paths.root={tmp_path / 'afile'}", "name=run",
                 f"model.path={tiny_model_dir}"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert f"the run's outputs folder {tmp_path / 'afile'}/outputs/run: plan.json cannot be written" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("files, choice, key, where", [
    ({"experiment/mine.yaml": "# @package _global_\ntrainer: {max_step: 3}\n"}, "experiment=mine",
     "trainer.max_step", "In 'experiment/mine'"),
    ({"experiment/mine.yaml": "# @package _global_\nmodel:\n  lora: {rnak: 3}\n"}, "experiment=mine",
     "model.lora.rnak", "In 'experiment/mine'"),
    # a user experiment on top of a packaged one: the bad key is still named in full
    ({"experiment/mine.yaml": "# @package _global_\ndefaults:\n  - tiny-cpu\nrollout: {max_explore: 2}\n"},
     "experiment=mine", "rollout.max_explore", "In 'experiment/mine'"),
    ({"model/mine.yaml": "lora: {rnak: 3}\n"}, "model=mine", "model.lora.rnak", "In 'model/mine'"),
    ({"rollout/mine.yaml": "max_explore: 2\n"}, "rollout=mine", "rollout.max_explore", "In 'rollout/mine'"),
])
def test_a_bad_key_in_a_config_file_is_named_by_its_full_key(tmp_path, capsys, files, choice, key, where):
    """A key the schema lacks, inside an experiment or group file of ``--config-dir`` (hydra
    composes it and raises its own error, OmegaConf's as its context): the message names the
    full dotted key and the file; exit 2, one line, nothing written."""
    for name, text in files.items():
        (tmp_path / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / name).write_text(text)
    root = tmp_path / "root"
    assert main(["fit", choice, f"paths.root={root}", "--config-dir", str(tmp_path / "conf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config error: {key}: " in err[0] and where in err[0], err
    assert "Traceback" not in err[0] and not root.exists()


@pytest.mark.parametrize("overrides, refused", [
    (["model.dtype=bfloat16"], "model.dtype=bfloat16 with rollout.max_logprob_gap=0.05"),
    (["~model"], "model.dtype=bfloat16 with rollout.max_logprob_gap=0.05"),  # the schema's default dtype
    (["model.dtype=bfloat16", "rollout.max_logprob_gap=0.1"], "model.dtype=bfloat16 with rollout.max_logprob_gap=0.1"),
    (["model.dtype=float16", "rollout.max_logprob_gap=0.01"], "model.dtype=float16 with rollout.max_logprob_gap=0.01"),
    (["model.dtype=float32", "rollout.max_logprob_gap=1e-6"], "model.dtype=float32 with rollout.max_logprob_gap=1e-06"),
    (["model.dtype=bfloat16", "rollout.max_logprob_gap=0.3"], None),  # the GPU configs' bf16 runs
    (["model.dtype=float16", "rollout.max_logprob_gap=0.05"], None),
    (["model.dtype=float32"], None),
])
def test_a_max_logprob_gap_below_the_dtypes_rounding_exits_2_before_anything_is_written(tmp_path, capsys, overrides,
                                                                                        refused):
    """The weight sync's ceiling on the probe gap must admit what the model's dtype rounding
    alone makes a clean engine show (16 eps: 0.125 in bf16); below it every engine would be
    refused at some sync after the run wrote its files, so the launch is refused at once."""
    root = tmp_path / "root"
    if refused is None:
        compose(["experiment=tiny-cpu", f"paths.root={root}", *overrides])
        return
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={root}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config error: {refused}: " in err[0], err
    assert "use model.dtype=float32" in err[0] and "rollout.max_logprob_gap to " in err[0]
    assert not root.exists()


def test_a_damaged_history_of_the_run_id_it_continues_exits_2_before_anything_is_written(tmp_path, capsys,
                                                                                       monkeypatch):
    """``WANDB_RUN_ID`` names an id whose export exists: the run would read its ``history.csv``
    back and rewrite it at the first logged metric, after the run's config and logs are written,
    losing the rows it could not read. Refused at the start instead, naming the file and line."""
    root = tmp_path / "root"
    history = root / "runs" / "run" / "abc123" / "history.csv"
    history.parent.mkdir(parents=True)
    history.write_text("_step,_runtime,_timestamp,reward/mean\n1,0.1,1.0,0.5\n2,0.2,2.0,0.x\n")
    monkeypatch.setenv("WANDB_RUN_ID", "abc123")
    before = sorted(p for p in root.rglob("*"))
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", "name=run", "logger.mode=disabled",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{history}, line 3: unreadable" in err and "Traceback" not in err
    assert sorted(p for p in root.rglob("*")) == before and history.read_text().endswith("0.x\n")


def test_a_tokenizer_config_without_its_vocabulary_is_named_with_the_files_there(tiny_model_dir, sample_data_dir,
                                                                                  tmp_path, capsys):
    """``tokenizer_config.json`` left, ``tokenizer.json`` gone: transformers' refusal spans lines
    (the first alone ends in "one of: "); the refusal names the tokenizer files the folder holds
    and transformers' reasons in one line, before anything is written."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    assert (model / "tokenizer_config.json").is_file()
    root = tmp_path / "root"
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"model.path={model}",
                 f"data.root={sample_data_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"model.path={model}: its tokenizer cannot be loaded from tokenizer_config.json (" in err
    assert "(1) a `tokenizers` library serialization file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not root.exists()
