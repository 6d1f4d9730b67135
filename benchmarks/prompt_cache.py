"""Time to first token on a repeated long prefix, tq-server (TurboQuant prompt cache, memory and disk) against
mlx_lm.server (its float prompt cache, memory only), and the bytes each keeps per prefix.

For each prefix length (8k and 16k tokens by default: a system prompt of Britannica text, as a coding agent's system
prompt with tool definitions comes again with every request) and each server, alone on localhost with its default
cache settings (the default TurboQuant config; mlx-lm's float cache; --prompt-cache-size 10):

* cold: the prefix and a first question, nothing cached;
* memory hit: the same prefix and another question, the server still running;
* after a restart: the server stopped and started again, then the prefix and a third question. tq-server finds
  the prefix's compressed cache on disk (--tq-prompt-cache-dir, a fresh folder); mlx_lm.server starts cold.

Each request asks for one token (max_tokens 1), so its wall time is its time to first token. Each server first
answers a short warm-up request (first-call allocations). Bytes per prefix: the caches each server's prompt cache
held after the cold request, read inside the server (this script's --serve shim wraps the prompt cache's
insert_cache and prints each entry's tokens and nbytes; nothing else changes), and the files tq-server wrote.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/prompt_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: E402  (puts the repo on sys.path)
import serve  # noqa: E402

MARK = "prompt-cache-bench entry:"
QUESTIONS = ["Summarize the passage above in one sentence.", "Which places does the passage above name?",
             "Give the passage above a short title."]
PHASES = ("cold", "memory hit", "after a restart")
SERVERS = serve.SERVERS


# --- inside a server process ----------------------------------------------------------------------------------


def observe_entries() -> None:
    """Print, for every cache a server's prompt cache takes in, its tokens, type and bytes (held_bytes)."""
    import mlx_lm.models.cache as mlx_cache

    from tq_mlx.cache import held_bytes
    from tq_mlx.prompt_cache import lru as server_cache

    def wrap(cls):
        original = cls.insert_cache

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            nbytes = held_bytes(prompt_cache)
            print(f"{MARK} tokens={len(tokens)} nbytes={nbytes} type={cache_type}", file=sys.stderr, flush=True)
            return original(self, model, tokens, prompt_cache, cache_type=cache_type)

        cls.insert_cache = insert_cache

    wrap(mlx_cache.LRUPromptCache)
    wrap(server_cache.PromptCache)  # tq-server's (it does not call mlx-lm's)


def serve_observed(kind: str, argv: list[str]) -> int:
    observe_entries()
    return serve.serve(kind, argv)


# --- the client side --------------------------------------------------------------------------------------------


def system_chat(port: int, system: str, question: str, timeout: float) -> dict:
    """One greedy chat request for one token, the prefix as the system prompt: {'status', 'body', 'seconds'};
    RuntimeError if it is not answered."""
    r = serve.chat(port, question, 1, timeout, system=system)
    if r["status"] != 200:
        raise RuntimeError(f"HTTP {r['status']}: {str(r['body'])[:500]}")
    return r


class Observed(serve.Server):
    """serve.Server through this script's --serve shim."""

    def __init__(self, kind, model, args, log, start_timeout=300):
        import os
        import subprocess

        self.kind, self.log, self.port = kind, log, serve.free_port()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=common.REPO,
                                         env=dict(os.environ), start_new_session=True)
        try:
            self._wait(start_timeout)
        except BaseException:
            self.stop()
            raise

    def entries(self) -> list[dict]:
        return [{k: (int(v) if v.isdigit() else v) for k, v in re.findall(r"(\w+)=(\S+)", line)}
                for line in self.log.read_text(errors="replace").splitlines() if line.startswith(MARK)]


def wait_written(port: int, timeout: float) -> dict:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        s = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/prompt_cache", timeout=30).read())
        if s["disk"].get("pending_writes", 0) == 0:
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"the disk tier did not finish writing: {s}")
        time.sleep(0.5)


def run_length(kind: str, model: Path, system: str, warm_up: str, folder: Path, logs: Path, timeout: float) -> dict:
    """The three phases on one server kind for one prefix."""
    args = ["--max-tokens", "1"]
    if kind == "tq":  # no context bound: a 16k prefix is past SmolLM2's trained 8,192 tokens (timing and bytes only)
        args += ["--tq-prompt-cache-dir", str(folder), "--tq-max-context", "0"]
    out = {"requests": {}, "entries": [], "disk": None}
    with Observed(kind, model, args, logs / f"{kind}-1.log") as srv:
        serve.chat(srv.port, warm_up, 1, timeout)
        for phase, q in zip(PHASES[:2], QUESTIONS):
            out["requests"][phase] = system_chat(srv.port, system, q, timeout)
            if phase == "cold":
                time.sleep(0.5)
                out["entries"] = [e for e in srv.entries() if e["tokens"] > 64]
        if kind == "tq":
            out["disk"] = wait_written(srv.port, timeout)["disk"]
    with Observed(kind, model, args, logs / f"{kind}-2.log") as srv:
        serve.chat(srv.port, warm_up, 1, timeout)
        out["requests"][PHASES[2]] = system_chat(srv.port, system, QUESTIONS[2], timeout)
        if kind == "tq":
            out["hit"] = re.findall(r"Prompt cache: (memory hit|disk hit|miss)", srv.log.read_text())[-1]
    if kind == "tq":
        out["files"] = sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.name.endswith(".safetensors"))
    return out


def rows_of(raw: dict) -> list[dict]:
    rows = []
    for length, per in raw.items():
        for kind, r in per.items():
            for phase in PHASES:
                x = r["requests"][phase]
                usage = x["body"].get("usage", {})
                rows.append({"prefix": int(length), "server": kind, "phase": phase, "status": x["status"],
                             "ttft_s": x["seconds"], "prompt_tokens": usage.get("prompt_tokens"),
                             "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    return rows


def bytes_of(raw: dict) -> list[dict]:
    """Per prefix and server: the prompt cache's entries after the cold request (memory), and tq-server's files."""
    out = []
    for length, per in raw.items():
        for kind, r in per.items():
            entries = r["entries"]
            largest = max(entries, key=lambda e: e["tokens"]) if entries else None
            system = [e for e in entries if e["type"] == "system"]
            files = r.get("files") or []
            same = [size for name, size in files if largest and re.search(rf"--{largest['tokens']}-[0-9a-f]+\.", name)]
            out.append({"prefix": int(length), "server": kind,
                        "memory_entries": entries,
                        "memory_bytes": sum(e["nbytes"] for e in entries),
                        "request_cache": largest,
                        "system_cache": system[0] if system else None,
                        "disk_files": files,
                        "disk_bytes": same[0] if same else None,  # the request cache's own file
                        "disk_total_bytes": sum(size for _, size in files)})
    return out


TITLE = "Serving: a repeated long prefix (prompt cache)"
ALIGN = "llrrrrr"


def report(res: dict) -> tuple[list[str], list[list[str]], list[str]]:
    from tq_mlx.planner.display import format_bytes

    rows = {(r["prefix"], r["server"], r["phase"]): r for r in res["rows"]}
    by = {(b["prefix"], b["server"]): b for b in res["bytes"]}
    headers = ["prefix", "server", *(f"TTFT {p} (s)" for p in PHASES), "kept in memory", "kept on disk"]
    table = []
    for length in sorted({r["prefix"] for r in res["rows"]}):
        for kind in ("tq", "float"):
            b = by[(length, kind)]
            cells = []
            for p in PHASES:
                r = rows[(length, kind, p)]
                cells.append(f"{r['ttft_s']:.1f}" + (f" ({r['cached_tokens']:,} cached)" if r["cached_tokens"] else ""))
            request = b["request_cache"]
            mem = f"{format_bytes(request['nbytes'])} for {request['tokens']:,} tokens" if request else "–"
            disk = (format_bytes(b["disk_bytes"]) if b["disk_bytes"] else "–") if kind == "tq" else "– (no disk tier)"
            table.append([f"{length // 1024}k", SERVERS[kind], *cells, mem, disk])
    s = res["settings"]
    load = ", ".join(f"{x:.1f}" for x in res["meta"]["load_average"] or [])
    notes = [
        f"{s['model']} (float32 weights) on this machine's CPU back end; each server alone, default settings "
        f"(tq-server: {s['tq_config']}, and `--tq-max-context 0`: these prefixes reach past the model's trained "
        "8,192 tokens, so the answers do not matter here, the times and bytes do; mlx_lm.server: its float32 "
        "KVCache), `--max-tokens 1`: a request's wall time is its time to first token (TTFT), prefill included.",
        "The prefix is the system prompt (Britannica text), then a question: cold (nothing cached), memory hit "
        "(another question, same server), after a restart (a third question, the server stopped and started "
        "again: tq-server reads the prefix's compressed cache from its disk tier, mlx_lm.server prefills it "
        "again). 'cached' is the response's usage.prompt_tokens_details.cached_tokens.",
        "Kept in memory: the largest cache the server's prompt cache took in after the cold request (the prompt "
        "and the token answered), its nbytes read inside the server; mlx-lm also keeps a system-prompt cache "
        "until the request ends. Kept on disk: the size of tq-server's file of that cache (each cache it takes in "
        "is written once: the system prompt's and each request's, all of them in the results JSON).",
        f"The machine was shared with other jobs (load average {load} at the start): compare the servers within a "
        "row, not absolute speeds. A Mac's GPU prefills many times faster; the ratios are the point.",
    ]
    return headers, table, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: a 1k prefix")
    ap.add_argument("--lengths", default=None, help="comma list of prefix tokens (default 8192,16384)")
    ap.add_argument("--servers", default="tq,float", help="comma list of tq, float")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per request (default 7200; quick 600)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lengths = [int(x) for x in (args.lengths or ("1024" if args.quick else "8192,16384")).split(",")]
    timeout = args.timeout or (600 if args.quick else 7200)

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tests.support.real_models import SMOLLM2, prepare_model
    from tests.support.texts import britannica_text
    from tq_mlx import TurboQuantConfig
    from tq_mlx.planner.display import describe_config

    model = prepare_model(SMOLLM2, "float32")
    tok = load_tokenizer(model)
    ids = tok.encode(britannica_text())
    meta = common.metadata()
    raw: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for length in lengths:
            system = tok.decode(ids[:length])
            warm_up = tok.decode(ids[-200:])  # a short unrelated prompt
            raw[str(length)] = {}
            for kind in args.servers.split(","):
                t = time.perf_counter()
                folder = Path(tmp) / f"store-{length}"
                raw[str(length)][kind] = run_length(kind, model, system, warm_up, folder, Path(tmp), timeout)
                print(f"{length}: {SERVERS[kind]} {time.perf_counter() - t:.0f} s", flush=True)
    res = {"meta": meta,
           "settings": {"model": "SmolLM2-135M-Instruct", "lengths": lengths, "questions": QUESTIONS,
                        "tq_config": describe_config(TurboQuantConfig())},
           "rows": rows_of(raw), "bytes": bytes_of(raw),
           "hits": {length: per.get("tq", {}).get("hit") for length, per in raw.items()},
           "disk": {length: per.get("tq", {}).get("disk") for length, per in raw.items()}}
    headers, table, notes = report(res)
    print(common.text_table(headers, table, ALIGN))
    md = common.render(TITLE, meta, headers, table, notes, ALIGN)
    jp, mp = common.write_results("prompt_cache-quick" if args.quick else "prompt_cache", res, md, args.out)
    print(f"wrote {jp} and {mp}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        from tq_mlx.cli.flags import exit_without_teardown

        exit_without_teardown(serve_observed(sys.argv[2], sys.argv[3:]))
    main()
