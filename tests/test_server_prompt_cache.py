"""tq-server's prompt cache with its disk tier, as a user runs it: --tq-prompt-cache-dir and
--tq-prompt-cache-disk-bytes, GET /v1/prompt_cache, a disk hit after a restart, and the faults (a full disk, a folder
that cannot be made, a truncated or corrupt file, a file of another model), each one line in the log with the
request answered from a fresh prefill and nothing deleted that is not the store's. On a tiny random model folder
(tests/test_cli.py), through benchmarks/serve.py's server shim. The greedy tokens after every kind of hit on the
demo model, and a needle on a real model, are tests/test_prompt_cache_hits.py's."""

from __future__ import annotations

import argparse
import inspect
import json
import re
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.blas import reference_blas_env
from tests.support.server import stop, wait_until_healthy
from tests.test_cli import save_tiny_model
from tq_mlx.cli.flags import add_cache_args, config_from_args
from tq_mlx.prompt_cache.store import NAME, TEMP, PromptStore, model_id

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import serve  # noqa: E402

CACHE_FLAGS = ["--tq-window", "32", "--tq-calibration-tokens", "32", "--tq-compress-block", "16", "--tq-sinks", "4", "--tq-decay-after", "128"]
TQ = [*CACHE_FLAGS, "--tq-max-context", "0"]
TIMEOUT = 120
CONFIG = config_from_args(add_cache_args(argparse.ArgumentParser()).parse_args(CACHE_FLAGS))  # the servers'
PREFIX = "The river archive keeps maps, ledgers and letters of the harbor towns. " * 5  # ~360 byte tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def stats(port: int) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/prompt_cache", timeout=10).read())


def written(port: int, files: int, timeout: float = 60) -> dict:
    """GET /v1/prompt_cache until the disk tier holds `files` files and no write is waiting."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(port)
        if s["disk"].get("pending_writes") == 0 and s["disk"].get("files", 0) >= files:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.2)


def ask(port: int, question: str) -> dict:
    reply = serve.chat(port, PREFIX + question, 12, TIMEOUT)
    assert reply["status"] == 200, reply
    return reply


def cached(reply: dict) -> int:
    return reply["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]


def lines(log: Path, pattern: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if re.search(pattern, line)]


def test_the_disk_tier_survives_a_restart_and_reports_what_it_holds(tiny, tmp_path):
    folder = tmp_path / "store"
    args = [*TQ, "--tq-prompt-cache-dir", str(folder)]
    with serve.Server("tq", tiny, args, tmp_path / "1.log", env=reference_blas_env(), start_timeout=90) as srv:
        first = ask(srv.port, "What does the archive keep?")
        assert cached(first) == 0
        s = written(srv.port, 1)
        assert s["object"] == "prompt_cache" and s["misses"] == 1
        m, d = s["memory"], s["disk"]
        assert m["sequences"] >= 1 and 0 < m["bytes"] < m["mlx_lm_bytes"]  # real bytes, and mlx-lm's float32 bytes
        assert d["enabled"] and d["folder"] == str(folder) and d["bytes"] > 0 and d["max_bytes"] == 10**10
    log = (tmp_path / "1.log").read_text()
    assert f"Prompt cache on disk: {folder}: 0 caches of this model and config (0 B); at most 10.0 GB on disk" in log
    with serve.Server("tq", tiny, args, tmp_path / "2.log", env=reference_blas_env(), start_timeout=90) as srv:
        again = ask(srv.port, "What does the archive keep?")
        assert stats(srv.port)["disk_hits"] == 1
    assert cached(again) > 300 and serve.answer(again) == serve.answer(first)
    assert lines(tmp_path / "2.log", r"Prompt cache: disk hit: \d+ of \d+ tokens cached")


def test_a_server_stopped_with_sigterm_saves_the_answer_it_gave_before_it_exits(tiny, tmp_path):
    # kill, systemd and `docker stop` send SIGTERM: tq-server stops as on Ctrl+C, the write of the answer just given
    # finishes, and the next start reads it
    folder, log = tmp_path / "store", tmp_path / "1.log"
    args = [*TQ, "--tq-prompt-cache-dir", str(folder)]
    with serve.Server("tq", tiny, args, log, env=reference_blas_env(), start_timeout=90) as srv:
        first = ask(srv.port, "What does the archive keep?")
        srv.stop()  # at once, without waiting for the disk tier
        assert srv.proc.returncode == 0, log.read_text()[-2000:]
    names = [p.name for p in folder.iterdir()]
    assert [n for n in names if NAME.match(n)] and not [n for n in names if TEMP.match(n)], names
    assert not lines(log, "writes unfinished")
    with serve.Server("tq", tiny, args, tmp_path / "2.log", env=reference_blas_env(), start_timeout=90) as srv:
        again = ask(srv.port, "What does the archive keep?")
        assert stats(srv.port)["disk_hits"] == 1
    assert cached(again) > 300 and serve.answer(again) == serve.answer(first)


def test_the_docs_state_how_long_a_stopping_server_waits_for_its_writes():
    from tq_mlx.cli.server import _flush_stores

    seconds = inspect.signature(_flush_stores).parameters["timeout"].default
    assert f"finish, for up to {seconds} s;" in " ".join((REPO / "docs" / "commands.md").read_text().split())


def test_the_disk_tier_is_off_with_zero_bytes_or_no_prompt_cache(tiny, tmp_path):
    for flag, why in ((["--tq-prompt-cache-disk-bytes", "0"], "--tq-prompt-cache-disk-bytes 0"),
                      (["--prompt-cache-size", "0"], "--prompt-cache-size 0")):
        log = tmp_path / "server.log"
        with serve.Server("tq", tiny, [*TQ, "--tq-prompt-cache-dir", str(tmp_path / "store"), *flag], log,
                          env=reference_blas_env(), start_timeout=90) as srv:
            ask(srv.port, "What does the archive keep?")
            assert stats(srv.port)["disk"] == {"enabled": False}
        assert f"Prompt cache on disk: off ({why}" in log.read_text()
        assert not (tmp_path / "store").exists()


def test_server_help_states_the_disk_tiers_flags_and_defaults():
    out = subprocess.run([sys.executable, "-c", "import sys; from tq_mlx.cli.server import server_main; "
                          "sys.exit(server_main(['--help']))"], capture_output=True, text=True, cwd=REPO, timeout=120)
    text = " ".join(out.stdout.split())
    assert "--tq-prompt-cache-dir DIR" in text and "--tq-prompt-cache-disk-bytes N" in text
    assert "(default: $TQ_MLX_PROMPT_CACHE_DIR if set, else" in text and "prompt-cache; created if missing)" in text
    assert "(default 10.0 GB; 0 turns the disk tier off)" in text


def _fsize_limit(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail EFBIG

    return apply


def test_damaged_files_are_one_line_each_and_the_request_is_answered_fresh(tiny, tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    import tq_mlx

    folder = tmp_path / "store"
    args = [*TQ, "--tq-prompt-cache-dir", str(folder)]
    with serve.Server("tq", tiny, args, tmp_path / "seed.log", env=reference_blas_env(), start_timeout=90) as srv:
        fresh = ask(srv.port, "What does the archive keep?")
        ask(srv.port, "What does the archive keep, and where?")
        written(srv.port, 2)
    own = sorted(p for p in folder.iterdir() if NAME.match(p.name))
    assert len(own) >= 2
    # every file of ours damaged: the first cut short, the others with a flipped byte in their data
    data = own[0].read_bytes()
    own[0].write_bytes(data[: len(data) // 2])
    for p in own[1:]:
        b = bytearray(p.read_bytes())
        b[-100] ^= 0xFF
        p.write_bytes(bytes(b))
    # a cache of another model for the same tokens, and a file that is not the store's
    model, tokenizer = load(str(save_tiny_model(tmp_path / "other", layers=2)))
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": PREFIX + "What does the archive keep?"}],
                                           add_generation_prompt=True)
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    model(mx.array(tokens)[None], cache=cache)
    foreign = PromptStore(folder, 10**9, model_id=model_id(model), config=CONFIG, model_name="other", background=False)
    assert foreign.save(tokens, cache)
    (folder / "notes.txt").write_text("mine")
    before = {p.name for p in folder.iterdir()}
    log = tmp_path / "faults.log"
    with serve.Server("tq", tiny, args, log, env=reference_blas_env(), start_timeout=90) as srv:
        reply = ask(srv.port, "What does the archive keep?")
    assert cached(reply) == 0 and serve.answer(reply) == serve.answer(fresh)
    for p in own:  # one line each, naming the file and what is wrong with it
        said = lines(log, f"Prompt store: not using {re.escape(str(p))}: ")
        assert len(said) == 1 and ("truncated" if p == own[0] else "checksum") in said[0], said
    assert lines(log, "1 of other models or configs") and not lines(log, "not using .*other--")
    # nothing deleted and nothing half-written (a fresh save of the answered prompt may replace a damaged file of
    # the same name)
    assert before == {p.name for p in folder.iterdir()}


def test_a_full_disk_or_a_folder_that_cannot_be_made_is_one_line_and_requests_are_answered(tiny, tmp_path):
    # a full disk: the process may write no file larger than 64 KB (Python ignores SIGXFSZ: the write fails with
    # EFBIG), so each cache's write fails while the log goes on
    folder, port, log = tmp_path / "full", serve.free_port(), tmp_path / "full.log"
    cmd = [sys.executable, str(REPO / "benchmarks" / "serve.py"), "--serve", "tq", "--model", str(tiny), "--host",
           "127.0.0.1", "--port", str(port), *TQ, "--tq-prompt-cache-dir", str(folder)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=reference_blas_env(),
                                start_new_session=True, preexec_fn=_file_size_limit(64 << 10))
    try:
        wait_until_healthy(proc, port, log, 90)
        replies = [ask(port, "What does the archive keep?"), ask(port, "Which towns does it serve?")]
        s = written(port, 0)
    finally:
        stop(proc)
    assert all(r["status"] == 200 for r in replies) and s["disk"]["write_errors"] >= 2
    failed = lines(log, r"Prompt store: cannot write to ")
    assert len(failed) == 1 and "File too large" in failed[0] and "the request was answered" in failed[0]
    assert list(folder.iterdir()) == []  # no file, whole or partial
    # a folder that cannot be made (under a file)
    (tmp_path / "a-file").write_text("x")
    log = tmp_path / "nofolder.log"
    with serve.Server("tq", tiny, [*TQ, "--tq-prompt-cache-dir", str(tmp_path / "a-file" / "store")], log,
                      env=reference_blas_env(), start_timeout=90) as srv:
        assert ask(srv.port, "Which towns does it serve?")["status"] == 200
    assert len(lines(log, r"Prompt store: cannot use .*a-file/store")) == 1
    assert lines(log, r"Prompt cache on disk: off") and (tmp_path / "a-file").read_text() == "x"


def _file_size_limit(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply
