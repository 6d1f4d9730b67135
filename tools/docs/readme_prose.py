"""The numbers in README.md's prose: each one outside the generated blocks and code is a figure (FIGURES: the
sentence with {} for each number, and the function that computes them from tq_mlx, the configs and
benchmarks/results) or one of a few ALLOWED non-results (versions, model names, a CLI example). readme_tables.py's
--check names a stale figure and any number that is neither (uncovered_numbers: a figure typed by hand); --write
puts each figure's value in. The generated blocks' markers live here too: a number inside one is not the prose's."""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

# the docs scripts beside this one, then the benchmarks' modules they render
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "benchmarks")]

import common  # noqa: E402
import defaults_figures  # noqa: E402  (its figures and its markdown helpers)

START = "<!-- benchmark-results:start -->"
END = "<!-- benchmark-results:end -->"
HEADLINE_START = "<!-- headline-results:start -->"
HEADLINE_END = "<!-- headline-results:end -->"
PATHS_START = "<!-- path-results:start -->"
PATHS_END = "<!-- path-results:end -->"
# the contexts the README's memory headline prices
HEADLINE_CONTEXTS = (32768, 131072)


class Reword(Exception):
    """The code no longer fits a figure's words (a preset now decays, a list grew): reword the sentence."""


class Figure(NamedTuple):
    """A README sentence whose numbers are computed. text: the README's words with {} where each number stands
    (whitespace matches any line break); values(): those numbers as the README spells them, now; names(): words
    the paragraph must also hold (the architectures a count counts)."""

    name: str
    text: str
    values: Callable[[], tuple]
    names: Callable[[], Iterable[str]] | None = None


REFERENCE_MODEL = "Llama-3.1-8B"  # the model (benchmarks/configs, the memory table) the per-model prose figures use


@functools.cache
def _model_config(name: str = REFERENCE_MODEL) -> dict:
    import plots

    return next(m["config"] for m in plots.user_models() if m["name"] == name)


def _bits_per_value(config, ctx: int, name: str = REFERENCE_MODEL) -> float:
    """Bits per value of a TurboQuantConfig at ctx tokens on a model, float parts in float16 (as long_context.py
    counts them)."""
    import caches
    from tq_mlx.planner.memory import estimate_kv_bytes

    mc = _model_config(name)
    return common.bits_per_value(estimate_kv_bytes(mc, ctx, config, dtype="float16"), ctx, caches.kv_geometry(mc))


def _ctx(c: int) -> str:
    return f"{c // 1024}k" if c % 1024 == 0 else f"{c:,}"


def _bits(b) -> str:
    from tq_mlx.quant.quantizer import format_bits

    return format_bits(b)


def _label(c) -> str:
    from tq_mlx.config import bits_label

    return bits_label(c.key_bits, c.value_bits)


def _decayed_label(c) -> str:
    from tq_mlx.config import bits_label

    return bits_label(*c.decayed_bits)


def intro_values() -> tuple:
    """How many times more tokens fit in float16's memory at 32k, the least over the memory table's models."""
    from tq_mlx import TurboQuantConfig
    from tq_mlx.planner.memory import estimate_kv_bytes
    import plots

    ctx = HEADLINE_CONTEXTS[0]
    ratio = min(estimate_kv_bytes(m["config"], ctx) / estimate_kv_bytes(m["config"], ctx, TurboQuantConfig())
                for m in plots.user_models())
    return f"{ratio:.0f}", _ctx(ctx)


HEADLINE_MODEL = ("qwen15", "Qwen2.5-Coder-1.5B")  # the real model whose measured widths the headline gives
HEADLINE_MEASURED = ("8k", "32k")


def intro_measured_values() -> tuple:
    """The bits/value the default held on HEADLINE_MODEL (Britannica, with the widths its layers took; float parts in
    float16) at 8k and 32k, from benchmarks/results/long_context.json, and what that is against float16."""
    bits = [float(defaults_figures.lc_value("long_context", HEADLINE_MODEL[0], "default", "britannica", c, "bitsw"))
            for c in HEADLINE_MEASURED]
    return (HEADLINE_MODEL[1], f"{bits[0]:.2f}", HEADLINE_MEASURED[0], f"{bits[1]:.2f}", HEADLINE_MEASURED[1],
            f"{16 / bits[0]:.1f}", f"{16 / bits[1]:.1f}")


def picture_values() -> tuple:
    """The mlx-lm caches docs/memory_vs_context.png draws (benchmarks/plots.memory_curves), widest first."""
    import plots

    names = next(iter(plots.memory_curves(plots.user_models()[:1], [HEADLINE_CONTEXTS[0]]).values()))
    bits = sorted((int(re.fullmatch(r"mlx-lm affine (\d+)-bit", n).group(1)) for n in names
                   if n.startswith("mlx-lm affine")), reverse=True)
    if len(bits) != 2:
        raise Reword(f"the memory picture draws mlx-lm at {bits} bits")
    return tuple(bits)


def python_values() -> tuple:
    m = re.search(r'requires-python\s*=\s*">=\s*([\d.]+)"', (common.REPO / "pyproject.toml").read_text())
    return (m.group(1),)


def openblas_values() -> tuple:
    """The speed-up tq_mlx.blas tells users OpenBLAS gives (its warning's own words)."""
    from tq_mlx.blas import ReferenceBLASWarning

    return (re.search(r"~(\d+)x", ReferenceBLASWarning.__doc__).group(1),)


def config_bits_values() -> tuple:
    """The bits a config takes (tq_mlx.quant.quantizer.MSE_BITS) and TurboQuantConfig()'s bits and key widths (its
    norms corrected, nothing decaying)."""
    from tq_mlx import TurboQuantConfig
    from tq_mlx.config import NARROWEST_KEY_BITS, WIDEST_KEY_BITS
    from tq_mlx.quant.quantizer import MSE_BITS

    d = TurboQuantConfig()
    if d.decay_after is not None or d.key_output_error is None or not d.correct_norms:
        raise Reword("TurboQuantConfig() no longer takes keys by their output error, corrects norms and keeps every token")
    return (*map(_bits, MSE_BITS), _bits(d.key_bits), _bits(d.value_bits), NARROWEST_KEY_BITS, WIDEST_KEY_BITS,
            f"{d.key_output_error:g}")


def config_fields_values() -> tuple:
    from tq_mlx import TurboQuantConfig

    from tq_mlx.config import DECAY_FLOOR, DECAY_STEP, auto_decay_bits
    from tq_mlx.quant.quantizer import MSE_BITS

    d = TurboQuantConfig()
    widest = max(MSE_BITS)
    if auto_decay_bits("key", widest) is not None or auto_decay_bits("value", widest) is not None:
        raise Reword(f"{widest}-bit codes now decay")
    if DECAY_STEP["value"]:
        raise Reword("values decay by themselves again")
    words = {1: "one", 2: "two", 3: "three"}
    return (words[DECAY_STEP["key"]], DECAY_FLOOR["key"], _bits(widest), d.norm_bits, d.window, d.sinks)


def kvcache_step_values() -> tuple:
    """mlx-lm's KVCache grows in steps of this many tokens (the reference every "saved" is against)."""
    from mlx_lm.models.cache import KVCache

    return (KVCache.step,)


def presets_values() -> tuple:
    """Each preset's bits/value at 32k on REFERENCE_MODEL (float parts in float16; the default's keys at the most
    they widen to, as the planner prices them), the reference's head_dim, and what each preset keeps: quality
    no decay, the default keys by their output error with norms corrected and no decay, compact decaying, its keys
    not widened."""
    from tq_mlx import TurboQuantConfig
    from tq_mlx.models.architectures import attention_layout
    from tq_mlx.config import NARROWEST_KEY_BITS, WIDEST_KEY_BITS

    ctx = HEADLINE_CONTEXTS[0]
    q, d, c = (TurboQuantConfig.preset(p) for p in ("quality", "default", "compact"))
    if q.decay_after is not None or d.decay_after is not None or c.decay_after is None or c.key_error is not None \
            or c.key_output_error is not None or d.key_output_error is None or not d.correct_norms:
        raise Reword("the presets no longer keep, widen and decay as the sentence says")
    bits = [f"{_bits_per_value(p, ctx):.2f}" for p in (q, d, c)]
    return (*bits, _ctx(ctx), attention_layout(_model_config()).head_dim, _label(q), _label(d), NARROWEST_KEY_BITS,
            WIDEST_KEY_BITS, _label(c), c.decay_after, _decayed_label(c))


def bound_floor_values() -> tuple:
    """The smallest --max-kv-size the default config holds as it is: sinks + calibration tokens + compress block - 1
    (config.bound_floor)."""
    from tq_mlx import TurboQuantConfig

    d = TurboQuantConfig()
    return (d.bound_floor,)


BOUNDS = (4096, 256)  # the --max-kv-size the README prices


def bound_values() -> tuple:
    """What a bounded default cache saves on REFERENCE_MODEL against mlx-lm's RotatingKVCache of the same size, at
    128k tokens (tq_mlx.planner.memory.planned_saving; the bound fitted as the commands fit it): "N.NNx", or "nothing"."""
    from tq_mlx.config import derive_config
    from tq_mlx.planner.memory import planned_saving

    out = []
    for n in BOUNDS:
        r = planned_saving(_model_config(), HEADLINE_CONTEXTS[-1], derive_config(max_kv_size=n), max_kv_size=n).ratio
        out += [f"{r:.2f}x" if r >= 1.005 else "nothing", f"{n:,}"]
    return tuple(out)


@functools.cache
def _long_context() -> dict:
    return json.loads((common.RESULTS / "long_context.json").read_text())


def _lc_row(model: str, setting: str) -> dict:
    """The long-context row of `model` ("smollm2", "qwen05", ...) that measured long_context.<setting>."""
    import long_context_settings as lc_settings

    name = getattr(lc_settings, setting).name
    rows = [r for r in _long_context()["models"][model]["rows"] if lc_settings.canonical_name(r) == name]
    if len(rows) != 1:
        raise Reword(f"long_context.json has {len(rows)} {setting} rows for {model}")
    return rows[0]


def _lc_cells(model: str, setting: str, contexts) -> list[dict]:
    row = _lc_row(model, setting)
    cells = [x for text in row["texts"].values() for c, x in text.items()
             if isinstance(x, dict) and int(c) in contexts]
    if not cells:
        raise Reword(f"no {setting} measurement of {model} at {contexts}")
    return cells


def kl_text(x: float) -> str:
    x = max(x, 0.0)
    return f"{x:.4f}" if x < 0.01 else f"{x:.3f}"


def _kl_range(cells: list[dict]) -> str:
    lo, hi = kl_text(min(x["kl"] for x in cells)), kl_text(max(x["kl"] for x in cells))
    return lo if lo == hi else f"{lo}-{hi}"


TARGET_KL = 0.01  # issue 34's: the default at 16k and 32k


def _lc_texts(model: str, setting: str) -> dict:
    """The texts of `model`'s row that measured long_context.<setting>, {} when none did."""
    try:
        return _lc_row(model, setting)["texts"]
    except Reword:
        return {}


def _preset_cells(model: str, setting: str, contexts) -> tuple[list[dict], list[tuple]]:
    """`setting`'s cells at `contexts`, with those it lacks (text and context) taken from the same preset before
    prefill was read as decode (long_context_settings.BEFORE_PREFILL: the same bits and fields but that one); and
    the (text, context) pairs so taken."""
    import long_context_settings as lc_settings

    def cells(name: str) -> dict:
        return {(t, int(c)): x for t, xs in _lc_texts(model, name).items() for c, x in xs.items()
                if isinstance(x, dict) and int(c) in contexts}

    got = cells(setting)
    before = lc_settings.BEFORE_PREFILL.get(setting)
    lent = {k: x for k, x in (cells(before) if before else {}).items() if k not in got}
    if not got and not lent:
        raise Reword(f"no {setting} measurement of {model} at {contexts}")
    return [*got.values(), *lent.values()], sorted(lent)


def prefill_gap(models=("smollm2", "qwen05", "qwen15")) -> float:
    """The largest |KL| difference between the default with prefill read as decode (until its window fell) and
    the default before, over the cells both measured (fed 512 tokens at a time)."""
    import long_context_settings as lc_settings

    gaps = []
    for model in models:
        new, old = (_lc_texts(model, name) for name in ("DEFAULT_1204", lc_settings.BEFORE_PREFILL["DEFAULT_1204"]))
        gaps += [abs(x["kl"] - old[t][c]["kl"]) for t, xs in new.items() for c, x in xs.items()
                 if isinstance(x, dict) and isinstance(old.get(t, {}).get(c), dict)]
    if not gaps:
        raise Reword("no cell measured both with prefill read as decode and without")
    return max(gaps)


def quality_values() -> tuple:
    return _quality()[0]


def quality_before_values() -> tuple:
    """How many of quality_values' cells are the presets' from before prefill was read as decode, that date and
    the most their KL and today's differ where both were measured."""
    import long_context_settings as lc_settings

    lent = _quality()[1]
    if not lent:
        raise Reword("every cell of the quality sentence is measured with prefill read as decode: drop this one")
    chunks = {m["chunk"] for m in _long_context()["models"].values()}
    if len(chunks) != 1:
        raise Reword(f"long_context.json's models were fed {sorted(chunks)} tokens at a time: reword")
    return len(lent), lc_settings.PREFILL_DATE, kl_text(prefill_gap()), chunks.pop()


@functools.cache
def _quality() -> tuple[tuple, tuple]:
    """The default's KL on Qwen2.5-Coder-0.5B at its longest context measured, 16k and 8k (every text), on
    Qwen2.5-Coder-1.5B at its longest and on SmolLM2 at 8k; the bits/value at 32k both Qwen models' layers took;
    the default until 2026-11-27's bits and KL at 16k on both; the quality preset at 8k and its longest context
    (results/long_context.json). A cell the default (or quality) has not measured yet since prefill is read as
    decode is the same preset's before, and the sentence says so."""
    import long_context_settings as lc_settings
    from tq_mlx import TurboQuantConfig

    res = _long_context()["models"]
    short = max(c for c in res["smollm2"]["contexts"] if c <= lc_settings.TRAINED_CONTEXT["smollm2"])
    lent: list = []

    def cells(key: str, setting: str, contexts) -> list[dict]:
        got, borrowed = _preset_cells(key, setting, contexts)
        lent.extend((key, setting, *cell) for cell in borrowed)
        return got

    def measured(setting: str, key: str = "qwen05") -> set[int]:
        names = (setting, lc_settings.BEFORE_PREFILL.get(setting))
        return {int(c) for name in names if name for c in _contexts(key, name)}

    longest, mid = max(measured("DEFAULT")), 2 * short
    if longest <= mid:
        raise Reword(f"the default is measured only to {_ctx(longest)} on Qwen2.5-Coder-0.5B: drop its longest figure")
    past = sorted((c for c in measured("DEFAULT", "qwen15") if c >= short), reverse=True)
    if not past:
        raise Reword("Qwen2.5-Coder-1.5B's default is not measured from 8k: reword its figures")
    l15 = past[0]  # its longest
    if mid not in measured("DECAY_V2") or mid not in measured("DECAY_V2", "qwen15"):
        raise Reword("the default until 2026-11-27 is not measured where the default is: reword the comparison")
    q_longest = max(measured("QUALITY"))

    def bits(key: str, setting: str) -> str:
        try:
            r = _lc_row(key, setting)
        except Reword:  # the bits are the same preset's before prefill was read as decode
            r = _lc_row(key, lc_settings.BEFORE_PREFILL[setting])
        g = res[key]["geometry"]
        return f"{r['bits_32k'] + lc_settings.protection_bits(r, g, lc_settings.LONG):.2f}"

    prev = lc_settings.DECAY_V2.config
    dppl = max((x["ppl_delta_pct"] for x in cells("qwen05", "DEFAULT", (short, mid, longest))), key=abs)
    d15 = max((x["ppl_delta_pct"] for x in cells("qwen15", "DEFAULT", past)), key=abs)
    g = res["qwen05"]["geometry"]
    qb = float(bits("qwen05", "QUALITY"))
    values = (g["kv_heads"], g["head_dim"],
              _kl_range(cells("qwen05", "DEFAULT", (longest,))), _ctx(longest),
              _kl_range(cells("qwen05", "DEFAULT", (mid,))), _ctx(mid),
              _kl_range(cells("qwen05", "DEFAULT", (short,))), _ctx(short), f"{abs(dppl):.2f}",
              _kl_range(cells("qwen15", "DEFAULT", (l15,))), _ctx(l15), f"{abs(d15):.2f}", _ctx(short),
              _kl_range(cells("smollm2", "DEFAULT", (short,))), _ctx(short),
              bits("qwen05", "DEFAULT"), bits("qwen15", "DEFAULT"), _ctx(lc_settings.LONG),
              lc_settings.DECAY_V2_DATE, f"K{_bits(prev.key_bits)}", f"V{_bits(prev.decay_value_bits)}",
              prev.decay_after, bits("qwen05", "DECAY_V2"), bits("qwen15", "DECAY_V2"),
              _kl_range(_lc_cells("qwen05", "DECAY_V2", (mid,))), _kl_range(_lc_cells("qwen15", "DECAY_V2", (mid,))),
              _ctx(mid),
              _bits(TurboQuantConfig.preset("quality").key_bits), f"{qb:.2f}", _ctx(lc_settings.LONG),
              f"{16 / qb:.1f}", _kl_range(cells("qwen05", "QUALITY", (short, q_longest))), _ctx(short),
              _ctx(q_longest), _kl_range(cells("smollm2", "QUALITY", (short,))), _ctx(short))
    return (f"{TARGET_KL:g}", *values), tuple(sorted(set(lent)))


def _contexts(model: str, setting: str) -> set[int]:
    return {int(c) for x in _lc_texts(model, setting).values() for c in x if c.isdigit()}


def norm_values() -> tuple:
    from tq_mlx import TurboQuantConfig

    if TurboQuantConfig().norm_bits == 16:
        raise Reword("norms are float16 by default, not a log code")
    return (TurboQuantConfig().norm_bits,)


def protect_values() -> tuple:
    from tq_mlx import TurboQuantConfig

    return (_bits(TurboQuantConfig().protect_bits),)


PROMPT_CACHE_PREFIX = 16384  # the prefix length the README's prompt-cache sentence quotes (prompt_cache.json)


def prompt_cache_values() -> tuple:
    """The disk tier's default cap (prompt_store.DEFAULT_DISK_BYTES, in GB), then for the PROMPT_CACHE_PREFIX row
    of benchmarks/results/prompt_cache.json: the prefix, tq-server's time to first token cold, after a memory hit
    and after a restart, mlx_lm.server's three, and the prefix's cache in MB: tq-server's in memory and on disk,
    mlx-lm's in memory."""
    import dataclasses

    import long_context_settings as lc_settings
    from tq_mlx import TurboQuantConfig
    from tq_mlx.planner.display import describe_config
    from tq_mlx.prompt_cache.store import DEFAULT_DISK_BYTES

    res = json.loads((common.RESULTS / "prompt_cache.json").read_text())
    # measured before prefill was read as decode (whose describe_config then never named it): say so
    before = describe_config(lc_settings.DEFAULT_1203.config)
    if res["settings"]["tq_config"] != before.replace(", prefill not read as decode", "").replace(", norms not corrected", ""):
        raise Reword("prompt_cache.json ran another config than the default until 2026-12-03: reword the sentence")
    rows = {(r["server"], r["phase"]): r["ttft_s"] for r in res["rows"] if r["prefix"] == PROMPT_CACHE_PREFIX}
    by = {b["server"]: b for b in res["bytes"] if b["prefix"] == PROMPT_CACHE_PREFIX}
    phases = ("cold", "memory hit", "after a restart")
    return (f"{DEFAULT_DISK_BYTES / 1e9:.1f}", f"{PROMPT_CACHE_PREFIX // 1024}k", lc_settings.PREFILL_DATE,
            *(f"{rows[('tq', p)]:.1f}" for p in phases), *(f"{rows[('float', p)]:.1f}" for p in phases),
            f"{by['tq']['request_cache']['nbytes'] / 1e6:,.0f}", f"{by['tq']['disk_bytes'] / 1e6:,.0f}",
            f"{by['float']['request_cache']['nbytes'] / 1e6:,.0f}")


@functools.cache
def zoo_rows() -> dict[str, list[str]]:
    """docs/models.md's table (tests/test_zoo.py checks it against what each architecture does): outcome ->
    architectures; ValueError if its summary line counts otherwise."""
    text = (common.REPO / "docs" / "models.md").read_text()
    rows: dict[str, list[str]] = {}
    for arch, outcome in re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", text, re.M):
        rows.setdefault(outcome, []).append(arch)
    summary = f"{sum(map(len, rows.values()))} architectures: " + ", ".join(
        f"{len(rows[k])} {k}" for k in sorted(rows)) + "."
    if summary not in text:
        raise Reword(f"docs/models.md's summary line is not its table's ({summary!r})")
    return rows


def zoo_values() -> tuple:
    rows = zoo_rows()
    return sum(map(len, rows.values())), len(rows["compressed"]), len(rows["refused"])


def zoo_unbuildable_values() -> tuple:
    return (len(zoo_rows()["not buildable"]),)


def zoo_refused() -> list[str]:
    return zoo_rows()["refused"]


def zoo_unbuildable() -> list[str]:
    return zoo_rows()["not buildable"]


def mla_values() -> tuple:
    """The bits tests/test_zoo.py runs every architecture at (its CONFIG, read without importing the test)."""
    import ast

    tree = ast.parse((common.REPO / "tests" / "test_zoo.py").read_text())
    call = next(n.value for n in tree.body if isinstance(n, ast.Assign) and any(
        getattr(t, "id", None) == "CONFIG" for t in n.targets))
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    if kw["key_bits"] != kw["value_bits"]:
        raise Reword("tests/test_zoo.py's CONFIG has different key and value bits")
    return (_bits(kw["key_bits"]),)


def mla_default_values() -> tuple:
    """The default key bits (the latent's and the rope key's) and the range they span as tokens decay."""
    from tq_mlx import TurboQuantConfig

    d = TurboQuantConfig()
    return _bits(d.key_bits), _bits(d.decayed_bits[0]), _bits(d.key_bits)


FIGURES = [
    Figure("intro", "so a Mac holds about {}x more context in the same memory at {} tokens", intro_values),
    Figure("intro measured", "(the planner's bound, float parts in float16; measured on {}: {} bits/value at {} and {} "
           "at {} with the widths its layers took, {}x and {}x less than float16;", intro_measured_values),
    Figure("memory picture", "float16, mlx-lm affine {}-bit and {}-bit, TurboQuant's defaults", picture_values),
    Figure("python", "nothing but Python {}+ and pip", python_values),
    Figure("openblas", "libopenblas0-pthread`; ~{}x faster real-model runs", openblas_values),
    Figure("config bits", "`key_bits` and `value_bits` ({}, {}, {}, {}, {}, {}, {}, {} or {}; default {} and {}, each "
           "layer's keys taking {} to {} bits by their attention-output error on the first window's queries, at "
           "most {} (`key_output_error`), norms corrected (`correct_norms`) and every token kept at its bits; asked "
           "for, temporal decay re-codes old tokens narrower:", config_bits_values),
    Figure("config fields", "integer widths decay by one rule, keys {} bit less down to {} and values "
           "only when `decay_value_bits` asks, fractional and {}-bit widths never), {}-bit norms, the float `window` "
           "of recent tokens ({}), `sinks` ({})", config_fields_values),
    Figure("kvcache step", "a `KVCache` in the model's dtype, {} tokens at a time", kvcache_step_values),
    Figure("presets", "`--tq-preset quality|default|compact` ({}, at most {} and {} bits/value at {} on "
           "Llama-3.1-8B, head_dim {}: quality keeps {}, the default {} with each layer's keys {} to {} bits by their "
           "output error, norms corrected and no decay, compact {} past {} at {}, its keys not widened)",
           presets_values),
    Figure("bound floor", "calibration tokens and a compress block ({} tokens by default)", bound_floor_values),
    Figure("bound saving", "Llama-3.1-8B saves {} at {} tokens and {} at {}.", bound_values),
    Figure("quality", "The default's KL where it was measured (the target is {}): on Qwen2.5-Coder-0.5B ({} kv "
           "heads of {} dims, attention spread thin over thousands of tokens) {} at {}, {} at {} and {} at {} (|ΔPPL| up "
           "to {}%); on Qwen2.5-Coder-1.5B {} at {} (|ΔPPL| up to {}% from {}); on SmolLM2-135M {} at {}. Their layers' keys took {} "
           "and {} bits/value at {} (each layer its own width), where the default until {} ({} keys, values at {} "
           "past {} tokens) held {} and {} and left KL {} and {} at {}. `--tq-preset quality` ({}-bit keys, {} "
           "bits/value at {}, {}x smaller than float16) takes Qwen2.5-Coder-0.5B to KL {} at {} and {} (and SmolLM2 "
           "to {} at {}).", quality_values),
    Figure("quality before", "{} of these cells are still the presets' from before {} (prefill not yet read as "
           "decode: the same bits, KL within {} where both were measured, fed {} tokens at a time).",
           quality_before_values),
    Figure("norms", "plus one norm (an {}-bit log code)", norm_values),
    Figure("protected keys", "keeps its keys at {} bits", protect_values),
    Figure("zoo", "Of {} architectures, {} are compressed; {} are refused because", zoo_values, zoo_refused),
    Figure("zoo not buildable", "; {} cannot run here (", zoo_unbuildable_values, zoo_unbuildable),
    Figure("mla", "at {} bits the latent path matches mlx-lm's float cache on the zoo's random models", mla_values),
    Figure("mla default", "stored at the key bits ({} by default). Its quality at {}-{} bits",
           mla_default_values),
    Figure("prompt cache", "`--tq-prompt-cache-disk-bytes N` (default {} GB, zero turning it off), so a long system "
           "prompt is prefilled once, not after every restart. On the demo model here (a CPU) with a {} system prompt "
           "(TurboQuant's default until {}), the first token came {} s after a cold start, {} s after a memory hit and {} s after a restart, against "
           "mlx_lm.server's {} s, {} s and {} s (a restart loses its float cache); the prefix's cache took {} MB in "
           "memory and {} MB on disk, mlx-lm's {} MB (both held in this run's float32: a float16 model's float parts, "
           "and mlx-lm's whole cache, take half).", prompt_cache_values),
]


# Numbers in README prose that are not results, each with why (keep this short: a figure belongs in FIGURES).
ALLOWED = [
    (r"\b[A-Za-z][\w.]*(?:-[\w.]+)*?-\d+(?:\.\d+)?[BbMm]\b(?:-[\w.]+)*", "a model's name with its size"),
    (r"DeepSeek-V2-Lite, is 16B", "a model's name and size"),
    (r"Gemma 4", "a model family's name"),
    (r"1-bit QJL", "QJL is one bit by definition (the paper)"),
    (r"Algorithms 1 and 2", "the paper's numbering"),
    (r"--ctx 128k", "a CLI example"),
    (r"TQ_MLX_OPENBLAS=0", "an environment setting"),
    (r"exit status 2", "tq-server's exit status (tests/test_cli.py)"),
    (r"HTTP 400", "an HTTP status (tests/test_cli.py)"),
]
# A number: digits not glued to a word before them (Qwen3.5, x86_64 and sha256 are names), "4,096" and "2.53" whole;
# and bit settings (K4/V3).
NUMBER = re.compile(r"(?<![\w.])((?:[KV](?=\d))?\d+(?:[.,]\d+)*)(?:[kx%](?!\w))?")  # group 1: what counts
FENCED = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
EXAMPLE = re.compile(r"<!-- generated-example:([\w.-]+):start -->.*?<!-- generated-example:\1:end -->", re.S)


def figure_pattern(text: str) -> re.Pattern:
    """A Figure's text as a regex: each {} a group of non-space characters, any whitespace any whitespace."""
    def literal(part: str) -> str:
        words = part.split()
        if not words:
            return r"\s+" if part else ""
        return ((r"\s+" if part[0].isspace() else "") + r"\s+".join(map(re.escape, words))
                + (r"\s+" if part[-1].isspace() else ""))
    return re.compile(r"(\S+?)".join(literal(p) for p in text.split("{}")))


class ProseCheck(NamedTuple):
    """What prose_check found in a README's text: problems (each naming its figure), the text with every figure
    as the code gives it now, and the spans of the numbers the figures cover."""

    problems: list[str]
    text: str
    spans: list[tuple[int, int]]


def prose_check(text: str, figures: list[Figure] = FIGURES) -> ProseCheck:
    problems, spans, edits = [], [], []
    for fig in figures:
        found = list(figure_pattern(fig.text).finditer(text))
        if len(found) != 1:
            problems.append(f"prose figure {fig.name!r}: the README says {fig.text!r} {len(found)} times, not once "
                            "(reworded? edit readme_prose.FIGURES with it)")
            continue
        m = found[0]
        try:
            values = [str(v) for v in fig.values()]
            names = list(fig.names()) if fig.names else []
        except Reword as e:
            problems.append(f"prose figure {fig.name!r}: {e}; reword the sentence and readme_prose.FIGURES")
            continue
        if len(values) != len(m.groups()):
            problems.append(f"prose figure {fig.name!r}: the code gives {len(values)} numbers {values}, the README's "
                            f"words hold {len(m.groups())}: reword it")
            continue
        for i, value in enumerate(values, 1):
            spans.append(m.span(i))
            if m.group(i) != value:
                a, b = m.span(i)
                around = " ".join(text[max(m.start(), a - 50):min(m.end(), b + 50)].split())
                problems.append(f"prose figure {fig.name!r} is stale: the README says {m.group(i)!r} where the code "
                                f"and results now give {value!r} (in '...{around}...')")
                edits.append((m.span(i), value))
        start, end = text.rfind("\n\n", 0, m.start()), text.find("\n\n", m.end())
        paragraph = text[start:end if end >= 0 else len(text)]
        missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", paragraph)]
        if missing:
            problems.append(f"prose figure {fig.name!r}: its paragraph does not name {missing}")
    for (a, b), value in sorted(edits, reverse=True):
        text = text[:a] + value + text[b:]
    return ProseCheck(problems, text, spans)


def covered_spans(text: str, figure_spans: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Where a number needs no figure: generated blocks (this script's and docs_assets.py's examples), code (fenced
    and indented blocks), HTML comments, link targets, the ALLOWED phrases, and the figures' own numbers."""
    spans = list(figure_spans)
    for start, end in ((HEADLINE_START, HEADLINE_END), (PATHS_START, PATHS_END)):
        a = text.find(start)
        if a >= 0 and text.find(end, a) >= 0:
            spans.append((a, text.find(end, a) + len(end)))
    for pattern in (EXAMPLE, FENCED, COMMENT, LINK_TARGET, *(re.compile(p) for p, _ in ALLOWED)):
        spans += [m.span() for m in pattern.finditer(text)]
    return spans + defaults_figures.indented_code(text)


def uncovered_numbers(text: str, figure_spans: list[tuple[int, int]] = ()) -> list[str]:
    """Every number in text outside covered_spans, as "line N: '3.7' in '...'": a figure typed by hand."""
    spans = covered_spans(text, figure_spans)
    out = []
    for m in NUMBER.finditer(text):
        if any(a <= m.start(1) and m.end(1) <= b for a, b in spans):
            continue
        line = text.count("\n", 0, m.start()) + 1
        around = " ".join(text[max(0, m.start() - 40):m.end() + 40].split())
        out.append(f"line {line}: {m.group(0)!r} in '...{around}...'")
    return out


def readme_problems(text: str) -> tuple[list[str], str]:
    """Everything --check says of README.md's prose, and the text --write makes of it."""
    check = prose_check(text)
    problems = list(check.problems)
    problems += [f"a number typed by hand, {u}: make it a readme_prose.FIGURES figure (or, if it is not a result, "
                 "add it to ALLOWED)" for u in uncovered_numbers(text, check.spans)]
    return problems, check.text
