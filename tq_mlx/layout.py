"""Where a stream's tokens sit and what they cost: pure integer arithmetic over a config, a token count and a bound.

A stream (tq_mlx.stream.compressed) keeps its tokens in four parts, oldest first: float sinks, decayed codes, fresh codes
and a float window; a cache bounded to max_kv_size drops its oldest compressed tokens. The stream asks the rules
here what to compress (`overflow`), decay (`decayed_split`, `fresh_bound`) and how large its window buffer is
(`window_capacity`); tq_mlx.planner.memory and the planner ask `token_layout`, `buffer_layout` and `stream_bytes` what a
context costs. Nothing here builds a quantizer or a rotation: code and constant bytes come from the bit widths
(quantizer.split_dims, packing.packed_words, rotation.hadamard_base), and tests/test_memory.py checks them against
real quantizers and caches byte for byte.

Token counts hold for tokens fed in one prefill or token by token; a bounded cache, token by token (decoding).
"""

from __future__ import annotations

from typing import NamedTuple

from .config import last_third, value_widths
from .quant.packing import packed_words
from .quant.quantizer import split_dims
from .quant.rotation import hadamard_base
from .quant.trellis import WINDOW_BITS

WINDOW_STEP = 32  # the float window grows in steps of this many tokens up to `window`
# codes of this many bits or more keep float16 norms whatever norm_bits says (codec.make_quantizer): the coarse log
# norm's error (1.6e-4·|x|²) would add a quarter to a 6-bit code's (tests/test_quantizer.py)
WIDE_BITS = 6
FLOAT32 = 4  # bytes of the float32 and int32 arrays a stream holds (μ, scale, channel order, weights, constants)


# --- the stream's rules ------------------------------------------------------------------------------------


def window_capacity(recent: int, window: int, first: int = 0) -> int:
    """Tokens the float window buffer holds once `recent` tokens have arrived after the sinks: steps of
    WINDOW_STEP while they fit before the first compression (up to max(window, first): `first` is the calibration
    tokens the first compression waits for, config.first_window), the window from the first compression on. A
    function of the token count alone, so a short chat holds only what it uses and tq_mlx.planner.memory stays
    exact."""
    limit = max(window, first)
    if limit == 0 or recent <= 0:
        return 0
    if recent > limit:
        return window
    return min(limit, -(-recent // WINDOW_STEP) * WINDOW_STEP)


def overflow(recent: int, window: int, compress_block: int, first: int = 0) -> int:
    """Tokens compressed when the window holds `recent` tokens: none while they fit (before the first compression,
    while they fit in max(window, first)), else whole blocks until what is left fits the window (everything
    when window is 0). Counted from the first token after the sinks, it is the tokens ever compressed."""
    if recent <= max(window, first):
        return 0
    return recent if window == 0 else -(-(recent - window) // compress_block) * compress_block


def decode_runs(held: int, n: int, window: int, compress_block: int, first: int = 0) -> list[tuple[int, int]]:
    """n tokens arriving one by one at a window (> 0) holding `held`: the runs of them over which the window has
    compressed the same count (overflow), as (first token, that count), in order; a run ends each time a block
    is compressed. first: the calibration tokens the first compression waits for, where nothing is compressed
    yet (0: the window's)."""
    runs, m = [], 1
    while m <= n:
        c = overflow(held + m, window, compress_block, first)
        runs.append((m - 1, c))
        m = (window if c else max(window, first)) + c - held + 1  # the first token that overflows what is left
    return runs


def decayed_split(n_fresh: int, n_window: int, age: int | None, compress_block: int) -> int:
    """Fresh codes to re-code at the decay bits when the stream holds n_fresh fresh codes and n_window window
    tokens: whole blocks, until at most `age` fresh and window tokens remain (none without decay)."""
    if age is None or n_fresh + n_window <= age:
        return 0
    return min(n_fresh, -(-(n_fresh + n_window - age) // compress_block) * compress_block)


def widened_decay(decay_bits: int, bits: float, width: float) -> int | float:
    """The bits codes of a stream configured at `bits` and decaying to `decay_bits` decay to once it codes at
    `width` (keys widened by their error): lowered by as many bits as the codes were widened (K4 -> K3 becomes
    K6 -> K5, and a half step K4.5 -> K3.5: the same channel groups and rotations)."""
    d = decay_bits + width - bits
    return int(d) if d == int(d) else float(d)


def fresh_bound(age: int, window: int, compress_block: int) -> int:
    """The most fresh codes a decaying stream can hold: the window keeps at least window - compress_block + 1
    tokens once anything is compressed, and fresh plus window tokens stay within `age`."""
    return age - max(0, window - compress_block + 1)


# --- token counts ------------------------------------------------------------------------------------------


class Layout(NamedTuple):
    """One stream's parts, oldest first: tokens (token_layout), buffer capacities in tokens (buffer_layout) or
    bytes per (batch, kv head) (part_bytes). `dropped`: tokens a bound dropped (0 in capacities and bytes)."""

    sinks: int
    decayed: int
    fresh: int
    window: int
    dropped: int = 0

    @property
    def compressed(self) -> int:
        """Compressed tokens held: decayed and fresh."""
        return self.decayed + self.fresh

    @property
    def held(self) -> int:
        return self.sinks + self.decayed + self.fresh + self.window


def _steps(n: int, step: int) -> int:
    return -(-n // step) * step


def _split(config, tokens: int) -> tuple[int, int, int]:
    """(sinks, ever compressed, window) after `tokens` tokens, before any drop or decay."""
    s = min(tokens, config.sinks)
    c = overflow(tokens - s, config.window, config.compress_block_size, config.first_window)
    return s, c, tokens - s - c


def _age(config, tokens: int, max_kv_size: int | None, decaying: bool) -> int | None:
    """decay_after, or None where nothing decays: no decay, or a bound that keeps at most max_kv_size <= sinks +
    decay_after tokens, and so at most decay_after fresh and window tokens (no token ever gets that old)."""
    A = config.decay_after if decaying else None
    bounded = max_kv_size is not None and tokens > max_kv_size
    return None if A is None or (bounded and max_kv_size <= config.sinks + A) else A


def token_layout(config, tokens: int, max_kv_size: int | None = None, *, decaying: bool = True) -> Layout:
    """Where one stream's tokens are after `tokens` tokens. decaying: the stream re-codes old tokens at the decay
    bits (config.decay_after; decay configured for its side and layer, keys not protected).

    New tokens fill the sinks, then the window; a window that overflows compresses whole blocks of K =
    config.compress_block_size (`overflow`). Unbounded, a decaying stream re-codes its oldest fresh codes in whole
    blocks so that at most decay_after fresh and window tokens remain (`decayed_split`), however the tokens were
    fed. Bounded to M = max_kv_size (TurboQuantKVCache._drop_for, as RotatingKVCache keeps M - 1 tokens before
    each update): before each update the oldest compressed tokens are dropped in whole blocks so that at most
    M - 1 earlier tokens remain, K·⌈(tokens − M)/K⌉ in all, so between M − K + 1 and M tokens are held (a
    prefill chunk of L drops only for the tokens before it: right after it up to M − 1 + L are held). The sinks
    and the window are never dropped (config.check_max_size: M >= sinks + window + K − 1). Drops take decayed
    tokens first: with M > sinks + decay_after the first drop (at M + 1 tokens) finds a decayed block, and after
    it one block decays for each block dropped, so the fresh codes and the window are the unbounded stream's and
    the decayed tokens its decayed tokens less the dropped ones; with M <= sinks + decay_after nothing decays.
    """
    s, c, w = _split(config, tokens)
    K = config.compress_block_size
    dropped = 0 if max_kv_size is None or tokens <= max_kv_size else K * -(-(tokens - max_kv_size) // K)
    A = _age(config, tokens, max_kv_size, decaying)
    decayed = decayed_split(c, w, A, K) - dropped if A is not None else 0
    held = max(0, c - dropped)
    return Layout(s, decayed, held - decayed, w, dropped)


def buffer_layout(config, tokens: int, max_kv_size: int | None = None, *, decaying: bool = True) -> Layout:
    """Tokens each buffer of one stream is allocated for after `tokens` tokens (as token_layout fed them).

    Sinks: all config.sinks from the first token. Window: window_capacity. Codes grow in multiples of
    config.step. Until a token decays (and without decay) the fresh buffer holds the compressed tokens rounded up
    to step; bounded, each drop moves the kept codes to a new buffer with room for one more block
    (stream.drop_oldest(n, room=K)), and drops come every K tokens (before the updates at M + jK tokens), so the
    capacity is that of the last drop: ⌈(kept + K)/step⌉·step, kept = the compressed tokens held right after it.
    From the first decayed token on, the fresh buffer holds ⌈fresh_bound/step⌉·step codes for good
    (stream._fresh_capacity) and the decayed codes grow in steps: ⌈decayed/step⌉·step; bounded, each drop moves
    the decayed codes kept to a buffer with room for one more block, and one block decays before the next drop,
    so their capacity is that of the last drop: ⌈(decayed tokens held just before it)/step⌉·step.
    """
    if tokens <= 0:
        return Layout(0, 0, 0, 0)
    step, K, M = config.step, config.compress_block_size, max_kv_size
    s, c, w = _split(config, tokens)
    window = window_capacity(tokens - s, config.window, config.first_window)
    bounded = M is not None and tokens > M
    before = M + (tokens - 1 - M) // K * K if bounded else tokens  # tokens fed before the last drop
    A = _age(config, tokens, M, decaying)
    if A is None or decayed_split(c, w, A, K) == 0:
        if not bounded:
            return Layout(config.sinks, 0, _steps(c, step), window)
        s_b, _, w_b = _split(config, before)
        return Layout(config.sinks, 0, _steps(max(0, M - K - s_b - w_b) + K, step), window)
    fresh = _steps(fresh_bound(A, config.window, K), step)
    decayed = token_layout(config, before, M).decayed if bounded else decayed_split(c, w, A, K)
    return Layout(config.sinks, _steps(decayed, step), fresh, window)


# --- bytes -------------------------------------------------------------------------------------------------


def norm_bytes(bits: float, norm_bits: int) -> int:
    """Bytes of one stored norm: float16, or (norm_bits 8) a one-byte log code, except for codes of WIDE_BITS."""
    return 2 if norm_bits == 16 or bits >= WIDE_BITS else 1


def code_bytes(dim: int, bits: float, qjl: bool = False, norm_bits: int = 16) -> int:
    """Bytes one token and head takes as codes: per channel group (two for 2.5 / 3.5 bits) its packed uint32
    words and a norm; with QJL (TurboQuant_prod), (bits - 1)-bit MSE codes and a norm (none at 1 bit), the sign
    bits and the residual norm."""
    n = norm_bytes(bits, norm_bits)
    if qjl:
        mse = code_bytes(dim, bits - 1, False, norm_bits) if bits > 1 else 0
        return mse + FLOAT32 * packed_words(dim, 1) + n
    return sum(FLOAT32 * packed_words(d, b) + n for d, b in split_dims(dim, bits))


def _table_bytes(bits: int) -> int:
    """A packing.lookup_table: for widths stored as two bit planes (3, 5, 6) 2^(2·bits) rows of 2 codes (a low-plane
    byte or nibble pair with their high bits), else 256 rows (bytes) of ⌈8/bits⌉ codes."""
    return FLOAT32 * (2 ** (2 * bits) * 2 if bits in (3, 5, 6) else 256 * -(-8 // bits))


def _rotation_bytes(dim: int) -> int:
    """A rotation.Rotation: dense matrix, or Hadamard signs (and for bases 20 and 28 the transpose of H)."""
    base = hadamard_base(dim)
    if base is None:
        return FLOAT32 * dim * dim
    return FLOAT32 * (dim + (dim * dim if base in (20, 28) else 0))


def shared_constant_bytes(dim: int, bits: float, qjl: bool = False, trellis: bool = False) -> dict[tuple, int]:
    """The constants a quantizer shares with every other quantizer of the process (quantizer.shared_constants),
    by what they are: per channel group (dim, bits, kind) its codebook (centroids and boundaries) and lookup table,
    or with trellis codes (groups of TRELLIS_BITS) its 2^L-entry codebook; with QJL the (bits - 1)-bit quantizer's."""
    if qjl:
        return shared_constant_bytes(dim, bits - 1) if bits > 1 else {}
    out = {}
    for d, b in split_dims(dim, bits):
        if trellis and b in WINDOW_BITS:
            out[(d, b, "trellis")] = FLOAT32 * 2 ** WINDOW_BITS[b]
        else:
            out[(d, b, "lloyd-max")] = FLOAT32 * (2 * 2**b - 1) + _table_bytes(b)
    return out


def constant_bytes(dim: int, bits: float, qjl: bool = False, trellis: bool = False,
                   shared: dict | None = None) -> int:
    """Bytes of a quantizer's constants (quantizer.constant_arrays): per channel group its rotation; for two groups
    their channel lists and the inverse order; with QJL the (bits - 1)-bit quantizer's and the dim x dim Gaussian
    projection; and its shared constants (shared_constant_bytes). shared: a dict that collects those instead (a
    constant already in it is the same array), for a caller that counts each once (what several streams hold)."""
    own = FLOAT32 * dim * dim + (constant_bytes(dim, bits - 1, shared={}) if bits > 1 else 0) if qjl else (
        sum(_rotation_bytes(d) for d, _ in split_dims(dim, bits))
        + (FLOAT32 * 2 * dim if len(split_dims(dim, bits)) == 2 else 0))  # channel lists and the inverse order
    held = shared_constant_bytes(dim, bits, qjl, trellis)
    if shared is None:
        return own + sum(held.values())
    shared.update(held)
    return own


def _has_order(dim: int, bits: float, qjl: bool = False) -> bool:
    """Whether a stream coding at these bits stores a channel order (fractional bits: two channel groups)."""
    return not qjl and len(split_dims(dim, bits)) == 2


def part_bytes(config, tokens: int, dim: int, bits: float, qjl: bool = False, decay_bits: int | None = None,
               max_kv_size: int | None = None, float_bytes: int = 2) -> Layout:
    """Bytes of each part of one stream per (batch, kv head) after `tokens` tokens: its buffers (buffer_layout),
    the sinks and the window at float_bytes per value (the model's dtype), the fresh codes at `bits` and the
    decayed ones at decay_bits (None: a stream that does not decay)."""
    cap = buffer_layout(config, tokens, max_kv_size, decaying=decay_bits is not None)
    decayed = cap.decayed * code_bytes(dim, decay_bits, False, config.norm_bits) if decay_bits is not None else 0
    return Layout(cap.sinks * dim * float_bytes, decayed, cap.fresh * code_bytes(dim, bits, qjl, config.norm_bits),
                  cap.window * dim * float_bytes)


def value_error_span(sinks: int, first_window: int) -> tuple[int, int]:
    """The positions [first, last) of the queries whose attention outputs the values' error is measured on
    (config.value_error, tq_mlx.stream.values): the first window's last third (the calibration tokens, or the
    window when larger)."""
    return sinks + last_third(first_window), sinks + first_window


def stream_bytes(config, tokens: int, dim: int, bits: float, *, qjl: bool = False, decay_bits: int | None = None,
                 protected: bool = False, center: bool = False, rope_pairs: int | None = None, weigh: bool = False,
                 max_kv_size: int | None = None, float_bytes: int = 2, batch: int = 1, heads: int = 1,
                 widened: float | None = None, narrow: int | None = None, span_heads: int | None = None,
                 span_dim: int | None = None, shared: dict | None = None) -> int:
    """CompressedStream.nbytes after `tokens` tokens, for a stream built as the cache builds it: quantizer
    (dim, bits, qjl), decay quantizer at decay_bits (None: no decay), center, rope (the channel pairs its RoPE
    rotates, None: no RoPE centering), weigh; batch x heads kv heads.

    Its parts (part_bytes) for every kv head; the quantizers' constants (the decay quantizer's from the start,
    whether or not anything decayed); with the first compressed token μ (center, float32), a scale per kv head
    (float32) and a channel order per head (int32, fractional bits); the rope's channel order (int32) and
    frequencies (float32) from the start; the query weights (float32 per channel) once a token after the sinks
    came. protected: the stream protected its keys at calibration: codes at config.protect_bits (plain MSE)
    that do not decay, and it keeps its configured quantizer (and decay quantizer) next to the protecting one.
    widened: the bits the keys chose at calibration (config.key_error): codes at those bits decaying by the
    same step, and the configured quantizers kept next to theirs (values by their output error: the width they
    chose, config.value_output_error). narrow: values by their error (config.value_error)
    that choose, once the queries of the first window's last third came, the bits they decay to: these (`bits`: none);
    before, their sums (float32 per width, kv head and query position) and quantizers at the widths below `bits`
    from the first of those queries on, and no decay. span_heads: keys by their output error (config.key_output_error),
    `span_heads` query heads per kv head: from the first of those queries until the first compression, the stream
    holds them (the float dtype, every position of the span; span_dim channels, None: dim), as values by their
    output error do. shared: a dict that collects the quantizers' shared constants (constant_bytes) for a caller
    that counts each once over several streams; None: the stream's own count, each once.
    """
    if tokens <= 0:
        return 0
    held = {} if shared is None else shared
    const = lambda d, b, q=False: constant_bytes(d, b, q, config.trellis, held)  # noqa: E731
    extra = 0
    if span_heads is not None:
        first, last = value_error_span(config.sinks, config.first_window)
        if first < tokens and not _split(config, tokens)[1]:
            extra += batch * heads * span_heads * (last - first) * (span_dim or dim) * float_bytes
    if narrow is not None:
        first, last = value_error_span(config.sinks, config.first_window)
        decay_bits = narrow if tokens >= last and narrow < bits else None
        if first < tokens < last:
            widths = value_widths(bits, config.narrowest_value_bits)
            extra = sum(const(dim, b) for b in widths) + batch * heads * FLOAT32 * (len(widths) + 1) * (
                last - first)
    total = const(dim, bits, qjl) + (const(dim, decay_bits) if decay_bits is not None else 0)
    if protected:
        bits, qjl = config.protect_bits, False
        total += const(dim, bits)
    elif widened is not None and widened != bits:
        if decay_bits is not None:
            decay_bits = widened_decay(decay_bits, bits, widened)
            total += const(dim, decay_bits)
        bits = widened
        total += const(dim, bits)
    parts = part_bytes(config, tokens, dim, bits, qjl, None if protected else decay_bits, max_kv_size, float_bytes)
    total += batch * heads * sum(parts)
    if _split(config, tokens)[1]:  # ever compressed: the calibration stays through drops
        total += batch * heads * FLOAT32 * (dim * bool(center) + 1) + heads * FLOAT32 * dim * _has_order(
            dim, bits, qjl)
    if rope_pairs is not None:
        total += FLOAT32 * (dim + rope_pairs)
    if weigh and tokens > config.sinks:
        total += batch * heads * FLOAT32 * dim
    return total + extra + (sum(held.values()) if shared is None else 0)
