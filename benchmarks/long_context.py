"""Quality at long context: PPL and KL(float ‖ cache) of the last 512 tokens at 1k-32k tokens (issues 14, 34).

For each model, text, context C and cache setting: the first C tokens of the text go through the cache in
`--chunk`-token chunks (512), so the last chunk, tokens C-512..C, attends to a past that is as compressed as
the setting makes it. On that last chunk:

  KL      mean over its 512 positions of KL(p_float ‖ p_cache), p = the model's next-token distribution;
          the float cache (mlx-lm KVCache) fed the same way is the reference. The headline: less noisy than PPL.
  PPL     exp(mean NLL) of its 512 next tokens; ΔPPL against the float cache.
  bits    bits/value on one accounting for every row (common.bits_per_value: bytes · 8 / (tokens · attention
          layers · kv heads · head_dim · 2)), float parts (float cache, sinks, window, affine scales) counted in
          float16, at the largest measured context and at 32k (TurboQuant rows: tq_mlx.planner.memory.estimate_kv_bytes).

The computation is causal and every cache here depends only on the tokens before it, so one pass over the
longest context gives every shorter one too: the chunk ending at 1k in a 4k pass is exactly the last chunk of a
1k run. One pass per (model, text, setting).

Settings (long_context_settings.py; keys for --settings in its BY_KEY; each TurboQuant row spells its config out in
the JSON and the notes): float; the default (TurboQuantConfig()) and the defaults before it; the compact and quality
presets; TurboQuant at other bits, windows, norms and decays; peers: mlx-lm QuantizedKVCache affine 4-bit and 8-bit
g64 (no window), "rotation + affine" (RotatedAffineCache below: a seeded random Hadamard rotation per layer and head
of keys and values, then mlx-lm affine 4-bit g64, with TurboQuant's 4 sinks and a float window of 768 or 128
tokens), mlx-vlm's TurboQuantKVCache (loaded as in quality.py, skipped with the reason if it cannot run) and
turboquant-mlx-full's TurboQuantKVCache (tqfull8v3: its recommended K8/V3; caches.tq_full; its sdist unpacked into the
tq-mlx cache, not installed: common.load_turboquant_mlx_full; skipped with the reason if it cannot run).
Needles (on --needle-models, SmolLM2 unless told): the default and float at --needles haystack lengths,
--needle-depths 0.1/0.5/0.9. Each finished probe is kept on disk (~/.cache/tq-mlx/needles) and a probe under way
saves its prefill every 10 minutes, so the same command resumes a 32k probe in a later session.

Texts (--texts; tests/support/texts.py's TEXTS): britannica (expository prose, the tuning text), hamlet (verse and
dialogue), kjv (archaic narrative prose), code; and two SET ASIDE (issue 53): manual (technical prose: the Debian Policy
Manual) and novel (prose fiction with dialogue: Austen's Northanger Abbey). Those two are not used to choose defaults
and are measured only at the end (their float passes may be cached earlier; nothing is tuned on their figures).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/long_context.py [--quick]

The table in docs/benchmarks.md joins many runs, each of some models, texts and settings, with --merge (rows of
the same model from several runs are joined); results/long_context.json's meta.runs records each run's command,
date and machine.

Work is done most important first (float, the default, K4/V4, the window rows, rotation + affine, ...; the first
text before the second); once --budget is spent the remaining passes are skipped and say so. The JSON is
rewritten after every pass, so a killed run leaves its partial results. The float pass's log-probs go to disk
(~/.cache/tq-mlx/logprobs) for every later run, and a float or TurboQuant pass saves its cache and figures there
every 10 minutes: the same command, run again after a stop, resumes each pass from there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import caches  # noqa: E402
import quality  # noqa: E402
from long_context_settings import (  # noqa: E402
    ALL, BY_KEY, DEFAULTS, FIRST, FLOAT, LONG, MODELS, QUICK, ROT_WINDOW, bits_at, config_text, parse_setting, replan)
from long_context_table import merge, render, write  # noqa: E402
from caches import Setting  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.layout import overflow  # noqa: E402
from tq_mlx.planner.memory import chosen_value_widths  # noqa: E402


# --- rotation + affine ------------------------------------------------------------------------------------------


def hadamard(d: int) -> mx.array:
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two")
    h = mx.array([[1.0]])
    while h.shape[0] < d:
        h = mx.concatenate([mx.concatenate([h, h], 1), mx.concatenate([h, -h], 1)], 0)
    return h / math.sqrt(d)


class RotatedAffineCache(KVCache):
    """"Rotation + affine": keys and values rotated by a seeded random Hadamard transform per head
    (H·diag(s), s = ±1 drawn per layer, head and side), then mlx-lm's affine quantization (mx.quantize, group 64),
    with float sinks and a float window managed like TurboQuant's (tq_mlx.layout.overflow: whole blocks of
    `block` tokens leave the window once it overflows).

    A quality model, not a memory one: it keeps the float buffer of KVCache and overwrites each compressed
    token with its quantized-dequantized value rotated back (attention on H·diag(s)k with the query rotated the
    same way gives the same scores, up to float rounding). Its bits/value come from the formula
    (long_context_settings.bits_at).
    """

    def __init__(self, layer: int, quant_bits: int = 4, group_size: int = 64, sinks: int = 4, window: int = 128,
                 block: int | None = None, rotate: bool = True, seed: int = 0):
        super().__init__()
        self.layer, self.quant_bits, self.group_size = layer, quant_bits, group_size
        self.n_sink, self.win, self.block = sinks, window, block or window
        self.rotate, self.seed = rotate, seed
        self.n_quant = 0  # tokens after the sinks already quantized
        self._rot = None

    def _signs(self, H: int, D: int):
        if self._rot is None:
            key = mx.random.key(self.seed * 100_003 + self.layer)
            sk, sv = mx.random.split(key)
            self._rot = (hadamard(D),
                         mx.where(mx.random.bernoulli(0.5, (1, H, 1, D), key=sk), 1.0, -1.0),
                         mx.where(mx.random.bernoulli(0.5, (1, H, 1, D), key=sv), 1.0, -1.0))
        return self._rot

    def _fake_quant(self, x: mx.array, signs: mx.array | None, h: mx.array) -> mx.array:
        dt = x.dtype
        y = x.astype(mx.float32)
        if self.rotate:
            y = (y * signs) @ h
        shape = y.shape
        q = mx.quantize(y.reshape(-1, shape[-1]), group_size=self.group_size, bits=self.quant_bits)
        y = mx.dequantize(*q, group_size=self.group_size, bits=self.quant_bits).reshape(shape)
        if self.rotate:
            y = (y @ h) * signs  # h is symmetric and orthonormal: its own inverse
        return y.astype(dt)

    def update_and_fetch(self, keys, values):
        super().update_and_fetch(keys, values)
        recent = max(0, self.offset - self.n_sink) - self.n_quant
        n = overflow(recent, self.win, self.block)
        if n:
            H, D = keys.shape[1], keys.shape[3]
            h, sk, sv = self._signs(H, D)
            a, b = self.n_sink + self.n_quant, self.n_sink + self.n_quant + n
            self.keys[:, :, a:b] = self._fake_quant(self.keys[:, :, a:b], sk, h)
            self.values[:, :, a:b] = self._fake_quant(self.values[:, :, a:b], sv, h)
            self.n_quant += n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


def make_cache(model: nn.Module, s: Setting) -> list:
    if s.kind == "rot":
        return [RotatedAffineCache(i, int(s.bits), window=ROT_WINDOW[s.name], block=DEFAULTS["compress_block"])
                for i in range(len(model.layers))]
    return caches.make_cache(model, s)


def protected_layers(cache: list) -> list[int]:
    """Attention layers (cache positions) whose keys protected themselves at calibration (stored at protect_bits)."""
    return [i for i, c in enumerate(cache) if getattr(c, "protected", False)]


def widened_layers(cache: list) -> list[list[float]]:
    """Attention layers (cache positions) whose keys took other bits than configured at calibration (key_error, key_output_error): [layer, bits]."""
    return [[i, c.key_bits] for i, c in enumerate(cache)
            if getattr(getattr(c, "key_stream", None), "widened", False)]


def value_layers(cache: list) -> list[list[float]]:
    """Attention layers (cache positions) whose values chose their bits by their error: the bits they decay to
    (value_error) or their width (value_output_error), [layer, bits]."""
    return [[i, w] for i, w in enumerate(chosen_value_widths(cache)) if w is not None]


# --- one pass -----------------------------------------------------------------------------------------------------


def text_names(arg: str) -> list[str]:
    """A --texts argument: names of tests/support/texts.py's TEXTS, comma-separated; an unknown one is refused."""
    from tests.support.texts import TEXTS

    names = arg.split(",")
    if unknown := [t for t in names if t not in TEXTS]:
        raise SystemExit(f"unknown text {unknown[0]!r}: --texts takes {','.join(TEXTS)}")
    return names


def text_ids(tokenizer, text: str, n: int) -> list[int]:
    from tests.support.texts import TEXTS

    body = TEXTS[text]()
    ids = tokenizer.encode(body[: 6 * n + 2000])
    if len(ids) < n:
        ids = tokenizer.encode(body)
    if len(ids) < n:
        raise RuntimeError(f"{text} has {len(ids)} tokens, {n} needed")
    return ids[:n]


class FloatReference:
    """The float pass's log-probs on each context's scored tokens, on disk: computed once per (model, text, context,
    chunk) and reused by every later run, since at 16k-32k the float pass alone takes most of an hour here.

    A context C's log-probs depend on the tokens up to C + 1 alone (the pass is causal), so each is keyed by the
    model, the chunking and a hash of those tokens: a 32k pass serves a later 4k run, and a changed tokenizer or
    text is a miss, never a stale hit. Each context is one float32 .npy (eval_tokens x vocab: 311 MB for Qwen at
    512 tokens) beside a JSON of the float row's figures; they are loaded one context at a time."""

    def __init__(self, model_key: str, text: str, ids: list[int], chunk: int, eval_tokens: int):
        from tests.support.real_models import cache_dir

        self.ids = ids
        self.dir = cache_dir() / "logprobs" / f"{model_key}-{text}-c{chunk}-e{eval_tokens}"

    def _name(self, c: int) -> str:
        return f"{c}-{caches.digest(self.ids[: c + 1])[:16]}"

    def has(self, contexts: list[int]) -> bool:
        return all((self.dir / f"{self._name(c)}.json").exists() for c in contexts)

    def row(self, contexts: list[int]) -> dict:
        return {c: json.loads((self.dir / f"{self._name(c)}.json").read_text()) for c in contexts}

    def __getitem__(self, c: int) -> mx.array:
        return mx.load(str(self.dir / f"{self._name(c)}.npy"))

    def partial(self, c: int, setting: Setting | None = None) -> Path:
        """Where a pass towards context c keeps its cache between sessions (run_pass, caches.Checkpoint): the float
        pass's named by the tokens alone, another setting's by its config too."""
        tag = "" if setting is None or setting.kind == "float" else f".{caches.digest(setting.to_dict())[:12]}"
        return self.dir / f"{self._name(c)}{tag}.partial.safetensors"

    def put(self, c: int, lp: mx.array, r: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = self._name(c)
        tmp = self.dir / f"{name}.tmp.npy"
        mx.save(str(tmp), lp)
        tmp.rename(self.dir / f"{name}.npy")
        (self.dir / f"{name}.json").write_text(json.dumps(r))  # written last: its presence means the pair is whole


def token_kl(ref: mx.array, lp: mx.array) -> mx.array:
    """KL(ref ‖ lp) of each scored token, from two (tokens, vocab) log-prob arrays."""
    return mx.sum(mx.exp(ref) * (ref - lp), axis=-1)


def run_pass(model, cache: list, ids: list[int], contexts: list[int], chunk: int, eval_tokens: int,
             reference: FloatReference | dict | None, store: FloatReference | None = None,
             checkpoint: caches.Checkpoint | None = None) -> tuple[dict, dict]:
    """Feed ids[:max(contexts)] through `cache` in chunks; at each context C, score the chunk ending at C.

    Returns ({C: {ppl, kl, kl_se, kl_max (the worst token's), ppl_delta_pct_se, bits_real}}, {C: float log-probs})
    (the log-probs only when reference is None: this is the float pass; with `store` they go to disk instead of
    memory).

    With `checkpoint` (at FloatReference.partial) the pass saves its cache and figures there every
    caches.CHECKPOINT_SECONDS and resumes from them: a pass to 32k on Qwen2.5-Coder-1.5B outlives a session here."""
    inputs = ids[: max(contexts)]
    cuts = sorted({*range(0, len(inputs), chunk), *(C - eval_tokens for C in contexts)})
    logps = {}
    start, out = checkpoint.resume(cache) if checkpoint is not None else (0, {})
    out = {int(C): r for C, r in out.items()}
    t0 = shown = time.perf_counter()
    for i, a in enumerate(cuts):
        if a < start:
            continue
        b = cuts[i + 1] if i + 1 < len(cuts) else len(inputs)
        if time.perf_counter() - shown > 60:  # progress for passes that take most of an hour
            shown = time.perf_counter()
            print(f"    ... {a}/{len(inputs)} tokens, {shown - t0:.0f} s", flush=True)
        logits = model(mx.array(inputs[a:b])[None], cache=cache)
        C = b if b in contexts and b - a == eval_tokens else None
        if C is None:
            caches.eval_cache(cache)
            if checkpoint is not None:
                checkpoint.save(cache, b, out)
            continue
        lp = nn.log_softmax(logits[0].astype(mx.float32), axis=-1)
        y = mx.array(ids[a + 1 : b + 1])
        nll = -mx.take_along_axis(lp, y[:, None], axis=-1)[:, 0]
        r = {"ppl": math.exp(mx.mean(nll).item())}
        if reference is None:
            mx.eval(lp)
            r["kl"], r["kl_se"] = 0.0, 0.0
            if store is None:
                logps[C] = lp
        else:
            kl = token_kl(reference[C], lp)
            mx.eval(kl)
            r["kl"] = kl.mean().item()
            r["kl_se"] = (mx.std(kl).item() / math.sqrt(kl.size))
            r["kl_max"] = kl.max().item()  # one token can move the mean (experiments/HISTORY.md)
            # ΔPPL is exp(the mean per-token Δnll) - 1; its standard error says how much of it 512 tokens can tell
            dnll = nll + mx.take_along_axis(reference[C], y[:, None], axis=-1)[:, 0]
            mean = mx.mean(dnll).item()
            r["ppl_delta_pct_se"] = 100 * math.exp(mean) * mx.std(dnll).item() / math.sqrt(dnll.size)
        caches.eval_cache(cache)
        r["bits_real"] = caches.bits_per_value(cache, b, caches.kv_geometry(_MODEL_CONFIG[0]))
        if reference is None and store is not None:
            store.put(C, lp, r)
        out[C] = r
    if checkpoint is not None:
        checkpoint.done()
    return out, logps


_MODEL_CONFIG: list = [None]


# --- the run ------------------------------------------------------------------------------------------------------


def replan_file(path: Path) -> None:
    """long_context_settings.replan for every model of a results file (their config.json from real_models), its
    .md table written again."""
    from tests.support import real_models

    results = json.loads(path.read_text())
    for key, m in results["models"].items():
        n = replan(m, load_model_config(getattr(real_models, MODELS[key][2])()))
        print(f"{key}: {n} planned figures changed")
    jp, mp = write(results, path.stem, path.parent)
    print(f"wrote {jp} and {mp}")


def plan(settings: list[Setting], texts: list[str]) -> list[tuple[str, Setting]]:
    first, rest = settings[:FIRST], settings[FIRST:]
    return [(t, s) for t in texts for s in first] + [(t, s) for t in texts for s in rest]


def run_model(key: str, args, budget: common.Budget, results: dict, save) -> None:
    from tests.support import real_models

    label, loader, path_fn = MODELS[key]
    t0 = time.perf_counter()
    model, tok = getattr(real_models, loader)(mx.float32)
    mcfg = load_model_config(getattr(real_models, path_fn)())
    _MODEL_CONFIG[0] = mcfg
    n_att, H, D = caches.kv_geometry(mcfg)
    contexts = args.contexts_for(key)
    settings = [parse_setting(k) for k in args.settings.split(",")] if args.settings else QUICK if args.quick else ALL
    if settings[0] is not FLOAT:
        settings = [FLOAT, *[x for x in settings if x is not FLOAT]]
    m = results["models"][key] = {
        "model": label, "contexts": contexts, "chunk": args.chunk, "eval_tokens": args.eval_tokens,
        "geometry": {"attention_layers": n_att, "kv_heads": H, "head_dim": D}, "texts": args.texts,
        "rows": [{"setting": s.name, **s.to_dict(),
                  **({"config_text": config_text(s.config)} if s.config is not None else {}),
                  "bits": {str(c): bits_at(s, mcfg, c) for c in contexts}, "bits_32k": bits_at(s, mcfg, LONG),
                  "texts": {}} for s in settings],
    }
    print(f"\n{label}: {n_att} layers, {H} kv heads, head_dim {D}; contexts {contexts}, last {args.eval_tokens} "
          f"tokens in {args.chunk}-token chunks (loaded in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows = {r["setting"]: r for r in m["rows"]}
    refs: dict[str, dict] = {}
    for text, s in plan(settings, args.texts):
        row = rows[s.name]
        if s.kind == "peer" and caches.peer_of(s).module is None:
            row["error"] = caches.peer_of(s).reason
            continue
        if text not in refs and s.kind != "float":
            row["texts"][text] = {"error": "skipped: no float reference"}
            continue
        if budget.over():
            row["texts"][text] = {"error": "skipped: time budget spent"}
            print(f"  {text} {s.name}: skipped (budget)", flush=True)
            continue
        t = time.perf_counter()
        try:
            ids = text_ids(tok, text, max(contexts) + 1)
            stored = FloatReference(key, text, ids, args.chunk, args.eval_tokens)
            if s.kind == "float" and stored.has(contexts) and not args.no_float_cache:
                res, protected, widths = stored.row(contexts), [], {}
                print(f"  {text} float: from {stored.dir}", flush=True)
            else:
                cache = make_cache(model, s)
                res, _ = run_pass(model, cache, ids, contexts, args.chunk, args.eval_tokens, refs.get(text),
                                  store=stored if s.kind == "float" else None,
                                  checkpoint=caches.Checkpoint(stored.partial(max(contexts), s), caches.pass_code(s))
                                  if s.kind in ("float", "tq") else None)
                protected, widths, values = protected_layers(cache), widened_layers(cache), value_layers(cache)
                del cache
            if s.kind == "float":
                refs[text] = stored
            cell = {str(c): r for c, r in res.items()}
            if s.kind == "tq":
                cell["protected_layers"] = protected
                if widths:
                    cell["key_widths"] = widths
                if values:
                    cell["value_widths"] = values
        except Exception as e:  # a setting that cannot run is a cell with its reason, not a crashed benchmark
            cell = {"error": f"{type(e).__name__}: {e}"[:200]}
        cell["seconds"] = round(time.perf_counter() - t, 1)
        row["texts"][text] = cell
        if s.kind == "peer":
            row["bits_measured_peer"] = {c: r.get("bits_real") for c, r in cell.items() if isinstance(r, dict)}
        summary = ", ".join(f"@{c}: KL {r['kl']:.4f} ppl {r['ppl']:.2f}" for c, r in cell.items() if isinstance(r, dict))
        print(f"  {text} {s.name}: {summary or cell.get('error')} ({cell['seconds']} s)", flush=True)
        _deltas(m)
        save()
    m["seconds"] = round(time.perf_counter() - t0, 1)


def run_needles(key: str, args, budget: common.Budget, results: dict, save) -> None:
    """The needle probes of quality.py (a magic number at depths 0.1/0.5/0.9 of a Britannica haystack, greedy
    answer) at args.needle_lengths, for args.needle_settings (float and the default unless told), on the model
    already loaded by run_model."""
    from tests.support import real_models
    from tests.support.real_models import cache_dir

    if not args.needle_lengths:
        return
    label, loader, _ = MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    m = results["models"][key]
    m["needles"] = out = []
    for length in args.needle_lengths:
        for s in args.needle_settings:
            for depth in args.needle_depths:
                if budget.over():
                    out.append({"setting": s.name, "length": length, "depth": depth, "error": "skipped: time budget spent"})
                    continue
                r = quality.needle_probe(model, tok, s, length, depth, args.chunk, store=cache_dir() / "needles" / key)
                # the config names the probe's setting when a later default renames it (long_context_table.merge)
                out.append({"setting": s.name, **({"config": s.config.to_dict()} if s.config else {}), **r})
                print(f"  needle {s.name} @{length} depth {depth}: {'hit' if r['hit'] else 'MISS'} "
                      f"({r['answer'][:40]!r}, {r['seconds']} s{', from disk' if r.get('from_disk') else ''})", flush=True)
                save()


def needle_depths(text: str) -> tuple[float, ...]:
    """--needle-depths: fractions of the haystack strictly between 0 and 1, comma-separated."""
    try:
        depths = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        depths = ()
    if not depths or not all(0 < d < 1 for d in depths):
        raise SystemExit(f"--needle-depths must be fractions strictly between 0 and 1, e.g. 0.1,0.5,0.9; got {text!r}")
    return depths


def _deltas(m: dict) -> None:
    base = next(r for r in m["rows"] if r["kind"] == "float")
    for r in m["rows"]:
        for text, cell in r["texts"].items():
            ref = base["texts"].get(text, {})
            for c, x in cell.items():
                if isinstance(x, dict) and isinstance(ref.get(c), dict):
                    x["ppl_delta_pct"] = 100 * (x["ppl"] / ref[c]["ppl"] - 1)


def main() -> None:
    from tests.support.texts import TEXTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: SmolLM2, contexts 1024/1152, 128-token chunks, 5 settings, no needles")
    ap.add_argument("--models", default="smollm2,qwen05,qwen15", help="comma list of smollm2,qwen05,qwen15")
    ap.add_argument("--texts", default="britannica,hamlet", help=f"comma list of {','.join(TEXTS)} (kjv: apt-get "
                    "install bible-kjv; manual and novel are set aside: measured only at the end)")
    ap.add_argument("--contexts", default=None, help="SmolLM2 contexts (default 1024,2048,4096,8192)")
    ap.add_argument("--qwen-contexts", default=None, help="Qwen2.5-Coder-0.5B contexts (default 1024,2048,4096)")
    ap.add_argument("--qwen15-contexts", default="1024,2048", help="Qwen2.5-Coder-1.5B contexts")
    ap.add_argument("--settings", default=None, help=f"comma list of {','.join(BY_KEY)} (default: all, in that "
                    "order; float is always run first, as the reference), or spelled out: "
                    "k<K>v<V>w<window>b<block>[...] (long_context_settings.parse_setting), rot<bits>w<window>, "
                    "peer<bits> (mlx-vlm), tqfull<K>v<V>[m<float16 tokens>] (turboquant-mlx-full)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens fed at a time (default 512; quick 128)")
    ap.add_argument("--eval-tokens", type=int, default=None,
                    help="tokens scored at the end of each context, fed as one chunk after the others (default: "
                         "the chunk; at most the chunk)")
    ap.add_argument("--needles", default="4096,8192", help="needle haystack lengths ('' for none)")
    ap.add_argument("--needle-models", default="smollm2", help="models probed with needles (of --models; default smollm2)")
    ap.add_argument("--needle-settings", default="float,default",
                    help="settings probed with needles (keys as --settings; default float,default)")
    ap.add_argument("--needle-depths", default="0.1,0.5,0.9",
                    help="where the needle sits, as fractions of the haystack strictly between 0 and 1")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run; later passes are skipped")
    ap.add_argument("--no-peers", action="store_true", help="do not try the peers from PyPI (mlx-vlm, "
                    "turboquant-mlx-full)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--no-float-cache", action="store_true",
                    help="run the float pass even when its log-probs are on disk (~/.cache/tq-mlx/logprobs)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join runs of different models")
    ap.add_argument("--replan", default=None, metavar="JSON",
                    help="price the TurboQuant rows of a results file again with the planner as it is now (their "
                         "planned bits/value; what the runs measured stands) and write it back")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    if args.replan:
        return replan_file(Path(args.replan))
    q = args.quick
    if q:
        args.models = "smollm2"
    args.chunk = args.chunk or (128 if q else 512)
    args.eval_tokens = args.eval_tokens or args.chunk
    if not 0 < args.eval_tokens <= args.chunk:
        raise SystemExit(f"--eval-tokens {args.eval_tokens}: from 1 to the chunk ({args.chunk})")
    sm = [int(x) for x in (args.contexts or ("1024,1152" if q else "1024,2048,4096,8192")).split(",")]
    qw = [int(x) for x in (args.qwen_contexts or "1024,2048,4096").split(",")]
    qw15 = [int(x) for x in args.qwen15_contexts.split(",")]
    args.contexts_for = lambda key: {"smollm2": sm, "qwen15": qw15}.get(key, qw)
    args.texts = text_names(args.texts)
    args.needle_lengths = [] if q else [int(x) for x in args.needles.split(",") if x]
    args.needle_depths = needle_depths(args.needle_depths)
    args.needle_settings = [parse_setting(k) for k in args.needle_settings.split(",") if k]
    models = args.models.split(",")
    args.needle_models = [k for k in args.needle_models.split(",") if k]
    if unknown := [k for k in args.needle_models + models if k not in MODELS]:
        raise SystemExit(f"unknown model {unknown[0]!r}: --models and --needle-models take {','.join(MODELS)}")
    if args.needle_lengths and (idle := [k for k in args.needle_models if k not in models]):
        raise SystemExit(f"--needle-models {idle[0]} is not in --models {args.models}: needles probe a model that runs")
    for key in models:  # only the models that run: another model's default contexts do not refuse the command
        if bad := [c for c in args.contexts_for(key) if c % args.chunk]:
            raise SystemExit(f"{key}: context {bad[0]} is not a multiple of the chunk {args.chunk}")

    from tests.support.real_models import blas_hint

    if hint := blas_hint():
        print(f"hint: {hint}", file=sys.stderr)
    t0 = time.perf_counter()
    budget = common.Budget(args.budget)
    wanted = not args.no_peers and not q
    peers = {caches.MLX_VLM: caches.load_peer(wanted), caches.TQ_FULL: caches.load_peer(wanted, caches.TQ_FULL)}
    for name, peer in peers.items():
        print(f"peer {name}: {'version ' + peer.version if peer.module else peer.reason}", flush=True)
    results = {"meta": common.metadata(), "eval_tokens": args.eval_tokens,
               "peers": {name: {"version": p.version, "runs": p.module is not None, "reason": p.reason}
                         for name, p in peers.items()},
               "models": {}}
    name = "long_context-quick" if q else "long_context"

    def save():
        results["seconds"] = round(time.perf_counter() - t0, 1)
        write(results, name, args.out)

    for key in models:
        run_model(key, args, budget, results, save)
        if key in args.needle_models:
            run_needles(key, args, budget, results, save)
    save()
    print()
    print(render(results))
    print(f"\nwrote {name}.json/.md ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
