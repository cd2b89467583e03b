"""Every folder imports only the layers below it (docs/design.md, "Layout"):

    models    ->  nothing of recc
    kernels   ->  nothing of recc outside recc.kernels, and never torch.fx
    passes    ->  recc's core and recc.passes
    runtime   ->  recc's core, recc.runtime and recc.kernels
    recc core ->  itself (recc.clusters, the shipped cluster files, included); recc.passes only
                  from recc/compiler.py, to build the default pipeline
    app       ->  everything (the top layer: the CLI and the training harness)

``recc/__init__.py`` is the public face that assembles the layers (it imports the runtime so
``program.instantiate()`` works after ``import recc``) and is the one file exempt. Every
``import`` and ``from ... import`` counts, including those inside functions, relative ones
resolved against the file's package, and ``importlib.import_module("...")`` with a literal name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Folder -> the package it installs as (pyproject's [tool.setuptools.package-dir]).
PACKAGES = {"recc": "recc", "app": "recc.app", "passes": "recc.passes", "runtime": "recc.runtime",
            "kernels": "recc.kernels", "models": "recc.models", "clusters": "recc.clusters"}
# Sub-packages of recc that are layers of their own; any other recc.* name is the core.
LAYERS = {"recc.app": "app", "recc.passes": "passes", "recc.runtime": "runtime", "recc.kernels": "kernels",
          "recc.models": "models"}
ALLOWED = {"core": {"core"}, "passes": {"core", "passes"}, "runtime": {"core", "runtime", "kernels"},
           "kernels": {"kernels"}, "models": {"models"},
           "app": {"core", "app", "passes", "runtime", "kernels", "models"}}
# Outside recc: what kernels compute with is tensors, never graphs.
FORBIDDEN_OUTSIDE = {"kernels": ("torch.fx",)}
FACE = "recc/__init__.py"
PIPELINE_BUILDER = "recc/compiler.py"  # the one core file that may import recc.passes


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to; None for a module outside recc."""
    if module != "recc" and not module.startswith("recc."):
        return None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def module_name(rel: str) -> str:
    """``passes/lower.py`` -> ``recc.passes.lower``; ``app/__init__.py`` -> ``recc.app``."""
    folder, *rest = Path(rel).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool):
    """(line, imported module name) for every import in ``source``, at any depth. ``from a import
    b`` yields ``a.b`` (b may be a submodule: ``from recc import runtime``) -- its layer is the
    one ``a.b`` falls in, so ``from recc import compile`` stays the core."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == FACE:
                continue
            mine = layer_of(module_name(rel))
            for line, name in imports(path.read_text(), module_name(rel), path.name == "__init__.py"):
                theirs = layer_of(name)
                if theirs is None:
                    for bad in FORBIDDEN_OUTSIDE.get(mine, ()):
                        if name == bad or name.startswith(bad + "."):
                            found.append(f"{rel}:{line}: imports {name}; {mine} never imports {bad} "
                                         f"(docs/design.md, Layout)")
                    continue
                if theirs in ALLOWED[mine]:
                    continue
                if mine == "core" and theirs == "passes" and rel == PIPELINE_BUILDER:
                    continue
                found.append(f"{rel}:{line}: imports {name} ({theirs}); {mine} may import only "
                             f"{', '.join(sorted(ALLOWED[mine]))} (docs/design.md, Layout)")
    return found


def test_every_folder_imports_only_the_layers_below_it():
    found = violations()
    assert not found, "imports that cross the layering:\n" + "\n".join(found)


def test_the_walk_sees_imports_in_functions_relative_and_by_name():
    source = ("import torch\n"
              "def f():\n"
              "    from recc.runtime import instantiate\n"
              "    from . import lower\n"
              "    from .. import models\n"
              "    import importlib; importlib.import_module('recc.app.cli')\n")
    got = list(imports(source, "recc.passes.x", False))
    assert got == [(1, "torch"), (3, "recc.runtime.instantiate"), (4, "recc.passes.lower"), (5, "recc.models"),
                   (6, "importlib"), (6, "recc.app.cli")]
    assert [layer_of(n) for _, n in got] == [None, "runtime", "passes", "models", None, "app"]
    assert layer_of("recc") == layer_of("recc.ir") == layer_of("recc.clusters") == "core"


@pytest.mark.parametrize("rel, source, message", [
    ("recc/tables.py", "def f():\n    import recc.runtime\n", "recc/tables.py:2: imports recc.runtime (runtime)"),
    ("kernels/codecs.py", "from recc.ops import OPS\n", "kernels/codecs.py:1: imports recc.ops.OPS (core)"),
    ("passes/lower.py", "from recc.kernels import codecs\n", "passes/lower.py:1: imports recc.kernels.codecs (kernels)"),
    ("recc/passmanager.py", "from recc.passes import lower\n", "recc/passmanager.py:1: imports recc.passes.lower"),
    ("kernels/cpu/tbe.py", "from torch import fx\n", "kernels/cpu/tbe.py:1: imports torch.fx; kernels never"),
    ("models/dlrm.py", "import recc\n", "models/dlrm.py:1: imports recc (core)"),
    ("runtime/model.py", "from recc.app import training\n", "runtime/model.py:1: imports recc.app.training (app)"),
])
def test_a_crossing_is_named_by_file_line_and_import(tmp_path, rel, source, message):
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(message), found


def test_the_face_and_the_pipeline_builder_are_the_exceptions(tmp_path):
    for rel, source in [(FACE, "import recc.runtime\n"), (PIPELINE_BUILDER, "from recc.passes import lower\n"),
                        ("app/cli.py", "import recc.runtime, recc.models, recc.passes\n")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    assert violations(tmp_path) == []
