"""``atlas-lightning bench [NAME]``: every benchmark of the package is reachable by name, each says
its command, an unknown name is refused before anything runs, and the pure-Python ones start
without torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_lightning import cli
from atlas_lightning.bench import verb

BENCH = Path(verb.__file__).parent


def test_help_lists_every_benchmark(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in verb.BENCHMARKS:
        assert f"\n  {name} " in out


def test_unknown_benchmark_is_refused_with_exit_2(capsys):
    assert cli.main(["bench", "nope", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "update-suite" in err


@pytest.mark.parametrize("name", sorted(verb.BENCHMARKS))
def test_each_benchmark_takes_help_and_states_its_command(name, capsys):
    module = importlib.import_module(f"atlas_lightning.bench.{verb.BENCHMARKS[name][0]}")
    assert "atlas-lightning bench" in module.__doc__ or f"python -m {module.__name__}" in module.__doc__
    with pytest.raises(SystemExit) as exit_:
        verb.main([name, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_module_says_what_it_is():
    """One home, readable: each module of the package opens with a docstring (``__main__`` aside)."""
    for path in sorted(BENCH.glob("*.py")):
        if path.name != "__main__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), path.name


def test_no_name_runs_the_update_benchmark(monkeypatch):
    calls = []
    monkeypatch.setattr("atlas_lightning.bench.update_bench.main", lambda argv: calls.append(argv) or 0)
    assert verb.main(["--tiny", "--models", "tiny"]) == 0
    assert verb.main(["update", "--tiny"]) == 0
    assert calls == [["--tiny", "--models", "tiny"], ["--tiny"]]


@pytest.mark.parametrize("name", ["learning", "projection"])
def test_pure_python_benchmarks_start_without_torch(name):
    code = (f"import sys\nfrom atlas_lightning.bench.verb import main\ntry:\n    main([{name!r}, '--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", sorted({module for module, _ in verb.BENCHMARKS.values()}))
def test_every_benchmark_module_runs_alone(module):
    """``python -m atlas_lightning.bench.<module>`` (the verb's module doc, the card scripts) runs its
    ``main``: the module ends in an ``if __name__ == "__main__"`` block that calls it."""
    tree = ast.parse((BENCH / f"{module}.py").read_text())
    guards = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    assert guards and "main(" in ast.unparse(guards[-1]), f"{module}.py: no __main__ block calling main"
