"""tq-server under load: concurrent clients batched and answered as one at a time, and the context bound
(--tq-max-context): an over-long request refused with HTTP 400 before any forward, the rest of its batch unaffected.

The servers run on a tiny random model folder (tests/test_cli.py) through benchmarks/serve.py's shim, which only
adds a log line per busy period of mlx-lm's BatchGenerator (most sequences at once, peak KV bytes), so that a test
can tell the requests really shared a batch. They run on MLX's own BLAS: with OpenBLAS a row of a batch rounds
differently from the sequence alone (README, Batching), and the answers are compared exactly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.support.blas import reference_blas_env
from tests.test_cli import save_tiny_model
from tq_mlx.cli.server import context_bound
from tq_mlx.config import KEY_ERROR
from tq_mlx.planner.memory import max_context
from tq_mlx.planner.memory import estimate_peak_bytes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import serve  # noqa: E402

TQ = ["--tq-window", "16", "--tq-calibration-tokens", "16", "--tq-compress-block", "8", "--tq-sinks", "2", "--prompt-cache-size", "0"]
TIMEOUT = 120  # seconds per request: the tiny model answers in well under a second


def prompts(n: int, chars: int) -> list[str]:
    """n distinct user messages of `chars` characters (the tiny tokenizer is byte-level: about one token each)."""
    words = "river stone lamp orchard violet copper signal harbor meadow lantern thistle".split()
    out = []
    for i in range(n):
        text = " ".join(words[(i + j * (i + 2)) % len(words)] for j in range(chars))
        out.append(f"{i}: {text}"[:chars])
    return out


def sequential(srv: serve.Server, contents: list[str], max_tokens: int) -> list[dict]:
    replies = [serve.chat(srv.port, c, max_tokens, TIMEOUT) for c in contents]
    assert all(r["status"] == 200 for r in replies), replies
    return replies


def test_four_concurrent_clients_are_batched_and_get_their_sequential_answers(tmp_path):
    model = save_tiny_model(tmp_path / "tiny")
    contents = prompts(4, 90)
    with serve.Server("tq", model, [*TQ, "--tq-max-context", "0"], tmp_path / "server.log",
                      env=reference_blas_env(), start_timeout=90) as srv:
        alone = sequential(srv, contents, 160)
        at = srv.log_offset()
        wall, replies = serve.concurrent(srv.port, contents, 160, TIMEOUT)
        batches = srv.batches_since(at)
    log = (tmp_path / "server.log").read_text()
    # the flags' window and sinks, at the default bits (K4/V4; a first window that is the window itself: keys by
    # their logit error, the output error having no coded token to measure on)
    assert "TurboQuant K4/V4, window 16, sinks 4" not in log
    assert ("TurboQuant K4/V4, window 16, sinks 2, keys up to K6 where their logit error exceeds "
            f"{format(KEY_ERROR, 'g')}; batching on") in log
    assert "Context bound: none per request (--tq-max-context)" in log
    assert all(r is not None and r["status"] == 200 for r in replies), replies
    assert [serve.answer(r) for r in replies] == [serve.answer(r) for r in alone]
    tokens = [r["body"]["usage"]["completion_tokens"] for r in replies]
    assert tokens == [r["body"]["usage"]["completion_tokens"] for r in alone] and sum(tokens) >= 32
    # The prompts (over 90 tokens) outgrow the 16-token window: compressed rows, and all four in one batch.
    assert all(r["body"]["usage"]["prompt_tokens"] > 90 for r in replies)
    assert max(b["max_rows"] for b in batches) == 4 and sum(b["sequences"] for b in batches) == 4
    assert all(b["peak_kv_bytes"] > 0 for b in batches)
    assert wall < TIMEOUT


def test_an_over_long_request_is_refused_and_its_batch_is_unaffected(tmp_path):
    # The default bound is the model's trained context (max_position_embeddings 256 here; memory is no limit).
    model = save_tiny_model(tmp_path / "tiny", max_position_embeddings=256)
    valid = prompts(3, 60)
    long = prompts(1, 300)[0]
    with serve.Server("tq", model, TQ, tmp_path / "server.log", env=reference_blas_env(), start_timeout=90) as srv:
        alone = sequential(srv, valid, 100)
        n_prompt = alone[0]["body"]["usage"]["prompt_tokens"]
        at = srv.log_offset()
        _, replies = serve.concurrent(srv.port, [valid[0], long, valid[1], valid[2]], 100, TIMEOUT)
        batches = srv.batches_since(at)
        # The bound counts prompt + max_tokens: exactly at the limit is served, one token more is refused.
        edge = serve.chat(srv.port, valid[0], 256 - n_prompt, TIMEOUT)
        over = serve.chat(srv.port, valid[0], 257 - n_prompt, TIMEOUT)
        after = serve.chat(srv.port, valid[1], 100, TIMEOUT)  # the server goes on serving
    log = (tmp_path / "server.log").read_text()
    assert "Context bound: 256 tokens per request (the model's trained context)" in log

    refused = replies[1]
    assert refused["status"] == 400, refused
    error = refused["body"]["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert "maximum context length is 256 tokens" in error["message"] and "--tq-max-context" in error["message"]
    assert "100 in the completion" in error["message"]
    n_long = int(re.search(r"\(([\d,]+) in the prompt", error["message"]).group(1).replace(",", ""))
    assert n_long > 300 and f"you requested {n_long + 100:,} tokens" in error["message"]

    served = [replies[0], replies[2], replies[3]]
    assert all(r["status"] == 200 for r in served), served
    assert [serve.answer(r) for r in served] == [serve.answer(r) for r in alone]
    assert sum(b["sequences"] for b in batches) == 3  # the refused request never joined a batch

    assert edge["status"] == 200 and edge["body"]["usage"]["prompt_tokens"] == n_prompt
    assert over["status"] == 400 and f"you requested 257 tokens ({n_prompt} in the prompt" in \
        over["body"]["error"]["message"]
    assert after["status"] == 200 and serve.answer(after) == serve.answer(alone[1])


def test_the_bound_also_holds_for_requests_served_one_at_a_time(tmp_path):
    # --kv-bits (mlx-lm's affine cache) turns batching off: requests go through mlx_lm.server's _serve_single.
    model = save_tiny_model(tmp_path / "tiny")
    with serve.Server("tq", model, ["--kv-bits", "8", "--tq-max-context", "120"], tmp_path / "server.log",
                      env=reference_blas_env(), start_timeout=90) as srv:
        short = serve.chat(srv.port, prompts(1, 40)[0], 20, TIMEOUT)
        long = serve.chat(srv.port, prompts(1, 200)[0], 20, TIMEOUT)
    log = (tmp_path / "server.log").read_text()
    assert "Context bound: 120 tokens per request (--tq-max-context)" in log and "TurboQuant" not in log
    assert short["status"] == 200 and short["body"]["usage"]["prompt_tokens"] + 20 <= 120
    assert long["status"] == 400 and long["body"]["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 120 tokens" in long["body"]["error"]["message"]


# --- the default bound --------------------------------------------------------------------------------------

SMOLLM2_CONFIG = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536,
                  "max_position_embeddings": 8192, "torch_dtype": "float32"}


@pytest.mark.parametrize("config", [None, "tq"])
def test_max_context_is_the_largest_context_whose_planned_peak_fits(config):
    from tq_mlx import TurboQuantConfig

    cfg = TurboQuantConfig() if config else None
    weights = 538_000_000
    for ctx in (3000, 50_000):
        budget = estimate_peak_bytes(SMOLLM2_CONFIG, ctx, cfg, weights=weights)
        n = max_context(SMOLLM2_CONFIG, budget, cfg, weights=weights)
        assert estimate_peak_bytes(SMOLLM2_CONFIG, n, cfg, weights=weights) <= budget
        assert estimate_peak_bytes(SMOLLM2_CONFIG, n + 1, cfg, weights=weights) > budget
        assert n >= ctx
    assert max_context(SMOLLM2_CONFIG, weights // 2, cfg, weights=weights) == 0


def test_context_bound_is_the_trained_context_unless_memory_is_shorter(monkeypatch):
    import tq_mlx.planner.machine as machine

    assert context_bound(SMOLLM2_CONFIG, 538_000_000, None) == (8192, "the model's trained context")
    # A machine with room for the weights and about 3,000 tokens of the float cache's plan.
    budget = estimate_peak_bytes(SMOLLM2_CONFIG, 3000, None, weights=538_000_000)
    monkeypatch.setattr(machine, "available_memory", lambda: budget)
    limit, source = context_bound(SMOLLM2_CONFIG, 538_000_000, None)
    assert 3000 <= limit < 3100 and "planned peak fits in" in source
    # TurboQuant's smaller cache and flat transient fit the whole trained context in the same memory.
    from tq_mlx import TurboQuantConfig

    assert context_bound(SMOLLM2_CONFIG, 538_000_000, TurboQuantConfig())[0] == 8192
    # Weights alone beyond the memory: no bound (refusing every request would not help), and the log says why.
    monkeypatch.setattr(machine, "available_memory", lambda: 100_000_000)
    assert context_bound(SMOLLM2_CONFIG, 538_000_000, None)[0] is None


# --- bad requests over HTTP: one error shape (OpenAI's), the right status ---------------------------------------


def http(port: int, path: str, body: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (body None) or POST to the server."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw)  # every answer, errors too, is JSON


def test_bad_requests_get_openai_errors_with_the_right_status(tmp_path):
    import json

    model = save_tiny_model(tmp_path / "tiny", max_position_embeddings=256)
    # No Hugging Face cache folder at all (a fresh machine): /v1/models answered 200 with an empty body.
    env = dict(reference_blas_env(), HF_HOME=str(tmp_path / "no-hf-home"), HF_HUB_CACHE=str(tmp_path / "no-hub"))
    chat, text = "/v1/chat/completions", "/v1/completions"
    cases = [  # (path, body, status, param, words of the message)
        (chat, {"messages": []}, 400, "messages", "'messages' must be a non-empty list"),
        (chat, {"messages": "hello"}, 400, "messages", "'messages' must be a non-empty list"),
        (chat, {"messages": ["hello"]}, 400, "messages[0]", "'messages[0]' must be an object with a 'role'"),
        (chat, {"prompt": "no messages"}, 400, "messages", "'messages' must be a non-empty list"),
        (text, {"prompt": 5}, 400, "prompt", "'prompt' must be a non-empty string"),
        (text, {"prompt": "x" * 300, "max_tokens": 10}, 400, "prompt", "maximum context length is 256 tokens"),
        (chat, {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 10}, 400, "messages",
         "maximum context length is 256 tokens"),
        (chat, {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, None, "temperature"),
        (chat, ["not", "an", "object"], 400, None, "Request should be a JSON dictionary"),
        ("/v1/nothing-here", {}, 404, None, "no such endpoint: POST /v1/nothing-here"),
    ]
    with serve.Server("tq", model, TQ, tmp_path / "server.log", env=env, start_timeout=90) as srv:
        replies = [http(srv.port, path, json.dumps(body).encode()) for path, body, *_ in cases]
        broken = http(srv.port, chat, b"{not json")
        get_missing = http(srv.port, "/v1/nothing-here")
        models = http(srv.port, "/v1/models")
        fine = http(srv.port, chat, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 4}).encode())
    for (path, body, status, param, words), (got_status, reply) in zip(cases, replies):
        assert got_status == status, (path, body, got_status, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"}, reply
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, reply)
        assert words in error["message"], (body, reply)
    assert replies[5][1]["error"]["code"] == "context_length_exceeded"
    assert broken[0] == 400 and "Invalid JSON" in broken[1]["error"]["message"]
    assert get_missing[0] == 404 and get_missing[1]["error"]["code"] == "not_found"
    assert models[0] == 200 and models[1]["object"] == "list"
    assert [m["id"] for m in models[1]["data"]] == [str(model.resolve())]
    assert fine[0] == 200 and fine[1]["choices"][0]["message"]["role"] == "assistant"


def test_server_help_is_one_usage_block_with_the_turboquant_flags():
    import subprocess

    proc = subprocess.run([sys.executable, "-c", "from tq_mlx.cli.server import server_command; server_command()",
                           "--help"], capture_output=True, text=True, timeout=300, env=reference_blas_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage:") == 1 and proc.stdout.startswith("usage: tq-server")
    assert "TurboQuant KV cache:" in proc.stdout and "--tq-max-context N" in proc.stdout
    assert "--prompt-cache-size" in proc.stdout  # mlx_lm.server's own flags are all there
    # it describes tq-server, and its usage line shows the cache flags next to mlx_lm.server's
    usage, description = proc.stdout.split("\n\n")[:2]
    assert "MLX Http Server" not in proc.stdout and description.startswith("tq-server: an OpenAI-compatible")
    for flag in ("[--model MODEL]", "[--tq-preset NAME]", "[--tq-bits B]", "[--tq-window N]", "[--tq-max-context N]"):
        assert flag in usage, flag
