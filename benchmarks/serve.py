"""Load test of tq-server against mlx_lm.server on localhost: N concurrent greedy chat requests, side by side.

Each server runs alone, as a subprocess on a free localhost port (killed at the end in every case), with the same
model and flags, the prompt cache off (`--prompt-cache-size 0`, so that no phase reuses another's prefill). For
each server: the prompts one at a time (the reference answers and the sequential throughput), then N = 1, 4, 8
clients at once (temperature 0, fixed max_tokens, distinct prompts of a few hundred tokens). Per N: wall time,
aggregate generated tokens/s, its ratio to the same prompts one at a time, how many answers equal their
sequential answer, and the KV bytes the server's batch held at its peak.

KV bytes are measured inside each server process: both run under this script's `--serve` shim, which wraps
mlx-lm's BatchGenerator.next (both servers batch through it) to read the batch caches' own `nbytes` after every
step and print one line per busy period (peak bytes, most rows at once). Nothing else in the servers changes.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/serve.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import common  # noqa: E402  (puts the repo on sys.path)

MARK = "serve-bench batch:"
QUESTION = "Summarize the passage above in one sentence."


# --- inside a server process ----------------------------------------------------------------------------------


def observe_batches() -> None:
    """Make mlx-lm's BatchGenerator print, each time its batch empties, the peak KV bytes its caches held (held_bytes:
    their `nbytes`, shared constants once, read after every step; no host sync), the most sequences it held at once
    and how many it served."""
    from mlx_lm.generate import BatchGenerator

    from tq_mlx.cache import held_bytes

    original = BatchGenerator.next
    busy = {"bytes": 0, "rows": 0, "steps": 0, "uids": set()}

    def next(self):
        out = original(self)
        uids = [*self._prompt_batch.uids, *self._generation_batch.uids, *(s[0] for s in self._unprocessed_sequences)]
        if uids:
            held = held_bytes([c for b in (self._prompt_batch, self._generation_batch) for c in b.prompt_cache])
            busy.update(bytes=max(busy["bytes"], held), rows=max(busy["rows"], len(uids)), steps=busy["steps"] + 1)
            busy["uids"].update(uids)
        elif busy["steps"]:
            print(f"{MARK} peak_kv_bytes={busy['bytes']} max_rows={busy['rows']} sequences={len(busy['uids'])} "
                  f"steps={busy['steps']}", file=sys.stderr, flush=True)
            busy.update(bytes=0, rows=0, steps=0, uids=set())
        return out

    BatchGenerator.next = next


def serve(kind: str, argv: list[str]) -> int:
    """Run tq-server ('tq') or mlx_lm.server ('float') with `argv`, batches observed."""
    observe_batches()
    if kind == "tq":
        from tq_mlx.cli.server import server_main

        return server_main(argv)
    import mlx_lm.server as server

    sys.argv = ["mlx_lm.server", *argv]
    server.main()
    return 0


# --- the client side --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on a free localhost port; a context manager that always kills it."""

    def __init__(self, kind: str, model: Path, args: list[str], log: Path, env: dict | None = None,
                 start_timeout: float = 180):
        self.kind, self.log, self.port = kind, log, free_port()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=common.REPO, env=env,
                                         start_new_session=True)
        try:
            self._wait(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited early:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.kind} server did not start:\n{self.log.read_text()[-3000:]}")
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_offset(self) -> int:
        return self.log.stat().st_size

    def batches_since(self, offset: int) -> list[dict]:
        """The observer's busy-period lines logged after `offset`."""
        with open(self.log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                for line in text.splitlines() if line.startswith(MARK)]


def chat(port: int, content: str, max_tokens: int, timeout: float, system: str | None = None) -> dict:
    """One greedy chat completion: {'status', 'body', 'seconds'} (body = the reply or error JSON); `system`, a
    system prompt before the user's message."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": content}]
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return {"status": status, "body": json.loads(raw), "seconds": time.perf_counter() - t}


def concurrent(port: int, contents: list[str], max_tokens: int, timeout: float) -> tuple[float, list[dict | None]]:
    """Send every content at once (one thread each, released together); (wall seconds, replies in order).
    A reply is None if its thread did not finish within `timeout`."""
    replies: list[dict | None] = [None] * len(contents)
    gate = threading.Barrier(len(contents) + 1)

    def one(i: int) -> None:
        gate.wait()
        try:
            replies[i] = chat(port, contents[i], max_tokens, timeout)
        except OSError as e:
            replies[i] = {"status": None, "body": {"error": str(e)}, "seconds": None}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(contents))]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=timeout + 5)
    return time.perf_counter() - t0, replies


def answer(reply: dict | None) -> str | None:
    if reply is None or reply["status"] != 200:
        return None
    return reply["body"]["choices"][0]["message"]["content"]


def completion_tokens(replies: list[dict | None]) -> int:
    return sum(r["body"]["usage"]["completion_tokens"] for r in replies if r and r["status"] == 200)


# --- the benchmark ----------------------------------------------------------------------------------------------


def passages(tok, n: int, tokens: int) -> list[str]:
    """n distinct passages of the Britannica article of about `tokens` tokens each, with a question."""
    from tests.support.texts import britannica_text

    ids = tok.encode(britannica_text())
    step = len(ids) // (n + 1)
    return [f"{tok.decode(ids[i * step: i * step + tokens])}\n\n{QUESTION}" for i in range(n)]


def run_server(kind: str, model: Path, args: list[str], prompts: list[str], warm_up: str, ns: list[int],
               max_tokens: int, timeout: float, log: Path) -> dict:
    """One server: a warm-up request, the prompts one at a time, then the first N of them at once for each N."""
    out = {"sequential": [], "concurrent": {}}
    with Server(kind, model, args, log) as srv:
        chat(srv.port, warm_up, max_tokens, timeout)  # first-call allocations at these sizes, not timed
        for p in prompts:
            at = srv.log_offset()
            r = chat(srv.port, p, max_tokens, timeout)
            time.sleep(0.2)  # the observer's line is printed before the reply is sent; let the file catch up
            out["sequential"].append({"reply": r, "batches": srv.batches_since(at)})
        for n in ns:
            at = srv.log_offset()
            wall, replies = concurrent(srv.port, prompts[:n], max_tokens, timeout)
            time.sleep(0.2)
            out["concurrent"][str(n)] = {"wall": wall, "replies": replies, "batches": srv.batches_since(at)}
    return out


def summarize(raw: dict, ns: list[int]) -> list[dict]:
    """Table rows (one per server and phase) from run_server's output."""
    rows = []
    for kind, r in raw.items():
        seq = r["sequential"]
        ref = [answer(s["reply"]) for s in seq]
        seq_tokens = [s["reply"]["body"]["usage"]["completion_tokens"] for s in seq]
        seq_seconds = [s["reply"]["seconds"] for s in seq]
        rows.append(dict(
            server=kind, n="sequential", requests=len(seq), answered=sum(a is not None for a in ref),
            wall=sum(seq_seconds), tokens=sum(seq_tokens), tok_s=sum(seq_tokens) / sum(seq_seconds),
            vs_sequential=1.0, equal=None,
            kv_peak=max(b["peak_kv_bytes"] for s in seq for b in s["batches"]),
            max_rows=max(b["max_rows"] for s in seq for b in s["batches"]),
        ))
        seq_rate = sum(seq_tokens) / sum(seq_seconds)  # every prompt (same length): steadier than the first N
        for n in ns:
            c = r["concurrent"][str(n)]
            got = [answer(x) for x in c["replies"]]
            tokens = completion_tokens(c["replies"])
            tok_s = tokens / c["wall"]
            rows.append(dict(
                server=kind, n=n, requests=n, answered=sum(a is not None for a in got), wall=c["wall"],
                tokens=tokens, tok_s=tok_s, vs_sequential=tok_s / seq_rate,
                equal=sum(a is not None and a == b for a, b in zip(got, ref)),
                kv_peak=max((b["peak_kv_bytes"] for b in c["batches"]), default=None),
                max_rows=max((b["max_rows"] for b in c["batches"]), default=None),
            ))
    return rows


SERVERS = {"tq": "tq-server", "float": "mlx_lm.server"}
TITLE = "Serving: concurrent clients"
ALIGN = "llrrrrrrrr"


def report(res: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """(headers, rows, notes) of the markdown table, from the saved JSON."""
    from tq_mlx.planner.display import format_bytes

    s = res["settings"]
    load = ", ".join(f"{x:.1f}" for x in res["meta"]["load_average"] or [])
    low, high = min(s["prompt_tokens"]), max(s["prompt_tokens"])
    lengths = str(low) if low == high else f"{low}-{high}"
    float_kv = {r["n"]: r["kv_peak"] for r in res["rows"] if r["server"] == "float"}
    headers = ["clients", "server", "wall s", "tokens", "tokens/s", "vs one at a time", "answers = one at a time",
               "KV held (peak)", "KV vs float", "most in batch"]
    rows = []
    for r in sorted(res["rows"], key=lambda r: (r["n"] != "sequential", str(r["n"]).zfill(3), r["server"] != "tq")):
        clients = f"{r['requests']} one at a time" if r["n"] == "sequential" else str(r["n"])
        equal = "–" if r["equal"] is None else f"{r['equal']}/{r['requests']}"
        if r["answered"] < r["requests"]:
            equal += f" ({r['requests'] - r['answered']} unanswered)"
        kv_ratio = (f"{r['kv_peak'] / float_kv[r['n']]:.2f}x" if r["kv_peak"] and float_kv.get(r["n"]) else "–")
        rows.append([clients, SERVERS[r["server"]], common.fmt(r["wall"], 1), r["tokens"], common.fmt(r["tok_s"], 1),
                     common.fmt(r["vs_sequential"], 2, "x"), equal,
                     format_bytes(r["kv_peak"]) if r["kv_peak"] else "–", kv_ratio, r["max_rows"] or "–"])
    notes = [
        f"{s['model']} (float32 weights), each server alone on localhost with `{' '.join(s['common_args'])}`; "
        f"tq-server adds `{' '.join(s['tq_args'])}` ({s['tq_config']}): with this small window TurboQuant "
        "compresses every token but the 4 sinks and the last window's worth (the default window, 768, would hold "
        "these prompts in float).",
        f"{len(s['prompt_tokens'])} distinct prompts of {lengths} tokens "
        f"(passages of the 1911 Britannica article and '{QUESTION}'), greedy (temperature 0), max_tokens "
        f"{s['max_tokens']}, after one untimed warm-up request. 'one at a time': every prompt in turn (the "
        "reference answers); N: the first N prompts "
        "sent at once by N client threads; tokens/s = completion tokens / wall time; 'vs one at a time' = that "
        "against the same server's one-at-a-time rate over every prompt.",
        "KV held: the peak of the batch caches' own nbytes while the requests ran, read inside the server after "
        "every step (mlx-lm's BatchGenerator, which both servers batch with); mlx-lm's float batch cache holds "
        "padding and grows in 256-token steps, TurboQuant's holds each row's codes and float window only.",
        "Answers: the concurrent answer's text against the same server's one-at-a-time answer. With OpenBLAS, "
        "a row of a batch rounds differently from the sequence alone (~1e-5, mlx-lm's float cache too); "
        "TurboQuant turns some of those differences into other codes, so its greedy answers part at near-ties "
        "more often than the float cache's. On MLX's own BLAS its rows equal their sequences alone "
        "(docs/commands.md, Batching; tests/test_serve.py checks 4 concurrent clients against their sequential answers).",
        f"The machine was shared with other jobs (load average {load} at the start): compare the two servers "
        "within a row group, not absolute speeds.",
    ]
    return headers, rows, notes


def requests_of(r: dict) -> dict:
    """Per request: status, prompt and completion tokens, seconds (one at a time, then per N)."""
    def one(x: dict | None) -> dict | None:
        if x is None:
            return None
        usage = x["body"].get("usage", {})
        return {"status": x["status"], "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"), "seconds": x["seconds"]}

    return {"sequential": [one(s["reply"]) for s in r["sequential"]],
            **{n: [one(x) for x in c["replies"]] for n, c in r["concurrent"].items()}}


def prompt_token_counts(raw: dict) -> list[int]:
    return [s["reply"]["body"]["usage"]["prompt_tokens"] for s in raw["tq"]["sequential"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: 2 short prompts, N = 1, 2, 8 new tokens")
    ap.add_argument("--clients", default=None, help="comma list of N (default 1,4,8; quick 1,2)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="passage tokens per prompt (default 320; quick 48)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 48; quick 8")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per request (default 900; quick 120)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl+C, so that the server subprocess is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    q = args.quick
    ns = [int(x) for x in (args.clients or ("1,2" if q else "1,4,8")).split(",")]
    prompt_tokens = args.prompt_tokens or (48 if q else 320)
    max_tokens = args.max_tokens or (8 if q else 48)
    timeout = args.timeout or (120 if q else 900)
    window, block = ("16", "8") if q else ("128", "64")
    tq_args = ["--tq-window", window, "--tq-compress-block", block]
    common_args = ["--prompt-cache-size", "0", "--max-tokens", str(max_tokens)]

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tests.support.real_models import SMOLLM2, prepare_model
    from tq_mlx.planner.display import describe_config
    from tq_mlx.cli.flags import add_cache_args, config_from_args

    model = prepare_model(SMOLLM2, "float32")  # float16 matmuls bypass BLAS on a CPU
    *prompts, warm_up = passages(load_tokenizer(model), max(ns) + 1, prompt_tokens)
    tq_config = config_from_args(add_cache_args(argparse.ArgumentParser()).parse_args(tq_args))
    meta = common.metadata()
    raw = {}
    with tempfile.TemporaryDirectory() as logs:  # the servers' logs: read here, not results
        for kind, extra in (("tq", tq_args), ("float", [])):
            t = time.perf_counter()
            raw[kind] = run_server(kind, model, [*common_args, *extra], prompts, warm_up, ns, max_tokens, timeout,
                                   Path(logs) / f"{kind}.log")
            print(f"{SERVERS[kind]}: {time.perf_counter() - t:.0f} s", flush=True)
    rows = summarize(raw, ns)
    res = {
        "meta": meta,
        "settings": {"model": "SmolLM2-135M-Instruct", "clients": ns, "max_tokens": max_tokens,
                     "prompt_tokens": prompt_token_counts(raw), "common_args": common_args, "tq_args": tq_args,
                     "tq_config": describe_config(tq_config) + f", compress block {tq_config.compress_block_size}",
                     "timeout": timeout},
        "rows": rows,
        "answers": {k: [answer(s["reply"]) for s in r["sequential"]] for k, r in raw.items()},
        "requests": {k: requests_of(r) for k, r in raw.items()},
    }
    headers, table, notes = report(res)
    print(common.text_table(headers, table, ALIGN))
    md = common.render(TITLE, meta, headers, table, notes, ALIGN)
    jp, mp = common.write_results("serve-quick" if q else "serve", res, md, args.out)
    print(f"wrote {jp} and {mp}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        from tq_mlx.cli.flags import exit_without_teardown

        exit_without_teardown(serve(sys.argv[2], sys.argv[3:]))
    main()
