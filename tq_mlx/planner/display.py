"""Display strings in one place: byte counts, savings, the float window, bit labels of configs and caches.

Every panel, summary and table words its numbers with these (tq-chat's memory panel and plan, tq-generate's
summary, the benchmarks); the numbers themselves come from tq_mlx.planner.memory. "Saved" always means memory.SAVED_AGAINST
(mlx-lm's own cache for the same tokens), worded by saving_words from a memory.Saving.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..cache import TurboQuantKVCache
from ..config import BOUNDARY_SIDES, NARROWEST_KEY_BITS, NARROWEST_VALUE_BITS, WIDEST_KEY_BITS, TurboQuantConfig, bits_label
from .memory import Saving, flat_caches
from ..plan import layer_plan
from ..quant.quantizer import format_bits


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KB'; decimal units (as Activity Monitor and MLX's GB figures use)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 999.5:
            break
        n /= 1000
    else:
        unit = "TB"
    digits = 0 if unit == "B" or n >= 100 else 1 if n >= 10 else 2
    return f"{sign}{n:.{digits}f} {unit}"


def saving_words(saving: Saving, dtype: str | None = None) -> str:
    """A memory.Saving, never as a negative number: "8.57 MB (3.65x) against mlx-lm's float16 cache" (mlx-lm's
    bytes / the bytes held; `dtype` is the basis: the model's dtype, which mlx-lm's cache and TurboQuant's float
    parts are held in, so a Mac's float16 model gives a float16 ratio and these CPU runs' float32 a float32 one;
    without it, for a panel whose row above names mlx-lm's cache and its dtype: "8.57 MB (3.65x)"),
    "none yet" while TurboQuant's float window and constants outweigh mlx-lm's buffers, "none" for mlx-lm's own
    cache, "-" for an empty one. The panel, tq-generate's summary and the plan all word their saving with this."""
    if not saving.held:
        return "-"
    if saving.saved == 0:
        return "none"
    if saving.saved < 0:
        return "none yet"
    basis = f" against mlx-lm's {dtype} cache" if dtype else ""
    return f"{format_bytes(saving.saved)} ({saving.ratio:.2f}x){basis}"


def saving_text(s: dict, basis: bool = True) -> str:
    """saving_words for cache_bytes(...) (or a dict with its kv_bytes, mlx_lm_bytes and kv_dtype); basis=False
    leaves the dtype out, for the panel, whose row above names mlx-lm's cache in it."""
    return saving_words(Saving(s["kv_bytes"], s["mlx_lm_bytes"]), s.get("kv_dtype") if basis else None)


def planned_text(saving: Saving, ctx: int, dtype: str | None = None) -> str:
    """What a plan says the cache reaches at ctx tokens (--ctx): "planned at 8,192 tokens (--ctx): 77.1 MB held,
    saved 301 MB (4.90x) against mlx-lm's float16 cache" (memory.planned_saving; dtype the plan's kv_dtype)."""
    return f"planned at {ctx:,} tokens (--ctx): {format_bytes(saving.held)} held, saved {saving_words(saving, dtype)}"


def bound_text(config: TurboQuantConfig, fitted: TurboQuantConfig, max_kv_size: int) -> str | None:
    """One line saying how config.fit_max_kv_size fitted a config to --max-kv-size (None if it did not change
    it): "--max-kv-size 256 is below sinks + calibration tokens + compress block - 1 = 899 tokens (the float sinks
    and window are never dropped, nor anything before the first compression): keeping 4 sinks, a window of 85
    tokens and compress blocks of 84"."""
    if fitted == config:
        return None
    calibrates = config.first_window > config.window  # the floor counts the calibration tokens, not the window
    floor = (f"--max-kv-size {max_kv_size:,} is below sinks + {'calibration tokens' if calibrates else 'window'} + "
             f"compress block - 1 = {config.bound_floor:,} tokens")
    if fitted.window == config.window:  # only the calibration tokens were lowered
        return f"{floor} (nothing is compressed before the calibration tokens came): calibrating on {fitted.first_window:,} tokens"
    why = ", nor anything before the first compression" if calibrates else ""
    return (f"{floor} (the float sinks and window are never dropped{why}): keeping {fitted.sinks} sinks, a window "
            f"of {fitted.window} tokens and compress blocks of {fitted.compress_block_size}")


def window_text(s: dict) -> str | None:
    """How much of the context cache_bytes(...) found still in TurboQuant's float window (None without
    TurboQuant layers): "all 85 tokens in float32 (4 sinks + 128-token window, 768 tokens until the first compression
    calibrates on them): compression starts at token 773", or "3,228 tokens compressed (1,152 decayed), 132 in
    float16 (4 sinks + 128-token window)"."""
    if s.get("window") is None:
        return None
    kept = f"{s['kv_dtype'] or 'float'} ({s['sinks']} sinks + {s['window']:,}-token window)"
    if not s["compressed_tokens"]:
        first = max(s["window"], s.get("calibration") or 0)
        if first > s["window"]:
            kept = kept[:-1] + f", {first:,} tokens until the first compression calibrates on them)"
        start = s["sinks"] + first + 1
        if not s["float_tokens"]:
            return f"no tokens yet; the first {start - 1:,} stay in {kept}: compression starts at token {start:,}"
        return f"all {s['float_tokens']:,} tokens in {kept}: compression starts at token {start:,}"
    decayed = f" ({s['decayed_tokens']:,} decayed)" if s.get("decayed_tokens") else ""
    return f"{s['compressed_tokens']:,} tokens compressed{decayed}, {s['float_tokens']:,} in {kept}"


def decay_label(key_bits: float, value_bits: float, qjl: bool = False,
                decay_bits: tuple[int | None, int | None] = (None, None), after: int | None = None) -> str:
    """config.bits_label with temporal decay: "K4→3/V3→2 after 2048" (keys 4 bits, 3 once decay_after tokens
    old; values 3, then 2), "K4/V3→2 after 2048" when only the values decay; "K4/V3" without decay."""
    if after is None or decay_bits == (None, None):
        return bits_label(key_bits, value_bits, qjl)

    def to(decayed: int | None) -> str:
        return "" if decayed is None else f"→{format_bits(decayed)}"

    return (f"K{format_bits(key_bits)}{'+qjl' if qjl else ''}{to(decay_bits[0])}/V{format_bits(value_bits)}"
            f"{to(decay_bits[1])} after {after}")


def config_label(config, attention_index: int = 0, n_attention_layers: int | None = None) -> str:
    """A config's bits as decay_label words them, for one attention layer (by default one that is not a boundary
    layer): "K4→3/V3→2 after 2048"."""
    plan = layer_plan(config, attention_index, n_attention_layers)
    return decay_label(*plan.bits, plan.keys.qjl, plan.decay_bits, config.decay_after)


def cache_decay_bits(c: TurboQuantKVCache) -> tuple[int | None, int | None]:
    """(keys, values): the bits a cache's streams re-code old tokens at (None: that side does not decay), as
    the streams do it: a protected key stream does not decay, a latent layer's rope key (its values) decays at
    the key's decay bits, protected or not. Before the first tokens: the cache's decay_bits."""
    if c.key_stream is None:
        return c.decay_bits
    return tuple(s.decay[1].bits if s is not None and s.decaying else None for s in (c.key_stream, c.value_stream))


def _layer_caches(prompt_cache: Iterable[Any]) -> list[tuple[int, Any]]:
    """(model layer, cache) of every cache, the members of a mlx-lm CacheList under their layer. A pipeline
    stage holds the caches of a slice of the layers: the TurboQuant caches know their model layer, and the
    others are numbered by the same offset."""
    caches = [(i, m) for i, c in enumerate(prompt_cache) for m in flat_caches([c])]
    offset = next((m.layer_index - i for i, m in caches if isinstance(m, TurboQuantKVCache)), 0)
    return [(i + offset, m) for i, m in caches]


def _layer_label(c) -> str | None:
    """How bits_summary names one cache: its bits (with temporal decay, decay_label's "K4→3/V3→2 after 2048"),
    "float" (with a sliding window's size), None for caches without keys and values (recurrent state)."""
    if isinstance(c, TurboQuantKVCache):
        label = decay_label(c.key_bits, c.value_bits, c.qjl, cache_decay_bits(c), c.config.decay_after)
        ks = c.key_stream
        # keys the config weighs, coded before any attention showed the stream its queries (a bare
        # update_and_fetch): they hold no weights, and the label says so
        if ks is not None and ks.weigh and ks.n_coded and ks.weights is None:
            label += " (keys unweighed: no queries seen)"
        vs = c.value_stream  # values by their error that never saw their window's queries keep their bits
        if vs is not None and vs.value_sums is not None and vs.value_width is None and vs.n_coded:
            label += " (values kept: no queries seen)"
        return label
    if not hasattr(c, "keys"):
        return None
    bits = getattr(c, "bits", None)
    if bits:
        return f"{bits}-bit affine"
    window = getattr(c, "max_size", None)  # RotatingKVCache: a bounded float cache, left uncompressed
    return f"float (sliding window {window})" if isinstance(window, int) else "float"


def bits_summary(prompt_cache: Iterable[Any]) -> str:
    """Which layers hold what, compactly: "K4/V3 on all 28 attention layers", or per run of layers, e.g.
    "L0-1 K8/V8 · L2-27 K4→3/V3→2 after 2048 · L28-29 K8/V8" (temporal decay: decay_label) or
    "L0 float (sliding window 512) · L1 K4/V3 · ..." (layers that stay float are named; recurrent-state layers
    are left out)."""
    runs: list[tuple[str, list[int]]] = []  # (label, layers), consecutive attention layers with one label
    labelled = [(i, lab) for i, c in _layer_caches(prompt_cache) if (lab := _layer_label(c)) is not None]
    for i, label in labelled:
        if runs and runs[-1][0] == label:
            runs[-1][1].append(i)
        else:
            runs.append((label, [i]))
    if len(runs) == 1:
        n = len(labelled)
        return f"{runs[0][0]} on all {n} attention layers" if n > 1 else f"{runs[0][0]} on its 1 attention layer"
    return " · ".join(f"L{_layer_list(layers)} {label}" for label, layers in runs)


def _layer_list(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    spans: list[list[int]] = []
    for i in sorted(set(layers)):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def boundary_sides_note(config: TurboQuantConfig) -> str:
    """" (values)" or " (keys)" where the boundary layers widen one side alone, "" where they widen both."""
    return "" if config.boundary_sides == "kv" else f" ({BOUNDARY_SIDES[config.boundary_sides]})"


def describe_config(config: TurboQuantConfig | None) -> str:
    """One line: "TurboQuant K4/V4, window 128, sinks 4, calibrating on 768 tokens, keys K3 to K6 by their output
    error (at most 0.024)" (or mlx-lm's cache)."""
    if config is None:
        return "mlx-lm cache"
    parts = [f"TurboQuant {bits_label(config.key_bits, config.value_bits, config.qjl)}",
             f"window {config.window}", f"sinks {config.sinks}"]
    if config.first_window > config.window:
        parts.append(f"calibrating on {config.first_window} tokens")
    if config.boundary_layers:
        parts.append(f"boundary {config.boundary_layers} layers at {format_bits(config.boundary_bits)} bits"
                     + boundary_sides_note(config))
    if config.protect_factor is None:
        parts.append("no key protection")
    elif config.protect_before_rope:
        parts.append("key protection tested before RoPE")
    if config.key_error is not None:
        parts.append(f"keys up to K{WIDEST_KEY_BITS} where their logit error exceeds {config.key_error:g}"
                     + (", in half steps" if config.key_half_steps else ""))
    if config.key_output_error is not None:
        parts.append(f"keys K{NARROWEST_KEY_BITS} to K{WIDEST_KEY_BITS} by their output error (at most "
                     f"{config.key_output_error:g})" + (", in half steps" if config.key_half_steps else ""))
    if config.value_output_error is not None:
        parts.append(f"values V{NARROWEST_VALUE_BITS} to V{format_bits(config.value_bits)} by their output error (at "
                     f"most {config.value_output_error:g}), in half steps")
    if not config.weigh_keys:  # departures from the default's key coding are named, as protection's is
        parts.append("keys not weighed")
    if config.center_keys != "rope":
        parts.append("keys centered after RoPE" if config.center_keys else "keys not centered")
    if config.correct_norms is not True:
        parts.append({"keys": "values' norms not corrected", "values": "keys' norms not corrected"}.get(
            config.correct_norms, "norms not corrected"))
    if not config.prefill_as_decode and config.window > 0:
        parts.append("prefill not read as decode")
    if config.trellis:
        parts.append("trellis codes")
    if config.value_error is not None:  # each layer's values choose between their narrowest and their own bits
        kd = format_bits(config.decayed_bits[0])
        parts.append(f"decaying to K{kd}/V{config.narrowest_value_bits}-V{format_bits(config.value_bits)} after {config.decay_after} tokens (values "
                     f"by their output error on the first window, at most {config.value_error:g})")
    elif config.decay_after is not None:
        parts.append(f"decaying to {bits_label(*config.decayed_bits)} after {config.decay_after} tokens")
    return ", ".join(parts)


def summary_line(prompt_cache) -> str:
    """tq-generate's closing line: KV memory held, saved against mlx-lm's own cache for the same tokens
    (memory.SAVED_AGAINST), and what is still in the float window (memory.cache_bytes, worded as tq-chat's panel
    words it)."""
    from .memory import cache_bytes

    s = cache_bytes(prompt_cache)
    parts = [
        f"KV cache: {format_bytes(s['kv_bytes'])} for {s['tokens']:,} tokens",
        f"mlx-lm's {s['kv_dtype'] or 'float'} cache would hold {format_bytes(s['mlx_lm_bytes'])}",
        f"saved {saving_text(s)}",
    ]
    window = window_text(s)
    if window:
        parts.append(window)
    parts.append(bits_summary(prompt_cache))
    if s["other_bytes"]:
        parts.append(f"other cache state {format_bytes(s['other_bytes'])}")
    return "; ".join(parts)
