"""Pointers in the code's prose resolve: every ``path/to/file.py`` a docstring or comment names
exists, and every README section named in quotes (``README, "On-disk layout"``) is a heading
of that README.

Scanned: the docstrings and comments of the Python files of ``atlas_lightning/`` and
``callbacks/``, the comments of ``conf/``'s YAML and of the launch scripts (code and its string
values are not prose: a path the code builds is the code's business). A file path resolves from the repository root, from the package
(``models/build.py`` is ``atlas_lightning/models/build.py``; ``atlas_lightning/callbacks/`` and
``atlas_lightning/conf/`` are the top-level folders they install from), from the naming file's
folder or from the folder above it. Files of other projects are named as theirs (``verl/...``,
or in ``EXTERNAL``). A section name resolves when it is a heading, or a heading's start followed
by ``:`` or `` (`` (``"Scale"`` for "Scale: plan, memory-check, pre-flight, launchers").
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "atlas_lightning"
#: Where the pointers are read (folder, file pattern).
SCANNED = (("atlas_lightning", "*.py"), ("callbacks", "*.py"), ("conf", "*.yaml"), ("launch", "*.sh"),
           ("launch", "*.sbatch"))
#: Files of other projects named in the prose: verl's, transformers', huggingface_hub's.
EXTERNAL = {"core_algos.py", "torch_functional.py", "conversion_mapping.py", "utils/_runtime.py"}
#: Where ``atlas_lightning.<folder>`` installs from (pyproject's package-dir).
INSTALLED_FROM = {"atlas_lightning/callbacks/": "callbacks/", "atlas_lightning/conf/": "conf/"}

_FILE = re.compile(r"(?<![\w./<>{}*-])((?:[\w.-]+/)*[\w-]+\.py)\b")
_SECTION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*)README(?:\.md)?(?:,|'s)?[\s#]+\"([^\"\n]+)\"")


def _scanned_files() -> list[Path]:
    return sorted(path for folder, pattern in SCANNED for path in (ROOT / folder).rglob(pattern))


def _prose(path: Path) -> str:
    """The file's docstrings and comments, everything else blanked (lines keep their numbers)."""
    text = path.read_text(encoding="utf-8")
    lines = [[" " * len(line)] for line in text.splitlines()]
    if path.suffix != ".py":
        for number, line in enumerate(text.splitlines()):
            if "#" in line:
                lines[number] = [" " * line.index("#"), line[line.index("#"):]]
        return "\n".join("".join(parts) for parts in lines)
    kept, previous = [], tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        statement_string = token.type == tokenize.STRING and previous in (
            tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)
        if token.type == tokenize.COMMENT or statement_string:
            kept.append(token)
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    for token in kept:  # written back at its own line, so a pointer's line number is the file's
        row = token.start[0] - 1
        for offset, part in enumerate(token.string.split("\n")):
            lines[row + offset].append(" " + part)
    return "\n".join("".join(parts) for parts in lines)


def _where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"


def _file_resolves(ref: str, source: Path) -> bool:
    if ref.startswith("verl/") or ref in EXTERNAL:
        return True
    for prefix, folder in INSTALLED_FROM.items():
        if ref.startswith(prefix):
            ref = folder + ref[len(prefix):]
    return any((base / ref).is_file() for base in (ROOT, PACKAGE, source.parent, source.parent.parent))


def _headings(readme: Path) -> list[str]:
    """The Markdown headings of ``readme``, code blocks left out."""
    headings, fenced = [], False
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            headings.append(line.lstrip("#").strip())
    return headings


def _section_resolves(name: str, headings: list[str]) -> bool:
    return any(h == name or h.startswith((f"{name}:", f"{name} (")) for h in headings)


def test_named_files_exist():
    missing = []
    for path in _scanned_files():
        text = _prose(path)
        for match in _FILE.finditer(text):
            if not _file_resolves(match.group(1), path):
                missing.append(f"{_where(path, text, match.start())}: {match.group(1)}")
    assert not missing, "named files that do not exist:\n" + "\n".join(missing)


def test_named_readme_sections_exist():
    missing, seen = [], 0
    for path in _scanned_files():
        text = _prose(path)
        for match in _SECTION.finditer(text):
            seen += 1
            readme = ROOT / match.group(1) / "README.md"
            if not readme.is_file():
                missing.append(f"{_where(path, text, match.start())}: no {readme.relative_to(ROOT)}")
            elif not _section_resolves(match.group(2), _headings(readme)):
                missing.append(f"{_where(path, text, match.start())}: {readme.relative_to(ROOT)} has no "
                               f"section \"{match.group(2)}\"")
    assert seen > 20  # the pattern still finds the pointers
    assert not missing, "README sections that do not exist:\n" + "\n".join(missing)


def test_the_resolution_rules_refuse_what_is_not_there():
    source = PACKAGE / "algorithms" / "ppo.py"
    assert _file_resolves("ppo/module.py", source) and _file_resolves("kl.py", source)
    assert not _file_resolves("module.py", source) and not _file_resolves("rollout/gloo_transfer.py", source)
    headings = ["Scale: plan, memory-check", "PPO (verl 0.9's semantics)", "The reward"]
    assert _section_resolves("Scale", headings) and _section_resolves("PPO", headings)
    assert not _section_resolves("Does it learn?", headings) and not _section_resolves("The", headings)
