"""OpenBLAS for MLX's Linux CPU back end (tq_mlx/blas.py): the commands restart themselves with it preloaded
where it is installed, and otherwise say once how to get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tq_mlx import blas


@pytest.fixture
def linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")  # blas reads it at call time: the logic runs anywhere


def fake_lib(tmp_path: Path) -> str:
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    return str(lib)


def test_reexec_environment_preloads_the_library_first(linux, tmp_path):
    lib = fake_lib(tmp_path)
    env = blas.reexec_environ({blas.ENV_VAR: lib, "LD_PRELOAD": "/x/libother.so", "HOME": "/h"})
    assert env["LD_PRELOAD"] == f"{lib}:/x/libother.so"
    assert env["HOME"] == "/h" and env[blas._REEXEC_MARK] == "1"
    assert blas.reexec_environ({blas.ENV_VAR: lib})["LD_PRELOAD"] == lib


@pytest.mark.parametrize("case", ["preloaded", "restarted", "disabled", "missing", "mac"])
def test_no_reexec(linux, tmp_path, monkeypatch, case):
    lib = fake_lib(tmp_path)
    env = {blas.ENV_VAR: lib}
    if case == "preloaded":
        env["LD_PRELOAD"] = lib
    elif case == "restarted":  # the preload did not take: never loop
        env[blas._REEXEC_MARK] = "1"
    elif case == "disabled":
        env[blas.ENV_VAR] = "0"
    elif case == "missing":
        env[blas.ENV_VAR] = str(tmp_path / "nope.so")
    else:
        monkeypatch.setattr(sys, "platform", "darwin")
    assert blas.reexec_environ(env) is None


def test_default_path_is_debians_openblas(linux):
    assert blas.openblas_path({}).endswith("-linux-gnu/openblas-pthread/libblas.so.3")
    assert blas.openblas_path({blas.ENV_VAR: "0"}) == blas.openblas_path({})


def test_hints(linux, tmp_path, monkeypatch):
    monkeypatch.setattr(blas, "openblas_path", lambda env=None: str(tmp_path / "libblas.so.3"))
    hint = blas.blas_hint({})
    assert "apt-get install libopenblas0-pthread" in hint and "reference BLAS" in hint
    lib = fake_lib(tmp_path)
    assert f"LD_PRELOAD={lib}" in blas.blas_hint({})
    assert blas.blas_hint({"LD_PRELOAD": lib}) is None
    assert blas.blas_hint({blas.ENV_VAR: "0"}) is None


def test_hint_is_printed_once(linux, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(blas, "_hinted", False)
    monkeypatch.setenv(blas.ENV_VAR, str(tmp_path / "missing.so"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    blas.use_openblas("tq-test")
    blas.use_openblas("tq-test")
    err = capsys.readouterr().err
    assert err.count("tq-test: note:") == 1 and "missing.so does not exist" in err


def _loaded_libm() -> str:
    """Path of the libm this Python has mapped: a real library that is harmless to preload."""
    import math  # noqa: F401

    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libm.so"):
            return path
    pytest.fail("no libm in /proc/self/maps")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD re-exec is Linux only")
def test_command_restarts_itself_with_the_library_preloaded(tmp_path):
    lib = _loaded_libm()
    script = ("import os; print('start', flush=True); from tq_mlx.blas import use_openblas; use_openblas('t'); "
              "print('LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''))")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas._REEXEC_MARK)}
    env[blas.ENV_VAR] = lib
    proc = subprocess.run([sys.executable, "-c", script, "arg"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # printed before and after the exec, and the restarted process has the library preloaded
    assert proc.stdout.splitlines() == ["start", "start", f"LD_PRELOAD={lib}"], proc.stdout
    assert "note:" not in proc.stderr


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "tq_chat.main", "--help"],
    [sys.executable, "-c", "import sys; from tq_mlx.cli.generate import generate_main; sys.exit(generate_main())", "--help"],
], ids=["tq-chat", "tq-generate"])
def test_entry_points_hint_without_openblas(command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas._REEXEC_MARK)}
    env[blas.ENV_VAR] = str(tmp_path / "missing.so")  # as on a machine without OpenBLAS
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    if sys.platform.startswith("linux"):
        assert proc.stderr.count("note: ") == 1 and "reference BLAS" in proc.stderr, proc.stderr
    else:
        assert "note: " not in proc.stderr


# --- the library, from plain Python ---------------------------------------------------------------------------

PLAIN = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ENV_VAR, blas._REEXEC_MARK)}


def python(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "default", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference BLAS is MLX's Linux CPU wheel")
def test_the_library_warns_once_from_plain_python_and_never_at_import(tmp_path):
    script = ("import tq_mlx, mlx_lm; from tq_mlx import blas; print('imported', flush=True); "
              "blas.warn_reference_blas(); blas.warn_reference_blas()")
    env = {**PLAIN, blas.ENV_VAR: str(tmp_path / "missing.so")}  # as on a machine without OpenBLAS
    proc = python(script, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ReferenceBLASWarning") == 1, proc.stderr
    assert "reference BLAS (~20x slower" in proc.stderr and "tq_mlx.blas.use_openblas()" in proc.stderr
    assert "apt-get install libopenblas0-pthread" in proc.stderr
    # importing tq_mlx (and mlx_lm) alone says nothing
    quiet = python("import tq_mlx, mlx_lm, tq_mlx.cli.flags, tq_mlx.cli.generate, tq_mlx.cli.server, tq_mlx.blas", env)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    # silent with OpenBLAS preloaded, or with TQ_MLX_OPENBLAS=0
    lib = _loaded_libm()
    assert "Warning" not in python(script, {**PLAIN, blas.ENV_VAR: lib, "LD_PRELOAD": lib}).stderr
    assert "Warning" not in python(script, {**PLAIN, blas.ENV_VAR: "0"}).stderr


def test_building_or_loading_caches_from_plain_python_warns_once(tmp_path):
    script = ("import mlx.core as mx, tq_mlx; from mlx_lm.models import llama; "
              "a = llama.ModelArgs(model_type='llama', hidden_size=64, num_hidden_layers=1, intermediate_size=64, "
              "num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=32); "
              "m = llama.Model(a); tq_mlx.make_prompt_cache(m); tq_mlx.patch_model(m); tq_mlx.make_prompt_cache(m)")
    proc = python(script, {**PLAIN, blas.ENV_VAR: str(tmp_path / "missing.so")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ReferenceBLASWarning") == 1, proc.stderr


def test_python_hint_names_both_ways_to_the_fast_path(linux, tmp_path, monkeypatch):
    lib = fake_lib(tmp_path)
    hint = blas.python_hint({blas.ENV_VAR: lib})
    assert f"start Python with LD_PRELOAD={lib}, or call tq_mlx.blas.use_openblas() first thing" in hint
    assert blas.python_hint({blas.ENV_VAR: lib, "LD_PRELOAD": lib}) is None
    assert blas.python_hint({blas.ENV_VAR: "0"}) is None


def test_no_warning_after_a_command_printed_its_note_or_off_the_cpu(linux, monkeypatch, recwarn):
    monkeypatch.setenv(blas.ENV_VAR, "/nonexistent/libblas.so")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(blas, "_warned", False)
    monkeypatch.setattr(blas, "_hinted", True)  # tq-chat / tq-generate / tq-server said it already
    blas.warn_reference_blas()
    monkeypatch.setattr(blas, "_warned", False)
    monkeypatch.setattr(blas, "_hinted", False)
    monkeypatch.setattr(blas, "_on_cpu", lambda: False)  # CUDA or Metal: no CPU BLAS in the forward
    blas.warn_reference_blas()
    assert not [w for w in recwarn if issubclass(w.category, blas.ReferenceBLASWarning)]
    monkeypatch.setattr(blas, "_warned", False)
    monkeypatch.setattr(blas, "_on_cpu", lambda: True)
    with pytest.warns(blas.ReferenceBLASWarning, match="reference BLAS"):
        blas.warn_reference_blas()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD re-exec is Linux only")
def test_a_script_gets_openblas_by_calling_use_openblas(tmp_path):
    lib = _loaded_libm()
    script = tmp_path / "my_script.py"
    script.write_text("import os\nfrom tq_mlx.blas import use_openblas\nuse_openblas()\n"
                      "print('LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''))\n")
    proc = subprocess.run([sys.executable, str(script)], env={**PLAIN, blas.ENV_VAR: lib}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"LD_PRELOAD={lib}", proc.stderr
