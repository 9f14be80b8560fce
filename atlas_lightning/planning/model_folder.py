"""The one check of ``model.path`` every verb makes before any work (``fit``, ``validate``,
``memory-check``, ``plan``, pre-flight): a local Hugging Face model folder, read without
loading anything. It lives here, low in the house, because ``plan`` reads the same folder's
``config.json`` (``shapes.py``) and every floor above may call it.

It must be a folder holding a ``config.json`` (a JSON object naming its ``model_type``) and,
for the verbs that load the model, a tokenizer (``tokenizer.json``, ``tokenizer_config.json`` or ``tokenizer.model``), weight
files (``*.safetensors``, each with a readable header and floating-point tensors, or ``*.bin``), and every other ``*.json``
beside them (tokenizer, generation config) a readable JSON object: the loaders read them all.
A ``tokenizer.json`` must load as a tokenizer (valid JSON that is no tokenizer fails late, in the
engine, otherwise). The weight files must supply the weights whole, as both loaders read them:
with a shard index (``*.safetensors.index.json``), every shard it names is present, every
``*.safetensors`` file in the folder is one of them (transformers reads only the shards the
index names, so a shard it leaves out would leave those base tensors at their random
initialisation), and the tensors the index maps to each shard are exactly the tensors in that
shard's header; without an index, one ``*.safetensors`` file (several, unindexed, are read by
one loader and not the other). Anything else is a
``ConfigError`` naming ``model.path`` and what is missing, so the CLI exits 2 before a config,
a log or a model is written or loaded. Nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from atlas_lightning.config import ConfigError
from atlas_lightning.errors import quoted
from atlas_lightning.store.files import read_json_object

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: A safetensors header larger than this is not one (the 27B's is about 100 KB).
_MAX_HEADER_BYTES = 100 * 2**20
#: safetensors dtypes that cannot be a weight of the base (every weight is floating point).
_INTEGRAL_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
                              # 8-bit and smaller floats: quantized weights, meaningless without their scales
                              "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"})


def check_model_folder(path: str | Path, key: str = "model.path", *, loads: bool = True) -> dict:
    """The folder's ``config.json`` as a dict, once the folder passes the module's checks;
    ``ConfigError`` naming ``key``, the folder and the file otherwise. ``loads=False`` (``plan``,
    which reads the shape alone and may run before the weights are fetched) checks the folder
    and its ``config.json`` only."""
    folder = Path(str(path)).expanduser()
    where = f"{key}={path}"
    if not folder.exists():
        raise ConfigError(f"{where}: no such folder (a local Hugging Face model folder is needed; "
                          f"nothing is downloaded at run time)")
    if not folder.is_dir():
        raise ConfigError(f"{where}: not a folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{where}: no config.json there (not a Hugging Face model folder)")
    config = read_json_object(config_file, ConfigError, where)
    if not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{where}: {config_file.name} is not a model config (no model_type)")
    if not loads:
        return config
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where}: no tokenizer ({', '.join(TOKENIZER_FILES)})")
    others = {file.name: read_json_object(file, ConfigError, where)
              for file in sorted(folder.glob("*.json")) if file != config_file}
    if (folder / "tokenizer.json").is_file():
        _check_tokenizer(folder / "tokenizer.json", where)
    weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not weights:
        raise ConfigError(f"{where}: no weight files (*.safetensors or *.bin)")
    headers = {file.name: _check_safetensors_header(file, where) for file in weights if file.suffix == ".safetensors"}
    indexes = {name: index for name, index in others.items() if name.endswith(".index.json")}
    for name, index in indexes.items():
        _check_index(name, index, [file.name for file in weights], headers, where)
    if headers and not any(name.endswith(".safetensors.index.json") for name in indexes) and len(headers) > 1:
        raise ConfigError(f"{where}: {len(headers)} *.safetensors files and no model.safetensors.index.json "
                          f"saying which tensors each holds ({', '.join(sorted(headers)[:5])})")
    return config


def _check_index(name: str, index: dict, files: list[str], headers: dict[str, set[str]], where: str) -> None:
    """The shard index ``name`` accounts for the weight files exactly (module doc)."""
    shards = index.get("weight_map")
    if not isinstance(shards, dict) or not shards:
        raise ConfigError(f"{where}: {name} has no weight_map object")
    named = {str(shard) for shard in shards.values()}
    missing = sorted(named - set(files))
    if missing:
        raise ConfigError(f"{where}: {name} names shard(s) not in the folder: {', '.join(missing[:5])}")
    if not name.endswith(".safetensors.index.json"):
        return
    left_out = sorted(set(headers) - named)
    if left_out:
        raise ConfigError(f"{where}: {name} leaves out weight file(s) {', '.join(left_out[:5])}: their tensors "
                          f"would not be loaded (the base would keep random weights there)")
    for shard in sorted(named):
        mapped = {str(tensor) for tensor, file in shards.items() if file == shard}
        held = headers.get(shard, set())
        if mapped != held:
            unmapped, absent = sorted(held - mapped), sorted(mapped - held)
            what = "; ".join(part for part in (
                f"holds {len(unmapped)} tensor(s) the index does not map to it ({', '.join(unmapped[:3])})"
                if unmapped else "",
                f"lacks {len(absent)} tensor(s) the index maps to it ({', '.join(absent[:3])})" if absent else "")
                if part)
            raise ConfigError(f"{where}: {shard} does not match {name}: it {what}")


def _check_tokenizer(file: Path, where: str) -> None:
    """``tokenizer.json`` loads as a tokenizer (the ``tokenizers`` library, as both loaders read it)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(file))
    except Exception as err:  # the library's parse error, whatever its type: named for the user
        raise ConfigError(f"{where}: {file.name} is not a tokenizer the tokenizers library can load "
                          f"({str(err).splitlines()[0][:200] if str(err) else type(err).__name__})") from None


def linear_module_names(path: str | Path) -> set[str]:
    """The modules of the folder's weights that hold a 2-D ``weight`` (the linear layers LoRA can
    target, and embeddings), read from the safetensors headers alone (``check_model_folder``
    first: this assumes readable headers)."""
    names: set[str] = set()
    for file in sorted(Path(str(path)).expanduser().glob("*.safetensors")):
        with open(file, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        names.update(name[: -len(".weight")] for name, entry in header.items()
                     if name.endswith(".weight") and isinstance(entry, dict) and len(entry.get("shape", ())) == 2)
    return names


def unmatched_lora_targets(targets, modules: set[str]) -> list[str]:
    """The entries of a LoRA ``target_modules`` list that name none of ``modules``, as peft
    matches them: a module named so or ending in ``.<entry>``; ``all-linear`` (or none) matches
    always (the config's rules allow nothing else)."""
    if targets is None or targets == "all-linear":
        return []
    return [str(t) for t in targets if not any(name == t or name.endswith(f".{t}") for name in modules)]


def _check_safetensors_header(file: Path, where: str) -> set[str]:
    """The names of the tensors in ``file``'s header, once the header parses and every tensor's
    data lies inside the file (a truncated copy fails)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= min(_MAX_HEADER_BYTES, max(size - 8, 0)):
                raise ValueError(f"header length {length} in a file of {size} bytes")
            header = json.loads(handle.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: {file.name} is not a readable safetensors file ({quoted(str(err))})") from None
    end = max((entry["data_offsets"][1] for name, entry in header.items()
               if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry), default=0)
    if 8 + length + end > size:
        raise ConfigError(f"{where}: {file.name} is truncated ({size} bytes, its header needs {8 + length + end})")
    integral = sorted(name for name, entry in header.items()
                      if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in _INTEGRAL_DTYPES)
    if integral:
        # transformers would cast them to the model's dtype without a word: integers as weights
        shown = ", ".join(f"{name}: {header[name]['dtype']}" for name in integral[:3])
        raise ConfigError(f"{where}: {file.name} holds {len(integral)} tensor(s) of integer or boolean type "
                          f"({shown}): a weight of the base is floating point (quantized checkpoints are not "
                          f"read here)")
    return {name for name in header if name != "__metadata__"}
