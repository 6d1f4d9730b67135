"""The disk store of compressed prompt caches (tq_mlx.prompt_cache.store, tq_mlx.prompt_cache.file): files found again by their
token prefix after a restart, mlx-lm's file layout, written atomically, least recently used out past the byte cap,
only its own files ever deleted; and the faults: a full disk, a read-only, missing or unusable folder, a truncated
or corrupt file, a file of another model or config, each one line in the log and no cache used from it. On a tiny
random llama with a small window (the greedy tokens of a real model after a disk hit are
tests/test_prompt_cache_hits.py's)."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tq_mlx
import tq_mlx.prompt_cache.file as store_file
from tests.support.tiny_models import prefilled, random_tokens as ids, tiny_llama
from tq_mlx import TurboQuantConfig
from tq_mlx.prompt_cache.store import FOLDER_ENV, NAME, PromptStore, config_id, default_folder, model_id, read_header
from tq_mlx.prompt_cache.resume import cache_counts

CFG = TurboQuantConfig(window=32, calibration_tokens=None, compress_block=16, sinks=4, decay_after=96)
LOG = "tq_mlx.prompt_cache.store"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)[0]


@pytest.fixture(scope="module")
def other_model():
    return tiny_llama(layers=2, seed=1)[0]


def fed(model, tokens, config=CFG):
    return prefilled(model, tokens, config)


def store(folder, model, config=CFG, max_bytes=10**9, **kw) -> PromptStore:
    return PromptStore(folder, max_bytes, model_id=model_id(model), config=config, model_name="org/tiny",
                       background=False, **kw)


def saved(folder, model, tokens, config=CFG, **kw) -> PromptStore:
    s = store(folder, model, config, **kw)
    assert s.save(tokens, fed(model, tokens, config))
    return s


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno >= logging.WARNING]


# --- found again, loaded, trimmed, extended ----------------------------------------------------------------------


def test_a_saved_cache_is_found_by_its_prefix_after_a_restart_and_resumes_exactly(model, tmp_path):
    held = ids(200)
    saved(tmp_path, model, held)
    later = store(tmp_path, model)  # a new process: the index comes from the files' headers
    assert [e.n_tokens for e in later.entries()] == [200]
    prompt = held[:150] + ids(20, 1)  # shares 150 tokens, which end inside the held cache's codes
    hit = later.lookup(prompt)
    assert hit is not None and 4 < hit.point <= 150
    cache = later.load(hit, model)
    assert cache[0].offset == hit.point
    for i in range(hit.point, len(prompt), 64):
        model(mx.array(prompt[i:min(i + 64, len(prompt))])[None], cache=cache)
    fresh = fed(model, prompt)
    assert cache_counts(cache) == cache_counts(fresh)  # every part as a fresh prefill holds it
    assert later.lookup(ids(50, 9)) is None  # nothing shared
    assert later.stats()["loaded"] == 1


def test_files_are_mlx_lm_prompt_cache_files_that_name_their_model_and_config(model, tmp_path):
    s = saved(tmp_path, model, ids(120))
    (path,) = tmp_path.iterdir()
    m = NAME.match(path.name)
    assert m and m["slug"] == "org-tiny" and m["model"] == model_id(model) and m["config"] == config_id(CFG)
    assert m["n"] == "120"
    _, meta, _ = read_header(path)
    assert meta["0.model"] == "org/tiny" and TurboQuantConfig.from_dict(__import__("json").loads(meta["0.config"])) == CFG
    cache = tq_mlx.load_prompt_cache(str(path), model, CFG)  # the library's loader, with its checks
    assert cache[0].offset == 120 and cache_counts(cache) == s.entries()[0].counts
    import mlx_lm.models.cache as mlx_cache

    assert mlx_cache.load_prompt_cache(str(path))[0].offset == 120  # and mlx-lm's own


def test_saving_the_same_tokens_again_writes_nothing_and_short_caches_are_not_written(model, tmp_path):
    tokens = ids(100)
    s = saved(tmp_path, model, tokens, min_tokens=50)
    assert not s.save(tokens, fed(model, tokens))
    assert not s.save(tokens[:40], fed(model, tokens[:40]))
    assert len(list(tmp_path.iterdir())) == 1 and s.stats()["written"] == 1


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    from tests import conftest

    assert conftest.FOLDER_ENV == FOLDER_ENV  # the suite's own folder is set through this variable
    monkeypatch.setenv(FOLDER_ENV, str(tmp_path / "x"))
    assert default_folder() == tmp_path / "x"
    monkeypatch.delenv(FOLDER_ENV)
    monkeypatch.setenv("TQ_MLX_CACHE", str(tmp_path))
    assert default_folder() == tmp_path / "prompt-cache"


# --- eviction and atomic writes --------------------------------------------------------------------------------


def test_the_least_recently_used_go_first_past_the_cap_and_only_store_files_are_deleted(model, tmp_path):
    s = store(tmp_path, model)
    for seed in range(3):
        s.save(ids(100, seed), fed(model, ids(100, seed)))
    sizes = sorted(p.stat().st_size for p in tmp_path.iterdir())
    files = sorted(tmp_path.iterdir(), key=lambda p: p.stat().st_mtime)
    for i, p in enumerate(files):  # written oldest first; then the oldest is used again
        os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))
    s.load(s.lookup(ids(100, 0)[:90] + [1]), model)
    bystander = tmp_path / "notes.txt"
    bystander.write_text("not the store's")
    link = tmp_path / files[1].name.replace("--100-", "--101-")  # the store's pattern, but a symlink
    link.symlink_to(bystander)
    capped = store(tmp_path, model, max_bytes=sizes[0] * 2 + sizes[0] // 2)
    assert capped.evict() == 1
    left = {p.name for p in tmp_path.iterdir()}
    assert files[1].name not in left  # the least recently used
    assert {files[0].name, files[2].name, bystander.name, link.name} <= left


def test_a_write_is_whole_or_absent_and_dead_writers_temporary_files_are_removed(model, tmp_path, monkeypatch, caplog):
    s = store(tmp_path, model)
    real = os.replace

    def crash(a, b):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_file.os, "replace", crash)
    with caplog.at_level(logging.WARNING, LOG):
        assert s.save(ids(100), fed(model, ids(100)))
    assert list(tmp_path.iterdir()) == []  # no file, and no temporary one
    assert len(warnings(caplog)) == 1 and "Input/output error" in warnings(caplog)[0]
    monkeypatch.setattr(store_file.os, "replace", real)
    name = s.name_for(np.asarray(ids(100), np.int32))
    dead = tmp_path / f".{name}.999999999.0a0b0c0d.tmp"
    alive = tmp_path / f".{name}.{os.getpid()}.0a0b0c0e.tmp"
    other = tmp_path / ".something.999999999.0a0b0c0d.tmp"
    for p in (dead, alive, other):
        p.write_bytes(b"partial")
    store(tmp_path, model)
    assert not dead.exists() and alive.exists() and other.exists()


# --- faults: each one line, the caller goes on --------------------------------------------------------------------


def _failing_open(code: int):
    real = open

    def fake(path, mode="r", *a, **kw):
        if "x" in mode or "w" in mode:
            raise OSError(code, os.strerror(code), str(path))
        return real(path, mode, *a, **kw)

    return fake


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["a full disk", "a read-only folder"])
def test_a_full_disk_or_a_read_only_folder_is_one_line_and_reads_go_on(model, tmp_path, monkeypatch, caplog, code):
    s = saved(tmp_path, model, ids(100))
    monkeypatch.setattr(store_file, "open", _failing_open(code), raising=False)
    with caplog.at_level(logging.WARNING, LOG):
        for seed in (1, 2):  # two failures, one line
            assert s.save(ids(100, seed), fed(model, ids(100, seed)))
    lines = warnings(caplog)
    assert len(lines) == 1 and os.strerror(code) in lines[0] and "stays in memory" in lines[0]
    assert len(list(tmp_path.iterdir())) == 1 and s.stats()["write_errors"] == 2
    assert s.load(s.lookup(ids(100)[:80] + [3]), model) is not None  # what is there still serves


def test_a_missing_folder_is_created_and_one_that_cannot_be_is_one_line(model, tmp_path, caplog):
    assert store(tmp_path / "a" / "b", model).enabled and (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, LOG):
        s = store(tmp_path / "file" / "sub", model)
    assert not s.enabled and s.lookup(ids(10)) is None and not s.save(ids(100), fed(model, ids(100)))
    assert len(warnings(caplog)) == 1 and "cannot use" in warnings(caplog)[0]
    assert (tmp_path / "file").read_text() == "x"


def _one_file(folder: Path) -> Path:
    (path,) = [p for p in folder.iterdir() if NAME.match(p.name)]
    return path


@pytest.mark.parametrize("damage", ["truncated", "corrupt data", "corrupt header", "renamed"])
def test_a_damaged_file_is_one_line_never_used_and_not_deleted(model, tmp_path, caplog, damage):
    tokens = ids(100)
    saved(tmp_path, model, tokens)
    path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(bytes(data[: len(data) - 1000]))
    elif damage == "corrupt data":
        data[-500] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "corrupt header":
        path.write_bytes(bytes(data[:8]) + b"x" + bytes(data[9:]))
    else:  # the name of a cache of other tokens
        path = path.rename(path.with_name(path.name.replace("--100-", "--99-")))
    with caplog.at_level(logging.WARNING, LOG):
        s = store(tmp_path, model)
        hit = s.lookup(tokens[:90] + [5])
        assert hit is None or s.load(hit, model) is None  # the checksum catches corrupt data at load
        assert s.lookup(tokens[:90] + [5]) is None  # and it is never tried again
    lines = warnings(caplog)
    assert len(lines) == 1 and str(path) in lines[0], lines
    assert {"truncated": "truncated", "corrupt data": "checksum", "corrupt header": "not a safetensors",
            "renamed": "not the ones its name says"}[damage] in lines[0]
    assert path.exists()


def test_a_file_of_another_model_or_config_is_never_used(model, other_model, tmp_path, caplog):
    tokens = ids(100)
    saved(tmp_path, other_model, tokens)
    saved(tmp_path, model, tokens, config=TurboQuantConfig(window=32, calibration_tokens=None, compress_block=16, sinks=4, decay_after=64))
    mine = store(tmp_path, model)
    assert mine.lookup(tokens[:90] + [5]) is None and mine.entries() == []
    assert "2 of other models or configs" in mine.describe()
    # a file of another model under this model's name: its header says whose it is
    path = next(p for p in tmp_path.iterdir() if NAME.match(p.name)["model"] != model_id(model))
    path.rename(path.with_name(NAME.sub(lambda m: f"{m['slug']}--{model_id(model)}--{config_id(CFG)}--{m['n']}-"
                                                  f"{m['tokens']}.tqpc.safetensors", path.name)))
    with caplog.at_level(logging.WARNING, LOG):
        again = store(tmp_path, model)
        assert again.lookup(tokens[:90] + [5]) is None
    assert any("its header names model" in line for line in warnings(caplog)), warnings(caplog)
    assert len(list(tmp_path.iterdir())) == 2  # nothing deleted


def test_the_flags_take_mlx_lm_sizes_and_name_the_folder(tmp_path, monkeypatch):
    import argparse

    from tq_mlx.cli.flags import add_prompt_store_args, prompt_store_folder, size_arg

    assert [size_arg(x) for x in ("0", "500M", "10G", "2.5GB", "1234")] == [0, 5 * 10**8, 10**10, 25 * 10**8, 1234]
    for bad in ("-1", "ten", "5Q"):
        with pytest.raises(argparse.ArgumentTypeError):
            size_arg(bad)
    parser = add_prompt_store_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert args.tq_prompt_cache_disk_bytes == 10**10 and prompt_store_folder(args) == default_folder()
    args = parser.parse_args(["--tq-prompt-cache-dir", str(tmp_path), "--tq-prompt-cache-disk-bytes", "0"])
    assert prompt_store_folder(args) == tmp_path and args.tq_prompt_cache_disk_bytes == 0
