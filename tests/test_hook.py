"""mlx-lm patched in one place (tq_mlx.hook): every part installs through one table, and uninstall puts back every
name it replaced, the identical object; importing tq_mlx changes nothing in mlx-lm."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import mlx_lm.generate  # noqa: F401  (loaded, so that its by-name make_prompt_cache is watched)
import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache
import mlx_lm.server  # noqa: F401
import mlx_lm.utils
import pytest

import tq_mlx
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx import hook
from tests.support.tiny_models import tiny_llama

REPO = Path(__file__).resolve().parent.parent


def _mlx_lm_dicts() -> dict[str, dict]:
    """Every loaded mlx-lm module's names and the objects they hold (the objects, not their ids: compared by `is`)."""
    return {name: dict(vars(m)) for name, m in list(sys.modules.items())
            if (name == "mlx_lm" or name.startswith("mlx_lm.")) and isinstance(m, types.ModuleType)}


def _changed(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    return sorted(f"{n}.{k}" for n in before for k in set(before[n]) | set(after.get(n, {}))
                  if before[n].get(k, hook.MISSING) is not after.get(n, {}).get(k, hook.MISSING))


@pytest.fixture
def pristine():
    """mlx-lm as tq_mlx found it for the test; afterwards the parts that were installed before are installed again
    (other tests' caches were built with the hook in place)."""
    was = {e.part for e in hook.replaced()}
    hook.uninstall()
    yield
    hook.uninstall()
    if "attention" in was:
        hook.install_attention_hook(TurboQuantKVCache)
    if "make_prompt_cache" in was:
        hook.install("make_prompt_cache")


def test_every_part_installs_in_one_table_and_uninstall_restores_every_name(pristine, monkeypatch, tmp_path):
    from tests.test_cli import save_tiny_model
    from tq_mlx.cli.generate import generate_main
    from tq_mlx.cli.server import server_main

    gen, server = sys.modules["mlx_lm.generate"], sys.modules["mlx_lm.server"]
    model_dir = save_tiny_model(tmp_path / "tiny")
    seen: dict[str, list[hook.Replaced]] = {}

    def gen_main():  # tq-generate's gen.main: the table while it runs, and a model loaded the patched way
        loaded, _ = gen.load(str(model_dir))
        seen["tq-generate"] = hook.replaced()
        seen["loaded"] = [loaded]

    real_server_main = server.main

    def server_main_():  # server_parser's call builds the parser; server_main's would serve: the table instead
        if "parser" not in seen:
            seen["parser"] = hook.replaced()
            return real_server_main()
        seen["tq-server"] = hook.replaced()

    monkeypatch.setattr(gen, "main", gen_main)
    monkeypatch.setattr(server, "main", server_main_)
    before = _mlx_lm_dicts()
    assert hook.replaced() == [] and not hook.hook_installed()

    model, _ = tiny_llama(layers=1)
    tq_mlx.patch_model(model, TurboQuantConfig())  # "attention" and "make_prompt_cache"
    assert mlx_cache.make_prompt_cache(model, max_kv_size=1000)[0].max_size == 1000  # the bound reaches make_cache
    assert gen.make_prompt_cache(model, max_kv_size=1000)[0].max_size == 1000  # and mlx_lm.generate's by-name import
    probe = types.ModuleType("mlx_lm._tq_probe")  # an mlx-lm module loaded after the install imports ours by name
    probe.make_prompt_cache = mlx_cache.make_prompt_cache
    probe.scaled_dot_product_attention = mlx_base.scaled_dot_product_attention
    monkeypatch.setitem(sys.modules, probe.__name__, probe)
    assert generate_main(["--model", str(model_dir), "--prompt", "hi"]) == 0  # "load_model" and "tq-generate"
    assert server_main(["--model", str(model_dir)]) == 0  # "tq-server", twice: the parser, then the server's names
    persistent = hook.replaced()

    def names(entries):
        return {(e.part, f"{e.owner.__name__}.{e.name}") for e in entries}

    everything = [*persistent, *seen["parser"], *seen["tq-generate"], *seen["tq-server"]]
    assert names(everything) >= {
        ("attention", "mlx_lm.models.base.quantized_scaled_dot_product_attention"),
        ("attention", "mlx_lm.models.llama.scaled_dot_product_attention"),
        ("attention", "mlx_lm.models.cache.TurboQuantKVCache"),
        ("attention", "mlx_lm.models.cache.BatchTurboQuantKVCache"),
        ("make_prompt_cache", "mlx_lm.models.cache.make_prompt_cache"),
        ("make_prompt_cache", "mlx_lm.generate.make_prompt_cache"),
        ("make_prompt_cache", "mlx_lm.server.make_prompt_cache"),
        ("load_model", "mlx_lm.utils.load_model"),
        *(("tq-generate", f"mlx_lm.generate.{n}") for n in ("setup_arg_parser", "generate", "load",
                                                            "load_prompt_cache")),
        *(("tq-server", f"mlx_lm.server.{n}") for n in ("ModelProvider", "ResponseGenerator", "_run_http_server",
                                                        "scan_cache_dir", "argparse", "LRUPromptCache")),
    }, sorted(names(everything))
    assert {e.part for e in everything} == set(hook.PARTS)
    assert getattr(seen["loaded"][0].make_cache, "takes_max_kv_size", False)  # loaded through tq_mlx's load_model
    # the commands' parts are gone once they return; the library's stay until uninstall
    assert {e.part for e in persistent} == {"attention", "make_prompt_cache"}
    assert mlx_lm.utils.load_model is hook.original(mlx_lm.utils, "load_model")

    hook.uninstall()
    assert hook.replaced() == [] and not hook.hook_installed()
    for e in everything:  # every name the table held is the identical object it was, or absent as it was
        assert vars(e.owner).get(e.name, hook.MISSING) is e.original, f"{e.owner.__name__}.{e.name}"
    assert probe.make_prompt_cache is before["mlx_lm.models.cache"]["make_prompt_cache"]
    assert probe.scaled_dot_product_attention is before["mlx_lm.models.base"]["scaled_dot_product_attention"]
    assert _changed(before, _mlx_lm_dicts()) == []
    # mlx-lm's own make_prompt_cache again: a patched model's bound is mlx-lm's to drop
    assert mlx_cache.make_prompt_cache(model, max_kv_size=1000)[0].max_size is None


def test_install_is_idempotent_and_leaves_a_wrapper_of_ours_alone(pristine):
    hook.install_attention_hook(TurboQuantKVCache)
    table = hook.replaced()
    hook.install_attention_hook(TurboQuantKVCache)
    assert hook.replaced() == table
    ours = mlx_base.quantized_scaled_dot_product_attention
    assert ours is hook.quantized_scaled_dot_product_attention
    mlx_own = hook.original(mlx_base, "quantized_scaled_dot_product_attention")  # the table forgets it on uninstall
    assert mlx_own is not ours

    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    mlx_base.quantized_scaled_dot_product_attention = theirs
    try:
        hook.install_attention_hook(TurboQuantKVCache)
        assert mlx_base.quantized_scaled_dot_product_attention is theirs  # not taken back
        hook.uninstall()
        assert mlx_base.quantized_scaled_dot_product_attention is theirs  # theirs to undo
    finally:
        mlx_base.quantized_scaled_dot_product_attention = mlx_own
    assert hook.original(mlx_base, "quantized_scaled_dot_product_attention") is mlx_own
    with pytest.raises(ValueError, match="mlx-lm's modules only"):
        hook.install("tq-generate", {"tq_mlx.cache.TurboQuantKVCache": None})
    with pytest.raises(ValueError, match="no part 'hook'"):
        hook.install("hook")


_SNAPSHOT = r"""
import importlib, json, pkgutil, sys, types
import mlx_lm

def load(package):
    names = [package.__name__]
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not m.name.endswith("__main__"):
            names.append(m.name)
    for n in names:
        try:
            importlib.import_module(n)
        except BaseException:  # optional packages missing (lm_eval, ...): some modules exit or raise
            pass

def snap():
    return {n: dict(vars(m)) for n, m in list(sys.modules.items())
            if (n == "mlx_lm" or n.startswith("mlx_lm.")) and isinstance(m, types.ModuleType)}

def changed(a, b):
    return sorted(f"{n}.{k}" for n in a for k in set(a[n]) | set(b.get(n, {}))
                  if a[n].get(k, KeyError) is not b.get(n, {}).get(k, KeyError))

load(mlx_lm)
before = snap()
import tq_mlx
load(tq_mlx)
imported = sorted(n for n in sys.modules if n == "tq_mlx" or n.startswith("tq_mlx."))
out = {"modules": len(before), "tq_mlx": imported, "import": changed(before, snap())}

from mlx_lm import generate
from tq_mlx import hook
from tests.support.tiny_models import tiny_llama
model, _ = tiny_llama(layers=1)
tq_mlx.patch_model(model, tq_mlx.TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2))

from tests.support.tiny_models import tiny_tokenizer
generate(model, tiny_tokenizer(), "hi", max_tokens=20, max_kv_size=16)
out["bounded"] = sys.modules["mlx_lm.generate"].make_prompt_cache(model, max_kv_size=16)[0].max_size
out["installed"] = sorted({e.part for e in hook.replaced()})
hook.uninstall()
out["uninstall"] = changed(before, snap())
print(json.dumps(out))
"""


def test_importing_tq_mlx_changes_nothing_and_uninstall_leaves_mlx_lm_as_it_was():
    # A fresh process: every mlx-lm module loaded (models, tuner, server, ...), then tq_mlx and each of its
    # modules; then a patched model generates through mlx-lm, bounded, and uninstall puts everything back.
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["modules"] > 150, r["modules"]  # the models and the rest of mlx-lm were watched, not a few
    assert {"tq_mlx.hook", "tq_mlx.cli.generate", "tq_mlx.cli.server", "tq_mlx.attention.dispatch"} <= set(r["tq_mlx"])
    assert r["import"] == [], f"importing tq_mlx changed mlx-lm: {r['import']}"
    assert r["installed"] == ["attention", "make_prompt_cache"] and r["bounded"] == 16
    assert r["uninstall"] == [], f"uninstall left mlx-lm changed: {r['uninstall']}"
