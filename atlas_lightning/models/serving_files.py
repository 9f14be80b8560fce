"""What both loaders read from ``model.path`` besides the weights, checked before any work.

The weights are checked against the architecture elsewhere (``build.check_base_weights``). The
files around them parse whatever they say, so a file that lies passes until the engine starts, or
never fails at all:

* ``config.json``'s ``architectures``: vLLM picks its model class by this name, transformers by
  ``model_type``. It must name a transformers class of this ``model_type`` that generates text
  (``...ForCausalLM`` or ``...ForConditionalGeneration``): a Llama, a sequence classifier or an
  unknown name would make the engine build another model than the trainer, or fail once started.
* the tokenizer's ids: every id it can produce (``get_vocab``, added tokens included) is below
  the text config's ``vocab_size``; the engine refuses a prompt holding one, and the trainer's
  embedding lookup fails on it.
* the stop ids: the tokenizer's EOS, ``config.json``'s and ``generation_config.json``'s
  ``eos_token_id`` (vLLM adds the latter to every request's stop ids, the transformers engine
  does not) are each an id of the vocabulary and, where ``tokenizer.json`` lists its added
  tokens, a special one: an EOS set to a word would end every turn at that word, silently.
* ``generation_config.json`` loads as transformers' ``GenerationConfig`` (both loaders read it).
* ``rollout.max_model_len`` fits the positions the folder allows (``max_position_embeddings``,
  times a rope scaling factor): vLLM refuses a longer one once it starts. The tokenizer's
  ``model_max_length`` is not a limit: vLLM reads it for pooling models only, and transformers
  only warns past it (the benchmarks' folders carry the tiny tokenizer's 4,096).

``ServingFilesError`` naming ``model.path``, the file and the field (the CLI exits 2).

Who calls it: ``run/facts.check_inputs`` (fit, validate, memory-check) and the pre-flight's model check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from atlas_lightning.errors import InputError, first_line


class ServingFilesError(InputError):
    """A file of the base folder that parses but is not what the loaders need; names file and field."""

#: The endings of a transformers class that generates text (the causal LM, or an image-text model around one).
GENERATING_CLASSES = ("ForCausalLM", "ForConditionalGeneration")


def check_serving_files(path: str | Path, config: Any, max_model_len: Optional[int] = None) -> None:
    """``path``'s ``config.json``, tokenizer and ``generation_config.json`` against each other and
    ``config`` (``build.check_base_config``'s text config), as the module doc lists."""
    from transformers import AutoTokenizer

    where = f"model.path={path}"
    raw = json.loads((Path(path) / "config.json").read_text())
    _check_architectures(raw, where)
    vocab = int(config.vocab_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # the library's error for a damaged tokenizer, whatever its type
        raise ServingFilesError(f"{where}: its tokenizer cannot be loaded ({first_line(err)})") from None
    ids = {**tokenizer.get_vocab(), **_added_tokens(Path(path))}
    if ids and max(ids.values()) >= vocab:
        token, top = max(ids.items(), key=lambda item: item[1])
        raise ServingFilesError(f"{where}: the tokenizer has token id {top} ({token!r}), config.json's vocab_size is {vocab}: "
                          f"the tokenizer and the weights are of different models")
    special = _special_ids(Path(path))
    _check_stop_ids(f"{where}: tokenizer's eos_token {tokenizer.eos_token!r}", tokenizer.eos_token_id, vocab, special)
    _check_stop_ids(f"{where}: config.json's eos_token_id", raw.get("eos_token_id"), vocab, special)
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        try:
            GenerationConfig.from_pretrained(str(path))
        except Exception as err:  # transformers' validation error, whatever its type
            raise ServingFilesError(f"{where}: generation_config.json is not a generation config transformers can "
                              f"read ({first_line(err)})") from None
        stops = json.loads(generation.read_text()).get("eos_token_id")
        _check_stop_ids(f"{where}: generation_config.json's eos_token_id", stops, vocab, special)
    if max_model_len is not None:
        _check_length(config, int(max_model_len), where)


def _check_architectures(raw: dict, where: str) -> None:
    import transformers

    names = raw.get("architectures")
    model_type = raw.get("model_type")
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise ServingFilesError(f"{where}: config.json's architectures={names!r} is not a list of class names (vLLM "
                          f"picks the model it serves by it)")
    for name in names:
        found = getattr(transformers, name, None)
        theirs = getattr(getattr(found, "config_class", None), "model_type", None)
        if found is None or theirs != model_type or not name.endswith(GENERATING_CLASSES):
            why = ("is no transformers model class" if found is None else
                   f"is a {theirs} model, config.json's model_type is {model_type!r}" if theirs != model_type else
                   "does not generate text")
            raise ServingFilesError(f"{where}: config.json's architectures names {name}, which {why}: the engine would "
                              f"build another model than the trainer (a {model_type} ...{GENERATING_CLASSES[0]} "
                              f"or ...{GENERATING_CLASSES[1]} is needed)")


def _added_entries(folder: Path) -> Optional[list[dict]]:
    """``tokenizer.json``'s ``added_tokens`` (None without a ``tokenizer.json``)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    added = json.loads(file.read_text()).get("added_tokens") or []
    return [entry for entry in added if isinstance(entry, dict) and isinstance(entry.get("id"), int)]


def _added_tokens(folder: Path) -> dict[str, int]:
    """``tokenizer.json``'s added tokens as ``{content: id}`` (the library may renumber them on load)."""
    return {str(entry.get("content")): entry["id"] for entry in _added_entries(folder) or []}


def _special_ids(folder: Path) -> Optional[set[int]]:
    """The ids of ``tokenizer.json``'s special added tokens (None without a ``tokenizer.json``)."""
    entries = _added_entries(folder)
    return None if entries is None else {entry["id"] for entry in entries if entry.get("special")}


def _check_stop_ids(what: str, value: Any, vocab: int, special: Optional[set[int]]) -> None:
    """``value`` (an id, a list of ids, or None) names special tokens of the vocabulary."""
    if value is None:
        return
    for token in value if isinstance(value, list) else [value]:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise ServingFilesError(f"{what} holds {token!r}, not a token id of the vocabulary (0 to {vocab - 1})")
        if special is not None and token not in special:
            raise ServingFilesError(f"{what} holds {token}, which is not a special token of tokenizer.json: every turn "
                              f"would end where the model writes that token")


def _check_length(config: Any, max_model_len: int, where: str) -> None:
    """``max_model_len`` within ``max_position_embeddings`` (times a rope scaling ``factor``, as
    vLLM derives it for a generating model)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) and rope.get("rope_type") not in (None, "default") else None
    limit = int(positions * (factor or 1))
    if max_model_len > limit:
        named = f"config.json's max_position_embeddings={positions}" + (f" x rope factor {factor}" if factor else "")
        raise ServingFilesError(f"rollout.max_model_len={max_model_len}: {where} allows {limit} positions ({named}); "
                                f"the engine refuses a longer context: lower rollout.max_model_len")
