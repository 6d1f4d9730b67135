"""The package's shape: imports flow one way along the data path, and importing changes nothing elsewhere."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tq_mlx"

# The data path, bottom to top. A module may import only modules of a lower rank (function-level imports
# included); codebook, rotation and packing are independent leaves.
RANKS = {
    "codebook": 0, "rotation": 0, "packing": 0,
    "blas": 0,  # OpenBLAS for the commands on Linux: imports nothing of the package
    "architectures": 0,  # which fetch each mlx-lm model_type takes: a table, imports nothing
    "rope": 0,  # a layer's RoPE as pairs and frequencies (keys centered before RoPE)
    "quantizer": 1,
    "config": 2,
    "stream": 3,
    "attention": 4,
    "kernels": 5,
    "batch": 6,
    "cache": 7,
    "memory": 8,
    "integration": 9,
    "cli": 10,
    "__init__": 11,
}


def _package_imports(path: Path) -> set[str]:
    """tq_mlx modules a source file imports, wherever the import statement sits."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                out.update([node.module] if node.module else [a.name for a in node.names])
            elif node.module and node.module.split(".")[0] == "tq_mlx":
                parts = node.module.split(".")
                out.update(parts[1:2] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("tq_mlx."))
    return {m.split(".")[0] for m in out}


def test_every_module_has_a_rank():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(RANKS), f"give new modules a place on the data path: {sorted(modules ^ set(RANKS))}"


@pytest.mark.parametrize("module", sorted(RANKS))
def test_imports_flow_down_the_data_path(module):
    imported = _package_imports(PACKAGE / f"{module}.py")
    upward = sorted(m for m in imported if RANKS.get(m, 99) >= RANKS[module])
    assert not upward, f"tq_mlx/{module}.py imports {upward}, which sit at or above it on the data path"


def test_the_import_checker_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .cache import X\n    import tq_mlx.cli\n    from tq_mlx import integration\n")
    assert _package_imports(src) == {"cache", "cli", "integration"}


_SNAPSHOT = r"""
import importlib, json, pkgutil, sys
import mlx_lm, mlx_lm.models
names = ["mlx_lm.models.base", "mlx_lm.models.cache", "mlx_lm.generate", "mlx_lm.utils", "mlx_lm.server",
         "mlx_lm.sample_utils", *(f"mlx_lm.models.{m.name}" for m in pkgutil.iter_modules(mlx_lm.models.__path__))]
mods = {}
for n in names:
    try:
        mods[n] = importlib.import_module(n)
    except BaseException:  # some model modules exit when an optional package is missing
        pass
def snap():
    return {n: {k: id(v) for k, v in vars(m).items()} for n, m in mods.items()}
before = snap()
import tq_mlx, tq_mlx.cli, tq_mlx.kernels, tq_mlx.memory, tq_mlx.integration
after = snap()
changed = sorted(f"{n}.{k}" for n in before for k in set(before[n]) | set(after[n])
                 if before[n].get(k) != after[n].get(k))
from tq_mlx.cache import TurboQuantKVCache, hook_installed, uninstall_attention_hook
cache = TurboQuantKVCache()
installed = hook_installed() and getattr(mlx_lm.models.cache, "TurboQuantKVCache", None) is TurboQuantKVCache
uninstall_attention_hook()
restored = sorted(f"{n}.{k}" for n in before for k in set(before[n]) | set(snap()[n])
                  if before[n].get(k) != snap()[n].get(k))
print(json.dumps({"changed": changed, "installed": installed, "after_uninstall": restored,
                  "modules": len(mods)}))
"""


def test_import_changes_nothing_and_the_hook_installs_on_use_and_uninstalls():
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["modules"] > 50  # every mlx-lm model module was watched, not just a few
    assert r["changed"] == [], f"importing tq_mlx changed mlx-lm: {r['changed']}"
    assert r["installed"], "building a TurboQuantKVCache did not install the attention hook"
    assert r["after_uninstall"] == [], f"uninstall left mlx-lm changed: {r['after_uninstall']}"
