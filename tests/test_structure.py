"""The package's shape: imports flow one way along the data path, and importing changes nothing elsewhere."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tq_mlx"

# The data path, bottom to top: the package's layers, each a sub-package or a module of its own, and in each
# sub-package its modules' ranks. A module may import a module of a lower layer, or of its own sub-package at a
# lower rank (function-level imports included); layers of one number, and modules of one rank, do not import each
# other. A sub-package's __init__ only re-exports (the highest rank in it). Module names are dotted from tq_mlx.
LAYERS = {
    "quant": (0, {"codebook": 0, "rotation": 0, "packing": 0, "trellis": 0, "quantizer": 1}),  # Algorithms 1 and 2
    # what a model's layers are (configs read, which fetch each model_type takes, RoPE), and the demo model
    "models": (0, {"architectures": 0, "rope": 0, "gguf_convert": 0, "demo": 1}),
    "blas": (0, None),  # OpenBLAS for the commands on Linux: imports nothing of the package
    "config": (1, None),
    "layout": (2, None),  # what a config holds at N tokens, and its bytes: arithmetic only
    "plan": (3, None),  # one plan per layer: what each stream holds and does, and its bytes (cache and planner read it)
    # one compressed stream per side: its calibration, state (codec), views, value widths, and the stream itself
    "stream": (4, {"calibration": 0, "codec": 0, "view": 0, "values": 1, "compressed": 2}),
    # attention on the codes: the reference, and the Metal kernels, each .metal beside its launcher
    "attention": (5, {"reference": 0, "launch": 1, "support": 2, "codes": 3, "attend": 4, "selfcheck": 4,
                      "dispatch": 5}),
    "batch": (6, None),
    "hook": (7, None),  # mlx-lm patched in one module: the attention entry, one install, one uninstall
    "cache": (8, None),
    "planner": (9, {"machine": 0, "memory": 1, "display": 2}),  # what a cache holds and will hold; the machine
    "integration": (10, None),
    "convert": (11, None),
    # a prompt cache that lasts: exact resume points, the file, the disk store, tq-server's two tiers
    "prompt_cache": (12, {"file": 0, "resume": 0, "store": 1, "lru": 2}),
    "cli": (13, {"flags": 0, "generate": 1, "server": 1}),
    "__init__": (14, None),
}


def _ranks() -> dict[str, tuple]:
    """module -> (layer, rank in its sub-package); a sub-package's __init__ ranks above its modules."""
    out = {}
    for layer, (n, modules) in LAYERS.items():
        if modules is None:
            out[layer] = (n, 0)
            continue
        for m, r in modules.items():
            out[f"{layer}.{m}"] = (n, r)
        out[layer] = (n, max(modules.values()) + 1)
    return out


RANKS = _ranks()


def _resolve(parts: list[str], names: list[str]) -> set[str]:
    """The modules `from tq_mlx.<parts> import <names>` reads: names that are modules of the package <parts>,
    else the module (or the package's __init__) <parts> itself."""
    folder = PACKAGE.joinpath(*parts)
    if not parts or (folder / "__init__.py").is_file():
        mods = {n for n in names if (folder / f"{n}.py").is_file() or (folder / n / "__init__.py").is_file()}
        out = {".".join(parts + [n]) for n in mods}
        if set(names) - mods:
            out.add(".".join(parts) or "__init__")
        return out
    return {".".join(parts)}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _package_imports(path: Path) -> set[str]:
    """tq_mlx modules a source file imports, wherever the import statement sits, as RANKS names them."""
    inside = path.is_relative_to(PACKAGE)
    here = _module_name(path).split(".") if inside else []
    package = here[:-1] if path.name != "__init__.py" else here  # the package a relative import starts from
    if here == ["__init__"]:
        package = []
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                out |= _resolve(base + (node.module.split(".") if node.module else []), [a.name for a in node.names])
            elif node.module and node.module.split(".")[0] == "tq_mlx":
                out |= _resolve(node.module.split(".")[1:], [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tq_mlx."):
                    out |= _resolve(a.name.split(".")[1:], [])
    out.discard(_module_name(path) if inside else None)
    return out


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _may_import(module: str, other: str) -> bool:
    (layer, rank), (other_layer, other_rank) = RANKS[module], RANKS.get(other, (99, 99))
    if module.split(".")[0] == other.split(".")[0] and module != "__init__":  # within one sub-package
        return other_rank < rank
    return other_layer < layer


def test_every_module_has_a_rank():
    assert set(MODULES) == set(RANKS), f"give new modules a place on the data path: {sorted(set(MODULES) ^ set(RANKS))}"


@pytest.mark.parametrize("module", sorted(RANKS))
def test_imports_flow_down_the_data_path(module):
    imported = _package_imports(MODULES[module])
    upward = sorted(m for m in imported if not _may_import(module, m))
    assert not upward, f"tq_mlx/{module} imports {upward}, which sit at or above it on the data path"


def test_the_import_checker_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .cache import X\n    import tq_mlx.cli.flags\n    from tq_mlx import integration\n")
    assert _package_imports(src) == {"cache", "cli.flags", "integration"}


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


def test_the_import_checker_resolves_sub_packages():
    got = _package_imports(PACKAGE / "attention" / "attend.py")
    assert {"attention.reference", "stream.view", "attention.codes", "attention.launch"} <= got, got
    assert "attention.dispatch" in _package_imports(PACKAGE / "attention" / "__init__.py")
    assert "attention" in _package_imports(PACKAGE / "cache.py")  # the package's re-exports: its __init__
    assert not _may_import("attention.launch", "attention.attend") and _may_import("attention.attend", "attention.launch")
    assert not _may_import("cache", "planner.memory") and _may_import("planner.memory", "cache")


def test_every_sub_package_is_a_layer_and_goes_into_the_wheel():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == {k for k, (_, mods) in LAYERS.items() if mods is not None}
    m = re.search(r"^packages = \[(.*?)\]", (PACKAGE.parent / "pyproject.toml").read_text(), re.M | re.S)
    listed = set(re.findall(r'"([\w.]+)"', m.group(1)))
    missing = sorted(f"tq_mlx.{f}" for f in folders if f"tq_mlx.{f}" not in listed)
    assert not missing, f"pyproject.toml's packages leave out {missing}: the wheel would not hold them"


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
import tq_mlx, tq_mlx.attention, tq_mlx.planner.memory, tq_mlx.integration
import tq_mlx.convert, tq_mlx.cli.flags, tq_mlx.cli.generate, tq_mlx.cli.server
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
    rows = ["| layer | module | owns |", "|--:|---|---|"]
    for name in sorted(RANKS, key=lambda m: (RANKS[m][0], list(LAYERS).index(m.split(".")[0]), RANKS[m][1], m)):
        path = MODULES[name]
        layer, rank = RANKS[name]
        where = f"{layer}" if LAYERS[name.split(".")[0]][1] is None else f"{layer}.{rank}"
        rows.append(f"| {where} | `{path.relative_to(PACKAGE.parent)}` | {_owns(path)} |")
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
