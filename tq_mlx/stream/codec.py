"""A stream's stored form: the quantizer that codes its tokens (make_quantizer), its buffers (appended, moved), and
its state, the arrays under "<name>_<part>" in a cache's state (state_arrays), read back with every shape and dtype
checked (read_state, check_state).

The token counts are the cache's (tq_mlx.cache); a stream's parts are STATE_PARTS, each None while empty. Parts
came with state versions: `scale` with 3 (None: 1), `decayed` with 6, `rope` (keys centered before RoPE) with 7,
`weights` and `queries` (query-aware key weights, and the queries summed before they are fixed) with 8, `errors`
(the values' error sums, value_error) with 10, `span` (the queries keys by their output error hold,
key_output_error) with 11. Older files lack the newer parts and still load.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..layout import WIDE_BITS  # 6 and 8 bits (protected keys, boundary layers, K8): codes that want exact norms
from ..quant.quantizer import FLOAT_DTYPES, LOG_NORM_DTYPES, MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd
from ..models.rope import Rope


def make_quantizer(dim: int, bits: float, qjl: bool, seed: int, norm_dtype: mx.Dtype = mx.float16,
                   correct_norms: bool = False, trellis: bool = False) -> TurboQuantMSE | TurboQuantProd:
    """The quantizer of one stream: TurboQuant_prod for QJL keys, TurboQuant_mse otherwise (trellis: its codes a
    trellis's); norms stored as float16 or (norm_bits 8) a one-byte log code (quantizer.NORM_DTYPES), corrected or
    not (correct_norms). Codes of
    WIDE_BITS or more keep float16 norms: the coarse log code's error (RMS 1.25%) is three times 8-bit codes' own."""
    if bits >= WIDE_BITS and norm_dtype in LOG_NORM_DTYPES.values():
        norm_dtype = mx.float16
    if qjl:
        return TurboQuantProd(dim, int(bits), seed=seed, norm_dtype=norm_dtype, correct_norms=correct_norms)
    return TurboQuantMSE(dim, bits, seed=seed, norm_dtype=norm_dtype, correct_norms=correct_norms, trellis=trellis)


def remade(quantizer, bits: float) -> TurboQuantMSE:
    """An MSE quantizer like `quantizer` (its dim, seed, norms and their correction, trellis codes or not) at other
    bits: a stream's protected, widened, decayed or narrowed codes."""
    q = quantizer
    return make_quantizer(q.dim, bits, False, q.seed, q.norm_dtype, q.correct_norms, getattr(q, "trellis", False))


def quantizer_as_written(quantizer, codes):
    """The quantizer whose codes a file holds: a file written before codes of WIDE_BITS kept float16 norms holds
    their uint8 log code, and the stream then keeps that code (its quantizer otherwise the same), so the file
    loads and continues as it was. Otherwise `quantizer` itself."""
    q, norms = quantizer, getattr(codes, "norms", None)
    if (q.bits < WIDE_BITS or q.norm_dtype == mx.uint8 or not isinstance(norms, mx.array)
            or norms.dtype != mx.uint8):
        return q
    return type(q)(q.dim, q.bits, seed=q.seed, norm_dtype=mx.uint8, correct_norms=q.correct_norms, trellis=q.trellis)


class StreamState(NamedTuple):
    """A stream's arrays, as its state holds them (None: the part holds nothing)."""

    codes: MSECodes | ProdCodes | None = None  # fresh code buffers (B, H, capacity, ...)
    sinks: mx.array | None = None  # (B, H, max_sinks, D) the tokens' float dtype
    window: mx.array | None = None  # (B, H, window capacity, D) the tokens' float dtype
    mean: mx.array | None = None  # (B, H, D) float32
    perm: mx.array | None = None  # (H, D) int32
    scale: mx.array | None = None  # (B, H) float32
    decayed: MSECodes | None = None  # decayed code buffers (B, H, capacity, ...)
    rope: Rope | None = None  # the RoPE the keys were centered before
    weights: mx.array | None = None  # (B, H, D) float32
    queries: mx.array | None = None  # (B, H, D) float32: summed squared queries (QuerySums.total)
    errors: mx.array | None = None  # (B, H, widths + 1, span) float32: values' error sums (tq_mlx.stream.values.ValueSums)
    span: mx.array | None = None  # (B, n_q_heads, span, D) float dtype: queries held for keys' output error (SpanQueries)


# A stream's arrays, under "<name>_<part>" in a cache's state.
STATE_PARTS = StreamState._fields
_TUPLES = ("codes", "decayed", "rope")  # parts that are NamedTuples of arrays, stored as plain tuples


class BatchHeads(NamedTuple):
    batch: int
    heads: int


class Counts(NamedTuple):
    """The tokens a cache's state gives one stream, part by part."""

    sinks: int
    fresh: int  # codes at the stream's own bits
    window: int
    decayed: int = 0  # codes re-coded at the decay bits


def batch_heads_of(sinks, window, mean, codes) -> BatchHeads | None:
    """(batch, kv heads) of a stream's arrays, None before the first tokens."""
    for a in (sinks, window, mean, codes[0] if codes else None):
        if isinstance(a, mx.array) and a.ndim >= 2:
            return BatchHeads(*a.shape[:2])
    return None


def batch_heads(state: dict, name: str) -> BatchHeads | None:
    """(batch, kv heads) of a stream's arrays in a state dict (state_arrays), None if it has none."""
    return batch_heads_of(*(state.get(f"{name}_{part}") for part in ("sinks", "window", "mean", "codes")))


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def state_arrays(name: str, state: StreamState) -> dict:
    """The arrays of a stream named `name` as a cache's state holds them: "<name>_<part>" for every part, the
    code and RoPE parts as plain tuples. Stored references, not copies."""
    tuples = {f"{name}_{p}": None if getattr(state, p) is None else tuple(getattr(state, p)) for p in _TUPLES}
    return {**tuples, **{f"{name}_{p}": a for p, a in zip(STATE_PARTS, state) if p not in _TUPLES}}


def read_state(arrays: dict, name: str, codes_type: type) -> StreamState:
    """The parts of stream `name` in a state dict, code and RoPE tuples typed (fresh codes as `codes_type`),
    each array a new object on the same data, so a stream's in-place slice updates never reach another stream
    read from the same state. Only the tuples' lengths are checked here (check_state does the rest)."""
    own = lambda a: mx.array(a) if isinstance(a, mx.array) else a  # noqa: E731

    def typed(part, tuple_type):
        parts = arrays.get(f"{name}_{part}")
        if parts is None:
            return None
        if not isinstance(parts, (list, tuple)) or len(parts) != len(tuple_type._fields):
            raise ValueError(f"{name}_{part} must hold {tuple_type._fields}")
        return tuple_type(*map(own, parts))

    tuples = {"codes": typed("codes", codes_type), "decayed": typed("decayed", MSECodes), "rope": typed("rope", Rope)}
    return StreamState(**{p: tuples[p] if p in tuples else own(arrays.get(f"{name}_{p}")) for p in STATE_PARTS})


def check_state(state: StreamState, counts: Counts, bh: BatchHeads | None, *, name: str, quantizer,
                decay_quantizer: TurboQuantMSE | None, center: bool, channel_order: bool, max_sinks: int,
                max_window: int) -> None:
    """Check a stream's parts read from a file against the token counts, (batch, kv heads) and the stream's
    settings; a corrupted file raises ValueError naming the array."""
    B, H = bh or (None, None)
    D = quantizer.dim

    def check(field, a, expected, dtype, min_tokens=0):
        # expected: the full shape, with None on the token axis of growable buffers (>= min_tokens);
        # dtype: one dtype or a tuple of the allowed ones
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if not isinstance(a, mx.array) or a.dtype not in allowed:
            raise ValueError(f"{name}_{field} must be a {' or '.join(map(dtype_name, allowed))} array, got "
                             f"{dtype_name(a.dtype) if isinstance(a, mx.array) else type(a).__name__}")
        got = tuple(a.shape)
        ok = len(got) == len(expected)
        ok = ok and all(e is None and g >= min_tokens or e == g for g, e in zip(got, expected))
        if not ok:
            raise ValueError(f"{name}_{field} has shape {got}, expected {expected} (None: at least {min_tokens})")

    sinks, window = state.sinks, state.window
    if counts.sinks or sinks is not None:
        check("sinks", sinks, (B, H, max_sinks, D), FLOAT_DTYPES)
    if counts.window or window is not None:
        check("window", window, (B, H, None, D), FLOAT_DTYPES, max(counts.window, 1))
        if window.shape[2] > max_window:
            raise ValueError(f"{name}_window holds {window.shape[2]} tokens, more than the config's window "
                             f"{max_window} (its calibration tokens before the first compression)")
        if sinks is not None and sinks.dtype != window.dtype:
            raise ValueError(f"{name}_sinks ({dtype_name(sinks.dtype)}) and {name}_window "
                             f"({dtype_name(window.dtype)}) must have one dtype")
    if counts.fresh or state.codes is not None:
        # A lazy probe gives each field's trailing shape and dtype without evaluating anything.
        probe = quantizer.quantize(mx.zeros((1, 1, 1, D), mx.float32))
        if state.codes is None or len(state.codes) != len(probe):
            raise ValueError(f"{name}_codes must hold {probe._fields}")
        for field, a, p in zip(probe._fields, state.codes, probe):
            check(f"codes.{field}", a, (B, H, None, *p.shape[3:]), p.dtype, counts.fresh)
    if counts.fresh:
        if center:
            check("mean", state.mean, (B, H, D), mx.float32)
        if channel_order:
            check("perm", state.perm, (H, D), mx.int32)
        if state.scale is not None:
            check("scale", state.scale, (B, H), mx.float32)
    for part in ("weights", "queries"):
        if getattr(state, part) is not None:
            check(part, getattr(state, part), (B, H, D), mx.float32)
    if state.errors is not None:
        check("errors", state.errors, (B, H, None, None), mx.float32, 1)
    if state.span is not None:
        check("span", state.span, (B, None, None, D), FLOAT_DTYPES, 1)
        if H and state.span.shape[1] % H:
            raise ValueError(f"{name}_span holds {state.span.shape[1]} query heads, not a multiple of the {H} kv heads")
    if counts.decayed or state.decayed is not None:
        if decay_quantizer is None:
            raise ValueError(f"{name}_decayed: decayed tokens, but the config has no decay")
        _check_codes(f"{name}_decayed", state.decayed, decay_quantizer, counts.decayed, bh)
    if state.rope is not None:
        _check_rope(f"{name}_rope", state.rope, D, center)


def _check_codes(name: str, codes, quantizer, n: int, bh: BatchHeads | None) -> None:
    B, H = bh or (None, None)
    # A lazy probe gives each field's trailing shape and dtype without evaluating anything.
    probe = quantizer.quantize(mx.zeros((1, 1, 1, quantizer.dim), mx.float32))
    if codes is None or len(codes) != len(probe):
        raise ValueError(f"{name} must hold {probe._fields}")
    for field, a, p in zip(probe._fields, codes, probe):
        got = tuple(a.shape) if isinstance(a, mx.array) else None
        if (got is None or a.dtype != p.dtype or len(got) != p.ndim or got[2] < n
                or got[:2] != (B, H) or got[3:] != tuple(p.shape[3:])):
            raise ValueError(f"{name}.{field} must be a {dtype_name(p.dtype)} array of shape "
                             f"{(B, H, None, *p.shape[3:])} (None: at least {n}), got "
                             f"{got if got is not None else type(a).__name__}")


def _check_rope(name: str, rope: Rope, D: int, center: bool) -> None:
    order, freqs = rope
    if not isinstance(order, mx.array) or order.dtype != mx.int32 or tuple(order.shape) != (D,):
        raise ValueError(f"{name}.order must be an int32 array of shape ({D},)")
    if not isinstance(freqs, mx.array) or freqs.dtype != mx.float32 or freqs.ndim != 1 or 2 * freqs.shape[0] > D:
        raise ValueError(f"{name}.freqs must be a float32 array of shape (P,), 2·P <= {D}")
    if not center:
        raise ValueError(f"{name}: keys centered before RoPE, but the config does not center them")
    if sorted(order.tolist()) != list(range(D)):
        raise ValueError(f"{name}.order must be a permutation of the {D} channels")


def unique_arrays(holders) -> list[mx.array]:
    """The arrays of every holder's held_arrays(), each once (holders may share constants)."""
    seen: dict[int, mx.array] = {}
    for h in holders:
        for a in h.held_arrays():
            seen.setdefault(id(a), a)
    return list(seen.values())


def code_order(quantizer: TurboQuantMSE, perm: mx.array | None) -> mx.array | None:
    """The model channel at each code position, (H, D) or (D,) int: code position j holds quantizer channel
    channels[j] (the groups' channels side by side), which is model channel perm[channels[j]]. None: model
    order (one group, no stream order)."""
    groups = quantizer.groups
    order = None if len(groups) == 1 else mx.concatenate([g.channels for g in groups])
    if perm is not None:
        order = perm if order is None else mx.take(perm, order, axis=-1)
    return order


def moved(buf, start: int, end: int, capacity: int):
    """New buffers (a NamedTuple of arrays, token axis 2) of `capacity` tokens holding tokens start .. end - 1 of
    buf at their front: no slice of the old ones keeps them alive."""
    return type(buf)(*(mx.concatenate([a[:, :, start:end], mx.zeros((*a.shape[:2], capacity - end + start,
                                                                     *a.shape[3:]), a.dtype)], axis=2) for a in buf))


def appended(buf, held: int, new, step: int, capacity: int | None = None):
    """Buffers holding their `held` tokens, then the tokens of `new` (same NamedTuple type); full ones grow to
    a multiple of step (or to `capacity`, when given and enough)."""
    n = new[0].shape[2]
    if buf is None or held + n > buf[0].shape[2]:
        grown = capacity if capacity is not None and capacity >= held + n else -(-(held + n) // step) * step
        if buf is None:
            buf = type(new)(*(mx.zeros((*t.shape[:2], grown, *t.shape[3:]), t.dtype) for t in new))
        else:
            buf = moved(buf, 0, held, grown)
    for b, a in zip(buf, new):
        b[:, :, held : held + n] = a
    return buf
