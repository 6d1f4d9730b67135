"""TurboQuantConfig (how a model's KV cache is compressed, validated, with the allowed values in every error),
its presets, and derive_config: the one place a config is derived from a preset or config, bits and flags (and
fitted to a --max-kv-size bound by fit_max_kv_size beside it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .quant.quantizer import LOG_NORM_DTYPES, PROD_BITS, check_bits, format_bits


# Tokens compressed at a time by default: small blocks keep the window near full (between window - 127 and
# window tokens), and blocks of 64 measured worse than 128 (experiments/HISTORY.md).
COMPRESS_BLOCK = 128
NORM_BITS = (16, 8)
NORM_STEPS = tuple(LOG_NORM_DTYPES)  # steps an octave of the 8-bit norms' log code: 32 fine (int8) or 16 coarse (uint8)
CORRECT_NORMS_SIDES = ("keys", "values")  # correct_norms: one side's norms corrected alone (or True / False)
BOUNDARY_SIDES = {"kv": "keys and values", "k": "keys", "v": "values"}  # boundary_sides: what each widens
DECAY_BITS = (1, 2, 3, 4, 5)  # one channel group each, so decayed codes share the fresh codes' rotation
AUTO = "auto"
DECAY_FIELDS = ("decay_after", "decay_key_bits", "decay_value_bits")
WIDEST_KEY_BITS = 6  # the most bits key_error gives a layer's keys (8 is protect_bits': near lossless)
NARROWEST_KEY_BITS = 3  # the fewest bits key_output_error gives a layer's keys
NARROWEST_VALUE_BITS = 3  # the fewest bits value_output_error gives a layer's values
DECAY_AFTER = 6144  # the age decay starts at when it is asked for by its bits alone
# Bits an integer width loses with age once decay is asked for but its bits are not given (0: that side keeps its
# bits at every age), never below the floor. The default asks for none: decayed keys were most of its error at
# 16k; values decayed to 2 bits were half the error at 16k on both Qwen models, so they keep theirs
# (benchmarks/DEFAULTS.md).
DECAY_STEP = {"key": 1, "value": 0}
DECAY_FLOOR = {"key": 3, "value": 2}
# Keys by their error (TurboQuantConfig.key_error) when none is given: the target that holds KL 0.01 at 16k and 32k
# on Qwen2.5-Coder-0.5B and -1.5B (benchmarks/DEFAULTS.md), for keys at the default's width; keys at a width a user
# sets keep it (a target widens K3 keys to K5-K6 on most layers, undoing what --bits 3 asks for).
KEY_ERROR = 0.1
KEY_ERROR_BITS = 4
# Keys by their output error (TurboQuantConfig.key_output_error) when neither target is given: with V4 values it
# gives both Qwen2.5-Coder models lower KL than K4-K6 keys by KEY_ERROR beside V3 values, for fewer bytes
# (benchmarks/DEFAULTS.md); keys at a width a user sets keep it, as with KEY_ERROR. Tighter than the coarse norm
# code's target: with the fine code's smaller norm error that one took narrower keys than 16k contexts hold.
KEY_OUTPUT_ERROR = 0.024


def value_widths(value_bits: float, least: int | None = None) -> tuple[int, ...]:
    """The bits old values may decay to by their error (TurboQuantConfig.value_error): `least` (None: the floor)
    up to one bit less than value_bits (V4: 2 and 3, from 3: 3 alone); none for fractional or 8-bit values."""
    if value_bits != int(value_bits) or value_bits >= 8:
        return ()
    return tuple(range(DECAY_FLOOR["value"] if least is None else least, int(value_bits)))


def auto_decay_bits(side: str, bits: float, qjl: bool = False) -> int | None:
    """The bits old tokens of a side at `bits` decay to when no decay bits are given: keys one bit less down to 3
    (K4 -> K3, K5 -> K4), values keep theirs (DECAY_STEP). None (that side keeps its bits at every age) for values,
    fractional bits (two channel groups; decayed codes take one), 8-bit codes (asked to be near lossless), widths
    already at the floor, and QJL keys."""
    step = DECAY_STEP[side]
    if not step or bits != int(bits) or bits >= 8 or bits <= DECAY_FLOOR[side] or (side == "key" and qjl):
        return None
    return max(int(bits) - step, DECAY_FLOOR[side])


def auto_key_error(key_bits: float, qjl: bool, weigh_keys: bool) -> float | None:
    """The key_error a config takes when none is given: KEY_ERROR for MSE keys at KEY_ERROR_BITS (the default's
    width) weighed by their queries (the error is measured on them); None (keys keep key_bits) otherwise."""
    if qjl or not weigh_keys or key_bits != KEY_ERROR_BITS:
        return None
    return KEY_ERROR


def last_third(first_window: int) -> int:
    """Where the first window's last third starts, counted after the sinks: the queries value_error and
    key_output_error measure on (layout.value_error_span)."""
    return first_window - first_window // 3


def output_error_first_window(window: int) -> int:
    """The fewest tokens a first window (TurboQuantConfig.first_window) needs for key_output_error to measure: each
    query of its last third reads the tokens more than `window` older than itself as codes, so the earliest of them
    must have one (a first window that is the window itself leaves them nothing coded: every width would measure 0)."""
    first = window + 1
    while last_third(first) <= window:
        first += 1
    return first


def auto_key_output_error(key_bits: float, qjl: bool, weigh_keys: bool, window: Any,
                          first_window: Any) -> float | None:
    """The key_output_error a config takes when neither it nor key_error is given: KEY_OUTPUT_ERROR for MSE keys at
    KEY_ERROR_BITS weighed by their queries, with a window of 3 or more and a first window it can measure on
    (output_error_first_window); None otherwise (key_error's own AUTO then applies)."""
    if qjl or not weigh_keys or key_bits != KEY_ERROR_BITS or not isinstance(window, int) or window < 3:
        return None
    if not isinstance(first_window, int) or first_window < output_error_first_window(window):
        return None
    return KEY_OUTPUT_ERROR


def check_int(name: str, value: Any, low: int) -> int:
    """value, unless it is not an integer >= low (ValueError naming `name`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_target(name: str, value: Any, otherwise: str) -> None:
    """An error target (key_error, key_output_error, value_error): a number > 0, or None (`otherwise` says what
    None does); ValueError naming `name` otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"{name} must be a number > 0 or {otherwise}, got {value!r}")


def bits_label(key_bits: float, value_bits: float, qjl: bool = False) -> str:
    """"K4/V3", "K4+qjl/V3": how every table, panel and summary names a key/value bit pair."""
    return f"K{format_bits(key_bits)}{'+qjl' if qjl else ''}/V{format_bits(value_bits)}"


@dataclass(frozen=True)
class TurboQuantConfig:
    """How a model's KV cache is compressed. Every field is validated; errors name the allowed values.

    The defaults were chosen by measurement; the numbers are in benchmarks/DEFAULTS.md. In short: keys at 4 bits
    keep top-1 attention agreement at 0.98-0.99 on SmolLM2-135M and Qwen2.5-Coder-1.5B, while 3-bit keys cost
    2-4x the KL; QJL loses at equal bits; key centering rescues Qwen (PPL 629 -> 12.16 at 4/4). Where users live
    (4k-8k tokens) the float window's share of the bytes is large: 128 recent tokens stay in float (compressed 128 at
    a time), and the first compression waits for 768 tokens and calibrates on them (calibration_tokens): KL a little
    above the 768-token window the default had before, for fewer bytes (benchmarks/DEFAULTS.md). Norms take 8 bits, a
    log code of 32 steps an octave (norm_steps): a norm's error scales a key's whole logit, and the coarse code of
    16 steps the default had before made 5-bit keys err nearly as 4-bit ones on the queries that read them most, so
    more layers widened; codes of 6 bits or more keep float16 norms whatever norm_bits says (layout.WIDE_BITS). Values take 4 bits with
    their norms corrected (correct_norms) and no token decays: old keys re-coded a bit narrower were most of the
    default's error at 16k. Each layer's keys take the fewest bits from K3 up to K6 whose attention-output error on
    its first window's queries is at most KEY_OUTPUT_ERROR (key_output_error): bits taken from the keys of layers
    that need few cost less KL than a bit taken from every value (benchmarks/DEFAULTS.md). A key stream whose tokens
    barely vary along their own mean direction (bias_outlier_factor > protect_factor; layer 0 of Qwen2.5-0.5B) keeps its keys at protect_bits: KL at 4k 1.2 -> 0.075 there. The key
    mean is taken before RoPE and subtracted rotated to each position (center_keys "rope", tq_mlx.models.rope): KL at 8k
    0.0423 -> 0.0260 on Qwen2.5-Coder-0.5B, 0.0038 -> 0.0026 on SmolLM2 (Britannica). Keys are coded times
    per-channel weights from the queries of the calibration tokens, the queries divided by them (weigh_keys,
    exact): KL at 4k 0.0120 -> 0.0061 on Qwen2.5-Coder-0.5B (Britannica), and SmolLM2 finds at 8k the needles
    float finds. μ, ν, the weights (and the outlier channels of 2.5/3.5 bits) are calibrated on the first
    `first_window` tokens after the sinks (calibration_tokens, or the window when larger), however the prompt is fed
    (though the queries of a later layer, and so its weights, move a little with the prefill chunks, as every
    activation past the first compression does).

    Decay fields left at AUTO decay nothing until decay is asked for (decay_after, either side's decay bits, or
    value_error); then they follow one rule for every width (auto_decay_bits): keys of tokens older than
    decay_after (DECAY_AFTER when not given) decay to one bit less (not below 3), values keep their bits:
    K4/V4 -> K3/V4, K5 -> K4 (a widened layer); fractional and 8-bit widths, widths at the floor and QJL keys keep
    their bits at every age. key_output_error left at AUTO is KEY_OUTPUT_ERROR for weighed MSE keys at K4 with a
    window of 3 or more when key_error is not given (auto_key_output_error), None otherwise; key_error left at AUTO
    is then KEY_ERROR for weighed MSE keys at K4 whose key_output_error is None (auto_key_error). An explicit
    value is always validated as given. The resolved values are the fields: dataclasses.replace(config,
    key_bits=8) keeps K3 decay from a config that decays (derive_config(config, bits=8) derives both again, as the
    commands' flags do).
    """

    key_bits: float = 4  # 1, 2, 2.5, 3, 3.5, 4, 5, 6 or 8 (quantizer.MSE_BITS)
    value_bits: float = 4
    qjl: bool = False  # keys only: TurboQuant_prod (key_bits-1 MSE bits + 1 QJL bit); integer key_bits 1..4
    window: int = 128  # recent tokens kept in the model's float dtype (0: compress every token at once)
    compress_block: int | None = None  # tokens compressed at a time when the window overflows; None: 128 or
    # the window if smaller (COMPRESS_BLOCK)
    # The first compression waits for this many tokens after the sinks and calibrates on them (the keys' mean,
    # scales, query weights, widths and protection): a window smaller than the calibration holds them in float
    # until then, and its own size from then on. None, or no more than the window: the window itself.
    calibration_tokens: int | None = 768
    sinks: int = 4  # first tokens of the sequence kept in float16
    boundary_layers: int = 0  # the first and last N attention layers use boundary_bits for keys and values
    boundary_bits: float = 8
    boundary_sides: str = "kv"  # the sides the boundary layers widen: "kv", "k" or "v" (TurboQuant+'s boundary V)
    protect_factor: float | None = 5.0  # keys whose calibration bias_outlier_factor exceeds this: protect_bits
    protect_bits: float = 8
    # Keys centered before RoPE take the protection's test in that frame: turned back by their RoPE, where the
    # k_proj bias the test reads is one direction for every position (experiments/protection_factor.py). False:
    # on the keys as the model makes them, as every cache did until it existed.
    protect_before_rope: bool = False
    # The largest RMS error of the attention logits a layer's keys may give the queries of its calibration tokens
    # (calibration.logit_error): a layer whose keys exceed it at key_bits takes the fewest bits up to
    # WIDEST_KEY_BITS that do not, chosen at its first compression; its keys decay by the same step (K6 -> K5).
    # Needs query weights (weigh_keys) and integer MSE key bits. None: every layer keeps key_bits. AUTO: KEY_ERROR
    # where it applies (auto_key_error), None elsewhere.
    key_error: float | None | str = AUTO
    # Keys that widen by their error also take the half steps K4.5 and K5.5: the quarter of the channels with the
    # most energy at the calibration (after the weights) one bit wider, each group rotated on its own (two norms
    # per token). No effect where keys do not widen (key_error and key_output_error None).
    key_half_steps: bool = False
    # Keys by their output error instead: the largest relative error of the attention outputs a layer's keys may give
    # the queries of its first window's last third, each reading the tokens more than a window older than itself as
    # codes (tq_mlx.stream.calibration.output_errors); the layer's keys take the fewest bits from NARROWEST_KEY_BITS
    # up to WIDEST_KEY_BITS whose error, measured by coding its calibration keys at each, is at most this, chosen at
    # its first compression. Needs query weights, integer MSE key bits, no key_error and a window of 3 or more.
    # None: off (key_error decides, if set). AUTO: KEY_OUTPUT_ERROR where it applies and key_error is not given
    # (auto_key_output_error), None elsewhere.
    key_output_error: float | None | str = AUTO
    # The largest relative error of the attention outputs a layer's old values may give re-coded at fewer bits,
    # measured on its first window (tq_mlx.stream.values): past decay_after, its values decay to the fewest bits from
    # decay_value_bits (None: 2) up to value_bits - 1 whose error is at most this, or keep their bits; chosen once the
    # queries of the first window's last third came (config.first_window). Needs integer value_bits of 3 to 7, decay_after
    # and a window of 3 or more; caches whose attention takes views ("codes" fetch) choose, the others keep their bits.
    # None: every layer's values follow decay_value_bits.
    value_error: float | None = None
    # Values by their output error: the largest relative error of the attention outputs a layer's values may give the
    # queries of its first window's last third, each reading the tokens more than a window older than itself as codes
    # (keys as the cache holds them); the layer's values take the fewest bits from NARROWEST_VALUE_BITS up to
    # value_bits in half steps (V3, V3.5, V4) whose error, measured by coding its calibration values at each, is at
    # most this, chosen at its first compression. Needs value_bits above NARROWEST_VALUE_BITS and up to
    # WIDEST_KEY_BITS, no value_error or value decay, and a first window key_output_error could measure on; caches
    # whose attention takes views ("codes" fetch) choose, the others keep value_bits. None: off.
    value_output_error: float | None = None
    center_keys: bool | str = "rope"  # subtract a per-(batch, kv head) key mean μ before quantizing (exact);
    # "rope": the mean before RoPE, subtracted as R(p) μ0 at position p (tq_mlx.models.rope), in the layers whose RoPE
    # make_prompt_cache reads off the model; the others, and caches built without the model, keep μ
    weigh_keys: bool = True  # code keys times per-channel weights from the queries that attend the calibration
    # tokens, the queries divided by them (exact; tq_mlx.stream.calibration.query_weights), in caches whose attention takes
    # views ("codes" fetch); other caches code plain keys. On since 2026-11-26, issue 23 (benchmarks/DEFAULTS.md)
    center_values: bool = False  # same for values with ν: off, because at long context it moves the near-zero
    # values of tokens that heads park their weight on to -ν, costing more than it saves (benchmarks/DEFAULTS.md)
    norm_bits: int = 8  # each token's norm: 16 = float16, 8 = a one-byte log code (half the bytes)
    norm_steps: int = 32  # the 8-bit code's steps an octave: 32 (1.1% at most off, 2^-3.5 .. 2^4.4 of the stream's
    # scale) or 16 (2.2%, 2^-8 .. 2^8; every 8-bit cache before 2026-12-06): a norm's error scales a key's whole
    # logit, and with 16 steps it was as large as 5-bit codes' own error (tq_mlx.quant.quantizer)
    correct_norms: bool | str = True  # store each code's norm as ‖x‖ / ‖c[idx]‖, so the decoded vector keeps the
    # token's norm (TurboQuant+'s norm correction; tq_mlx.quant.quantizer): the same bytes, codes and decoding; on
    # since 2026-12-05, when the default's values fell to V3 (benchmarks/DEFAULTS.md). "keys" / "values": that side's
    # alone
    # Each query of a prefill chunk reads the cache as a decode step at its position would: the compressed tokens
    # a token-by-token cache would hold then as codes, the later ones in float (the window before the chunk and
    # the chunk's own tokens, read from the update, never held), so what a prompt leaves in the cache and its
    # logits do not depend on the prefill chunk (mlx-lm's 2048 against the window). In caches whose
    # attention takes views ("codes" fetch); the others read what the cache holds. On since 2026-12-03, issue 53:
    # inside mlx-lm's 2048-token chunks the queries read their neighbours as codes (benchmarks/DEFAULTS.md)
    prefill_as_decode: bool = True
    # Temporal decay: compressed tokens at least decay_after tokens old (counted back from the newest) are
    # re-coded from their codes at decay_key_bits / decay_value_bits (None: that side keeps its bits), in whole
    # compress blocks. None: no decay. Integer bits below the side's own, which must be integer too (the codes
    # of both ages share one rotation); not with QJL keys; boundary and protected layers do not decay.
    decay_after: int | None | str = AUTO
    decay_key_bits: float | None | str = AUTO
    decay_value_bits: float | None | str = AUTO
    # Codes of 2 to 6 bits as a bitshift trellis's (tq_mlx.quant.trellis): the same symbols and bytes, decoded by a
    # window of the last symbols through a 2^12-entry codebook (2^10 at 5 bits), chosen by Viterbi; less error at the
    # same bits (benchmarks/DEFAULTS.md). QJL keys keep Lloyd-Max codes. Kernels read and encode them.
    trellis: bool = False
    seed: int = 0
    step: int = 256  # compressed storage grows in steps of this many tokens, like KVCache

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for name in ("key_bits", "value_bits", "boundary_bits", "protect_bits"):
            set_(name, check_bits(getattr(self, name), name))
        for name in ("qjl", "center_keys", "center_values", "weigh_keys", "correct_norms", "key_half_steps",
                     "prefill_as_decode", "protect_before_rope", "trellis"):
            words = {"center_keys": ("rope",), "correct_norms": CORRECT_NORMS_SIDES}.get(name, ())  # besides True/False
            if not isinstance(getattr(self, name), bool) and getattr(self, name) not in words:
                allowed = ["True", "False", *map(repr, words)]
                raise ValueError(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {getattr(self, name)!r}")
        if self.qjl and self.key_bits not in PROD_BITS:
            raise ValueError(f"qjl=True needs integer key_bits in {PROD_BITS}, got key_bits={self.key_bits}")
        f = self.protect_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1):
            raise ValueError(f"protect_factor must be a number >= 1 or None (never protect), got {f!r}")
        if self.key_output_error == AUTO:  # a key_error given (a number, or None: keys keep key_bits) decides alone
            first = self.first_window if isinstance(self.window, int) and isinstance(
                self.calibration_tokens, (int, type(None))) else None  # (validated below)
            set_("key_output_error", None if self.key_error != AUTO else
                 auto_key_output_error(self.key_bits, self.qjl, self.weigh_keys, self.window, first))
        e = self.key_error
        if e == AUTO:
            e = None if self.key_output_error is not None else auto_key_error(self.key_bits, self.qjl, self.weigh_keys)
            set_("key_error", e)
        check_target("key_error", e, f"None (keys keep key_bits) or {AUTO!r}")
        if e is not None and (self.qjl or self.key_bits != int(self.key_bits)):
            raise ValueError(f"key_error needs integer key_bits without QJL (the widths it chooses from are "
                             f"{format_bits(self.key_bits)} .. {WIDEST_KEY_BITS}), got key_bits="
                             f"{format_bits(self.key_bits)}{' with qjl' if self.qjl else ''}")
        self._check_key_output_error()
        self._check_value_error()
        if self.norm_bits not in NORM_BITS or isinstance(self.norm_bits, bool):
            raise ValueError(f"norm_bits must be one of {NORM_BITS}, got {self.norm_bits!r}")
        if self.norm_steps not in NORM_STEPS or isinstance(self.norm_steps, bool):
            raise ValueError(f"norm_steps must be one of {NORM_STEPS}, got {self.norm_steps!r}")
        if self.boundary_sides not in BOUNDARY_SIDES:
            raise ValueError(f"boundary_sides must be one of {', '.join(map(repr, BOUNDARY_SIDES))}, got "
                             f"{self.boundary_sides!r}")
        for name, low in (("window", 0), ("sinks", 0), ("boundary_layers", 0), ("seed", 0), ("step", 1)):
            check_int(name, getattr(self, name), low)
        if self.calibration_tokens is not None:
            check_int("calibration_tokens", self.calibration_tokens, 1)
        if self.compress_block is not None:
            check_int("compress_block", self.compress_block, 1)
            if self.window and self.compress_block > self.window:
                raise ValueError(
                    f"compress_block must be between 1 and window={self.window}, got {self.compress_block}"
                )
        self._resolve_decay()
        self._check_decay()
        self._check_value_output_error()

    def _check_key_output_error(self) -> None:
        e = self.key_output_error
        check_target("key_output_error", e, f"None (off: key_error decides) or {AUTO!r}")
        if e is None:
            return
        if self.key_error is not None:
            raise ValueError(f"key_output_error and key_error both choose the keys' widths: set one, got key_error="
                             f"{self.key_error!r} and key_output_error={e!r}")
        if self.qjl or self.key_bits != int(self.key_bits) or not self.weigh_keys:
            raise ValueError(f"key_output_error needs weighed (weigh_keys) integer MSE key bits (the widths it "
                             f"chooses from are {NARROWEST_KEY_BITS} .. {WIDEST_KEY_BITS}), got key_bits="
                             f"{format_bits(self.key_bits)}{' with qjl' if self.qjl else ''}, weigh_keys={self.weigh_keys}")
        if isinstance(self.window, int) and self.window < 3:
            raise ValueError(f"key_output_error measures on the first window's queries: it needs a window of 3 or "
                             f"more, got {self.window!r}")
        if isinstance(self.window, int) and isinstance(self.calibration_tokens, (int, type(None))) and \
                self.first_window < (least := output_error_first_window(self.window)):
            raise ValueError(f"key_output_error measures on the queries of the first window's last third, each reading "
                             f"the tokens more than a window ({self.window}) older than itself as codes: it needs a "
                             f"first window of at least {least} tokens (calibration_tokens), got {self.first_window}")

    def _check_value_output_error(self) -> None:
        e = self.value_output_error
        check_target("value_output_error", e, "None (off: values keep value_bits)")
        if e is None:
            return
        if not NARROWEST_VALUE_BITS < self.value_bits <= WIDEST_KEY_BITS:
            raise ValueError(f"value_output_error chooses the values' widths from {NARROWEST_VALUE_BITS} up to value_bits "
                             f"in half steps: it needs value_bits above {NARROWEST_VALUE_BITS} and at most "
                             f"{WIDEST_KEY_BITS}, got value_bits={format_bits(self.value_bits)}")
        if self.value_error is not None or self.decay_value_bits is not None:
            raise ValueError(f"value_output_error chooses the bits of every compressed value: it does not go with "
                             f"value_error or decaying values, got value_error={self.value_error!r}, "
                             f"decay_value_bits={self.decay_value_bits!r}")
        if self.window < 3 or self.first_window < output_error_first_window(self.window):
            raise ValueError(f"value_output_error measures on the queries of the first window's last third, each "
                             f"reading the tokens more than a window older than itself as codes: it needs a window of 3 "
                             f"or more and a first window of at least {output_error_first_window(max(self.window, 3))} "
                             f"tokens (calibration_tokens), got window={self.window}, first window {self.first_window}")

    def _check_value_error(self) -> None:
        e = self.value_error
        check_target("value_error", e, "None (values follow decay_value_bits)")
        if e is None:
            return
        if not value_widths(self.value_bits):
            raise ValueError(f"value_error needs integer value_bits of 3 to 7 (old values decay to 2 .. value_bits - 1 "
                             f"bits), got value_bits={format_bits(self.value_bits)}")
        if self.decay_after is None:
            raise ValueError("value_error chooses the bits old values decay to, layer by layer: it needs decay_after "
                             f"(or {AUTO!r}), got decay_after=None")
        if isinstance(self.window, int) and self.window < 3:
            raise ValueError(f"value_error measures on the window's tokens: it needs a window of 3 or more, got "
                             f"{self.window!r}")

    def _resolve_decay(self) -> None:
        """Decay fields left at AUTO, resolved (see the class doc); the resolved config holds no AUTO."""
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        names = DECAY_FIELDS
        for name in names:
            v = getattr(self, name)
            if isinstance(v, str) and v != AUTO:
                raise ValueError(f"{name} must be a number, None or {AUTO!r}, got {v!r}")
        if self.decay_after is None:
            for name in names[1:]:
                if getattr(self, name) == AUTO:
                    set_(name, None)
            return
        # bits left at AUTO follow auto_decay_bits once decay is asked for (an age, either side's bits, or
        # value_error); asked for nothing, nothing decays
        asked = self.value_error is not None or any(getattr(self, name) != AUTO for name in names)
        for side in DECAY_STEP:
            if getattr(self, f"decay_{side}_bits") == AUTO:  # values by their error choose theirs per layer
                set_(f"decay_{side}_bits", None if not asked or (side == "value" and self.value_error is not None)
                     else auto_decay_bits(side, getattr(self, f"{side}_bits"), self.qjl))
        if self.decay_after == AUTO:
            decays = (any(getattr(self, f"decay_{side}_bits") is not None for side in DECAY_STEP)
                      or self.value_error is not None)
            # a window that alone reaches DECAY_AFTER moves it: one compress block always stays at full bits
            set_("decay_after", max(DECAY_AFTER, self.window + self.compress_block_size) if decays else None)

    def _check_decay(self) -> None:
        sides = (("decay_key_bits", self.key_bits), ("decay_value_bits", self.value_bits))
        if self.decay_after is None:
            for name, _ in sides:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs decay_after (the token age at which tokens are re-coded)")
            return
        least = self.window + self.compress_block_size
        a = self.decay_after
        if isinstance(a, bool) or not isinstance(a, int) or a < least:  # fresh codes always remain next to decayed
            raise ValueError(f"decay_after must be an integer >= {least} (window + compress_block: at least one "
                             f"block stays at full bits), got {a!r}")
        if all(getattr(self, name) is None for name, _ in sides) and self.value_error is None:
            raise ValueError("decay_after needs decay_key_bits or decay_value_bits (the bits tokens decay to; neither "
                             f"side decays by itself at K{format_bits(self.key_bits)}/V{format_bits(self.value_bits)}"
                             f"{' with QJL' if self.qjl else ''}: see auto_decay_bits)")
        for name, bits in sides:
            b = getattr(self, name)
            if b is None:
                continue
            if isinstance(b, bool) or b not in DECAY_BITS:
                raise ValueError(f"{name} must be one of {DECAY_BITS} or None, got {b!r}")
            object.__setattr__(self, name, int(b))
            side = name.removeprefix("decay_")
            if bits != int(bits) or b >= bits:
                raise ValueError(f"{name}={b} must be an integer below {side}={format_bits(bits)}, itself an "
                                 f"integer (decayed and fresh codes share one rotation)")
        if self.qjl and self.decay_key_bits is not None:
            raise ValueError("decay_key_bits does not apply to QJL keys (qjl=True): set it to None")

    @classmethod
    def preset(cls, name: str, **kwargs) -> "TurboQuantConfig":
        """A named setting (PRESETS: quality, default, compact), other fields as given."""
        return cls(**{**_preset_fields(name), **kwargs})

    @classmethod
    def from_bits(cls, bits: float, **kwargs) -> "TurboQuantConfig":
        """The same bit width for keys and values, other fields as given."""
        return cls(key_bits=bits, value_bits=bits, **kwargs)

    @property
    def decayed_bits(self) -> tuple[float, float]:
        """(key_bits, value_bits) of decayed tokens: each side's decay bits, or its own where it does not decay."""
        return self.decay_key_bits or self.key_bits, self.decay_value_bits or self.value_bits

    @property
    def narrowest_value_bits(self) -> int:
        """The fewest bits old values may take by their error (value_error): decay_value_bits, or the floor."""
        return self.decay_value_bits if self.decay_value_bits is not None else DECAY_FLOOR["value"]

    @property
    def compress_block_size(self) -> int:
        """Tokens compressed at a time when the window overflows."""
        return self.compress_block if self.compress_block is not None else min(max(self.window, 1), COMPRESS_BLOCK)

    @property
    def first_window(self) -> int:
        """The most tokens the window holds before the first compression, which calibrates on them: the window, or
        calibration_tokens when that is larger."""
        return max(self.window, self.calibration_tokens or 0)

    @property
    def bound_floor(self) -> int:
        """The least max_kv_size a cache of this config takes: sinks + first_window + compress_block - 1 (the float
        sinks and window are never dropped, nothing is compressed before the calibration tokens came, and a bound
        drops whole compress blocks)."""
        return self.sinks + self.first_window + self.compress_block_size - 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TurboQuantConfig":
        d = dict(d)
        if "block" in d and "compress_block" not in d:  # the field's name in prompt-cache files of state version 1
            d["compress_block"] = d.pop("block")
        # Fields a file written before they existed does not name had the meaning of their absence then: float16
        # norms, no decay, no key weights (the defaults changed since).
        d.setdefault("norm_bits", 16)
        d.setdefault("norm_steps", 16)
        d.setdefault("weigh_keys", False)
        d.setdefault("key_error", None)
        d.setdefault("key_output_error", None)
        d.setdefault("correct_norms", False)
        d.setdefault("key_half_steps", False)
        d.setdefault("protect_before_rope", False)
        d.setdefault("prefill_as_decode", False)
        d.setdefault("trellis", False)
        for name in ("key_error", "key_output_error", "value_error", "value_output_error", "protect_factor"):  # mlx-lm's prompt-cache files keep numbers in float32
            if isinstance(d.get(name), float):
                d[name] = float(f"{d[name]:.7g}")
        for name in ("decay_after", "decay_key_bits", "decay_value_bits"):
            d.setdefault(name, None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown TurboQuantConfig fields {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**d)


# Named settings, by what they trade (the commands' --tq-preset); their bytes: --plan, estimate_kv_bytes; their
# measurements: benchmarks/DEFAULTS.md and the README's quality tables.
PRESETS: dict[str, dict] = {
    # K8/V4, 8-bit norms, no decay; the window and norms (their code too) each was measured with, whatever the default's
    "quality": dict(key_bits=8, value_bits=4, decay_after=None, window=768, calibration_tokens=None,
                    correct_norms=False, norm_steps=16),
    # K4/V4 with keys K3-K6 by their output error, 8-bit norms corrected, every token at its bits
    "default": {},
    # K4/V3, 8-bit norms, tokens past 4096 at K2/V2, keys not widened: the fewest bytes past ~8k tokens (below, its
    # 768-token window holds more than the default's 128)
    "compact": dict(value_bits=3, decay_after=4096, decay_key_bits=2, decay_value_bits=2, key_error=None, window=768,
                    calibration_tokens=None, correct_norms=False, norm_steps=16),
}


def _preset_fields(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: allowed are {', '.join(PRESETS)}")
    return PRESETS[name]


def derive_config(base: str | TurboQuantConfig = "default", bits: float | None = None, *,
                  max_kv_size: int | None = None, **fields) -> TurboQuantConfig:
    """The config `fields` make of `base` (a preset's name, or a config), as the --tq-* flags and tq-chat's --bits
    make it; `bits` sets key_bits and value_bits where fields do not. The one place a config is derived:

    - a base config whose decay is the one its bits give when none is asked for (see TurboQuantConfig; a decay
      given explicitly but equal to it counts as that) gets the decay the new bits give: --bits 3 does not decay;
    - a side given new bits that its base decay bits no longer lower (fractional bits, or bits not above the decay
      bits: decay only ever lowers integer bits, one rotation) keeps its bits at every age, unless fields name its
      decay bits; and when no side is left to decay, nothing decays (decay_after None).
    - a base config whose key_error and key_output_error are the ones its keys give when none is asked for
      (auto_key_output_error, auto_key_error) gets the ones the new keys give; QJL or fractional key bits drop an
      explicit key_error or key_output_error unless fields name it (they choose integer MSE widths).

    Everything else is validated by TurboQuantConfig as given (ValueError naming the conflict). max_kv_size: a
    bounded cache (--max-kv-size), which fit_max_kv_size fits the config to."""
    if isinstance(base, TurboQuantConfig):
        start = base.to_dict()
        auto = dict.fromkeys(DECAY_FIELDS, AUTO)
        if dataclasses.replace(base, **auto) == base:
            start.update(auto)
        if dataclasses.replace(base, key_error=AUTO, key_output_error=AUTO) == base:
            start.update(key_error=AUTO, key_output_error=AUTO)
        elif dataclasses.replace(base, key_error=AUTO) == base:
            start["key_error"] = AUTO
    else:
        start = dict(_preset_fields(base))
    if bits is not None:
        fields = {"key_bits": bits, "value_bits": bits, **fields}
    for side in ("key", "value"):
        name, new_bits = f"decay_{side}_bits", fields.get(f"{side}_bits")
        decay_bits = start.get(name, AUTO)
        if (name not in fields and new_bits is not None and decay_bits not in (None, AUTO)
                and (decay_bits >= new_bits or new_bits != int(new_bits))):
            fields[name] = None
    merged = {**start, **fields}
    vb = merged.get("value_bits", TurboQuantConfig.value_bits)
    if "value_error" not in fields and merged.get("value_error") is not None and not value_widths(vb):
        merged["value_error"] = None  # old values decay by their error only from integer widths above the floor
    if merged.get("decay_after", AUTO) is not None and merged.get("value_error") is None and all(
            merged.get(f"decay_{side}_bits", AUTO) is None for side in ("key", "value")):
        merged["decay_after"] = None  # nothing left to decay to
    kb = merged.get("key_bits", TurboQuantConfig.key_bits)
    if "key_error" not in fields and merged.get("key_error", AUTO) != AUTO and (merged.get("qjl") or kb != int(kb)):
        merged["key_error"] = None  # widths by error choose among integer MSE widths: QJL or 2.5/3.5 keep theirs
    if "key_output_error" not in fields and merged.get("key_output_error") is not None and (
            merged.get("qjl") or kb != int(kb)):
        merged["key_output_error"] = None
    return fit_max_kv_size(TurboQuantConfig(**merged), max_kv_size)


def fit_max_kv_size(config: TurboQuantConfig, max_kv_size: int | None) -> TurboQuantConfig:
    """The config a cache bounded to max_kv_size tokens uses, as the commands take --max-kv-size (mlx-lm's own flag
    takes any size): `config` itself when the bound holds its float sinks, first window and a compress block less a
    token (bound_floor: the float parts are never dropped, nor anything before the first compression,
    check_max_size); else the config with the window and the compress block shrunk in their proportion until the
    bound holds the sinks, the window and two blocks less a token, so that compressed tokens always remain next to
    the window (a bound that holds one block at most would drop every compressed token as soon as it is made); tiny bounds keep blocks of 1
    (below the sinks: as many sinks as the bound, no window). Calibration tokens the bound cannot hold come down to
    what it holds first (all of them: None when the window shrinks). The library's make_prompt_cache keeps an explicit
    config as given and refuses a bound below it; derive_config(max_kv_size=...) fits."""
    if max_kv_size is None:
        return config
    check_int("max_kv_size", max_kv_size, 1)
    block = config.compress_block_size
    if config.bound_floor <= max_kv_size:
        return config
    if config.sinks + config.window + block - 1 <= max_kv_size:  # the window fits: calibrate on what the bound holds
        return _refit(config, calibration_tokens=max_kv_size - config.sinks - block + 1)
    sinks = min(config.sinks, max_kv_size)
    room = max_kv_size - sinks + 1  # window + 2 blocks
    if config.window == 0:
        window, block = 0, min(block, room)
    else:
        block = max(2, room * block // (config.window + 2 * block))
        window = room - 2 * block
        if window < block:  # too small for two blocks next to a window: a window and blocks of 1
            window, block = room - 1, 1
    return _refit(config, sinks=sinks, window=window, compress_block=block, calibration_tokens=None,
                  value_error=config.value_error if window >= 3 else None)


def _refit(config: TurboQuantConfig, **changes) -> TurboQuantConfig:
    """dataclasses.replace(config, **changes), with keys by their logit error (key_error's AUTO) in place of the
    output error when the new window or first window cannot measure that (output_error_first_window)."""
    window = changes.get("window", config.window)
    first = max(window, changes.get("calibration_tokens", config.calibration_tokens) or 0)
    if config.key_output_error is not None and (window < 3 or first < output_error_first_window(window)):
        changes.update(key_output_error=None, key_error=AUTO)
    return dataclasses.replace(config, **changes)


def check_max_size(max_size: Any, config: TurboQuantConfig) -> int:
    """max_size (max_kv_size) as an int, or ValueError: the float sinks and window are never dropped, so the
    bound must hold them and one compress block less a token."""
    least = config.bound_floor
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < least:
        raise ValueError(
            f"max_kv_size={max_size!r}: a bounded TurboQuant cache needs at least sinks + "
            f"{'calibration_tokens' if config.first_window > config.window else 'window'} + compress_block - 1 = "
            f"{least} tokens (the float sinks and window are never dropped, nor anything before the first "
            f"compression); raise it, or lower the window "
            f"(tq_mlx.config.fit_max_kv_size gives the config that fits, as the commands' --max-kv-size does)"
        )
    return max_size
