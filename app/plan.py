"""Preflight: will the model and a --ctx-token KV cache fit in the memory MLX can use here?

All numbers come from tq_mlx.planner.memory; this module only compares them and words the verdict. The saving it shows is
memory.planned_saving (against mlx-lm's own cache for the same tokens, memory.SAVED_AGAINST), the figure the
panel and tq-generate's summary show for a live cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tq_mlx.cache import TurboQuantConfig
from tq_mlx.config import BOUNDARY_SIDES, NARROWEST_KEY_BITS, NARROWEST_VALUE_BITS, WIDEST_KEY_BITS, derive_config, format_bits
from tq_mlx.planner import memory
from tq_mlx.models.architectures import FLOAT_FETCH
from tq_mlx.models.architectures import attention_layout, model_types
from tq_mlx.config import fit_max_kv_size
from tq_mlx.planner.display import bound_text, config_label, describe_config, format_bytes, saving_words
from tq_mlx.planner.memory import Saving, estimate_kv_bytes, estimate_peak_bytes, fetch_transient_bytes, kv_float_dtype

# Share of the available memory the weights and KV cache may take; the rest is left for activations
# (prefill chunks, attention scores) and everything else running.
USABLE_FRACTION = 0.9
# Tried in this order when suggesting fewer bits.
SUGGESTED_BITS = (4, 3.5, 3, 2.5, 2)


@dataclass
class Plan:
    model: str
    ctx: int
    config: TurboQuantConfig | None
    weights: int
    kv_fp16: int
    kv: int  # with `config` (mlx-lm's cache, kv_mlx_lm, when config is None)
    available: int
    available_source: str
    trained_ctx: int | None
    attention_layers: int
    n_layers: int
    kv_heads: int
    head_dim: int
    warnings: list[str] = field(default_factory=list)
    suggestion: str | None = None
    sliding_layers: tuple[tuple[int, int], ...] = ()  # (layer, window): bounded float caches, never compressed
    linear_layers: tuple[int, ...] = ()  # recurrent / linear-attention layers: a fixed-size state
    peak: int = 0  # predicted peak MLX memory of prefill + decode at ctx with `config` (memory.estimate_peak_bytes)
    peak_float: int = 0  # the same with mlx-lm's float cache
    prefill_step: int = 2048
    protect_bytes: int = 0  # what one layer adds at ctx if its keys protect themselves (config.protect_bits)
    widen_bytes: int = 0  # what one layer's keys at the most bits key_error gives hold beyond key_bits
    narrow_bytes: int = 0  # what one layer's values kept at their bits hold beyond the fewest (value_error, value_output_error)
    value_dim: int = 0  # a full layer's value width (the rope key's for MLA); 0: head_dim
    sliding_geometry: tuple[int, int, int] | None = None  # (kv heads, key dim, value dim) if not the full layers'
    shared_layers: tuple[int, ...] = ()  # KV-shared layers: no cache of their own
    fetch: str = "codes"  # what a TurboQuant fetch gives the model (tq_mlx.models.architectures.fetch_for)
    latent: bool = False  # multi-head latent attention: the cache holds the latent and the rope key
    fetch_transient: int = 0  # float bytes one layer's fetch materializes at ctx (memory.fetch_transient_bytes)
    float_reason: str = ""  # why the model's fetch decodes to float (architectures.FLOAT_FETCH)
    max_kv_size: int | None = None  # a bounded cache (--max-kv-size): tokens each full layer keeps
    decayed: int = 0  # tokens a decaying stream holds at the decay bits at ctx (memory.decayed_tokens)
    kv_mlx_lm: int = 0  # mlx-lm's own cache at ctx in kv_dtype (memory.estimate_mlx_lm_bytes): what `kv` saves against
    kv_dtype: str = "float16"  # the dtype the model runs in, and its KV cache's float parts
    source: str = ""  # where the model's config (and weight size) came from, when it is not a local folder
    bound_note: str | None = None  # how --max-kv-size fitted the config (display.bound_text)

    @property
    def saving(self) -> Saving:
        """What the cache saves at ctx against mlx-lm's own cache (memory.planned_saving)."""
        return Saving(self.kv, self.kv_mlx_lm)

    @property
    def usable(self) -> int:
        return int(self.available * USABLE_FRACTION)

    @property
    def needed(self) -> int:
        """What must fit: the predicted peak (weights + KV + one prefill chunk's transient)."""
        return self.peak or self.weights + self.kv

    @property
    def fits(self) -> bool:
        return self.needed <= self.usable


def memory_source() -> str:
    import mlx.core as mx

    try:
        if mx.metal.is_available():
            return "MLX recommended working set"
    except (AttributeError, RuntimeError):
        pass
    return "physical memory"


def make_plan(model: str, model_config: dict, weights: int, ctx: int, config: TurboQuantConfig | None,
              available: int, available_source: str = "physical memory", dtype: str | None = None,
              prefill_step: int = 2048, max_kv_size: int | None = None) -> Plan:
    """Estimate weights, KV and the peak of prefill + decode at `ctx` tokens, compare the peak with
    `available`, and suggest settings that fit. dtype: what --dtype casts the model to (its config's
    torch_dtype otherwise). max_kv_size: a bounded cache (--max-kv-size), priced as memory.bounded_tokens says,
    with the config fitted to it (config.fit_max_kv_size)."""
    if dtype:  # the KV cache's float parts hold the dtype the model runs in
        model_config = {**model_config, "torch_dtype": dtype}
    lay = attention_layout(model_config)
    fitted = fit_max_kv_size(config, max_kv_size) if config is not None else None
    note = bound_text(config, fitted, max_kv_size) if config is not None and max_kv_size else None
    config = fitted
    saving = memory.planned_saving(model_config, ctx, config, max_kv_size=max_kv_size)
    plan = Plan(
        model=model, ctx=ctx, config=config, weights=weights,
        kv_fp16=estimate_kv_bytes(model_config, ctx, None, max_kv_size=max_kv_size),
        kv=saving.held, kv_mlx_lm=saving.reference, kv_dtype=kv_float_dtype(model_config), bound_note=note,
        available=available, available_source=available_source, trained_ctx=lay.max_context,
        attention_layers=len(lay.full_layers), n_layers=lay.n_layers, kv_heads=lay.n_kv_heads,
        head_dim=lay.head_dim, sliding_layers=lay.sliding_layers, linear_layers=lay.linear_layers,
        peak=estimate_peak_bytes(model_config, ctx, config, weights=weights, prefill_step=prefill_step,
                                 max_kv_size=max_kv_size),
        peak_float=estimate_peak_bytes(model_config, ctx, None, weights=weights, prefill_step=prefill_step,
                                       max_kv_size=max_kv_size),
        prefill_step=prefill_step, value_dim=lay.v_head_dim, sliding_geometry=lay.sliding_kv,
        shared_layers=lay.shared_layers, fetch=lay.fetch, latent=lay.latent, max_kv_size=max_kv_size,
        fetch_transient=fetch_transient_bytes(model_config, ctx, config, prefill_step=prefill_step,
                                              max_kv_size=max_kv_size),
        float_reason=next((FLOAT_FETCH[t] for t in sorted(model_types(model_config)) if t in FLOAT_FETCH),
                          "derives its K=V layers' keys from the stored values" if lay.k_eq_v else ""),
    )
    if config is not None:
        # Which layers protect is decided by their own calibration tokens, so the plan can only price one.
        plan.protect_bytes = memory.protect_layer_bytes(model_config, ctx, config, max_kv_size=max_kv_size)
        plan.widen_bytes = memory.widen_layer_bytes(model_config, ctx, config, max_kv_size=max_kv_size)
        plan.narrow_bytes = memory.narrow_layer_bytes(model_config, ctx, config, max_kv_size=max_kv_size)
        plan.decayed = memory.decayed_tokens(ctx, max_kv_size, config)
    if lay.max_context and ctx > lay.max_context:
        plan.warnings.append(
            f"--ctx {ctx:,} is beyond the model's trained context of {lay.max_context:,} tokens; "
            f"answers past {lay.max_context:,} tokens may degrade"
        )
    if not plan.fits:
        plan.suggestion = _suggest(plan, model_config)
    return plan


def _suggest(plan: Plan, model_config: dict) -> str:
    room = plan.usable - plan.weights
    if room <= 0:
        return (f"the weights alone need {format_bytes(plan.weights)} of {format_bytes(plan.usable)} usable: "
                f"choose a smaller or more strongly quantized model")
    tips = []
    base = plan.config or TurboQuantConfig()
    for bits in SUGGESTED_BITS:
        cfg = with_bits(base, bits)
        peak = estimate_peak_bytes(model_config, plan.ctx, cfg, weights=plan.weights, prefill_step=plan.prefill_step,
                                   max_kv_size=plan.max_kv_size)
        if bits < max(base.key_bits, base.value_bits) and peak <= plan.usable:
            tips.append(f"--bits {bits} fits {plan.ctx:,} tokens")
            break
    ctx = max_context(model_config, room, plan.config, plan.prefill_step, plan.max_kv_size)
    if ctx >= 1024:
        tips.append(f"--ctx {format_ctx(ctx)} fits with the current settings")
    if not tips:
        return "even a short context does not fit next to the weights: choose a smaller model"
    return "; or ".join(tips)


def with_bits(config: TurboQuantConfig, bits: float) -> TurboQuantConfig:
    """config at `bits` for keys and values (no QJL), as --bits would set them (tq_mlx.config.derive_config: an
    automatic decay follows the bits, 3-bit keys do not decay; any other decay stays where it still lowers integer
    bits)."""
    return derive_config(config, bits, qjl=False)


def max_context(model_config: dict, budget: int, config: TurboQuantConfig | None, prefill_step: int = 2048,
                max_kv_size: int | None = None) -> int:
    """The largest context (rounded down to 1024 tokens) whose KV cache and prefill transient (the predicted
    peak beyond the weights) fit in `budget` bytes."""
    return memory.max_context(model_config, budget, config, prefill_step=prefill_step,
                              max_kv_size=max_kv_size) // 1024 * 1024


def format_ctx(n: int) -> str:
    """131072 -> '128k', 1048576 -> '1m', 5000 -> '5000'."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}k"
    return str(n)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def geometry(plan: Plan) -> str:
    """The shape of a full layer's cache: "8 KV heads x 128", "4 KV heads x 192/128" (keys/values), or for MLA
    "MLA latent 512 + rope key 64"; Gemma 4 adds its sliding layers' shape."""
    dv = plan.value_dim or plan.head_dim
    if plan.latent:
        return f"MLA latent {plan.head_dim} + rope key {dv}"
    dims = f"{plan.head_dim}" if dv == plan.head_dim else f"{plan.head_dim}/{dv}"
    text = f"{plan.kv_heads} KV heads x {dims}"
    if plan.sliding_geometry:
        h, k, v = plan.sliding_geometry
        text += f" full, {h} x {k if k == v else f'{k}/{v}'} sliding"
    return text


def layer_roles(plan: Plan) -> str:
    """Which layers TurboQuant compresses and which keep mlx-lm's own cache (or none), and why."""
    kind = "latent-attention (MLA)" if plan.latent else "full-attention"
    full = f"{plan.attention_layers} {kind} layer{'s' if plan.attention_layers != 1 else ''}"
    parts = [f"{full} {'compressed' if plan.config else 'in float16'}"]
    if plan.sliding_layers:
        windows = sorted({w for _, w in plan.sliding_layers})
        parts.append(f"{len(plan.sliding_layers)} sliding-window layers stay float (window "
                     f"{', '.join(f'{w:,}' for w in windows)}: bounded)")
    if plan.shared_layers:
        parts.append(f"{_plural(len(plan.shared_layers), 'KV-shared layer')} hold no cache (they attend to an "
                     f"earlier layer's)")
    if plan.linear_layers:
        parts.append(f"{len(plan.linear_layers)} linear-attention layers keep a fixed-size state")
    return "; ".join(parts)


def fetch_path(plan: Plan) -> str:
    """How the compressed layers are read (architectures.fetch_for), with the float transient it costs."""
    extra = f" (+{format_bytes(plan.fetch_transient)} float at this context, freed after each layer)"
    if plan.fetch == "float":
        why = f": the model {plan.float_reason}" if plan.float_reason else ""
        return f"decode-to-float: every fetch decodes one layer's cache to float tensors{extra}{why}"
    if plan.fetch == "latent":
        return ("latent: decode attends to the compressed latent on the codes; prefill chunks and the rope key "
                f"get float tensors decoded from the codes, one layer at a time{extra}")
    return "on the codes: attention reads the compressed keys and values directly, no float copy"


def decay_text(plan: Plan) -> str:
    """Temporal decay at the plan's context: "K4→3/V3→2 after 2048: 30,720 of 32,768 tokens at the decay bits";
    values by their error (value_error) take the bits each layer chose for them: "K4/V4 after 256: 32,512 of 32,768
    tokens old enough (values V3 to V4 by their output error)"."""
    c = plan.config
    label, keys_decay = config_label(c), c.decay_key_bits is not None
    if c.value_error is None:
        text = f"{label}: {plan.decayed:,} of {plan.ctx:,} tokens at the decay bits"
    else:  # the values' bits are each layer's choice; the age is the label's, where the keys decay too
        label += "" if keys_decay else f" after {c.decay_after}"
        text = (f"{label}: {plan.decayed:,} of {plan.ctx:,} tokens {'at the decay bits' if keys_decay else 'old enough'}"
                f" (values V{c.narrowest_value_bits} to V{format_bits(c.value_bits)} by their output error)")
    if c.boundary_layers:
        what = "layers" if c.boundary_sides == "kv" else f"layers' {BOUNDARY_SIDES[c.boundary_sides]}"
        text += f" (the {2 * c.boundary_layers} boundary {what} keep theirs)"
    return text


def format_plan(plan: Plan) -> str:
    """The preflight report, as tq-chat --plan prints it."""
    cfg = describe_config(plan.config) if plan.config else f"mlx-lm's own {plan.kv_dtype} cache (no TurboQuant)"
    trained = f" (trained: {plan.trained_ctx:,})" if plan.trained_ctx else ""
    rows = [("model", f"{plan.model} ({plan.n_layers} layers, {geometry(plan)})")]
    if plan.source:
        rows.append(("source", plan.source))
    rows.append(("layers", layer_roles(plan)))
    if plan.config and plan.attention_layers:
        rows.append(("fetch", fetch_path(plan)))
    bound = ""
    if plan.max_kv_size:
        bound = (f"; each full layer keeps at most {plan.max_kv_size:,} tokens while decoding (--max-kv-size; a "
                 f"prefill chunk attends to at most {plan.max_kv_size - 1 + plan.prefill_step:,})")
    rows += [
        ("context", f"{plan.ctx:,} tokens{trained}{bound}"),
        ("weights", format_bytes(plan.weights) if plan.weights else "unknown (not counted below)"),
        ("KV cache", f"{format_bytes(plan.kv)}  {cfg}"),
    ]
    if plan.protect_bytes:  # under the KV cache row it adds to (a config that decays: its decay row follows)
        rows.append(("", f"+{format_bytes(plan.protect_bytes)} for each layer whose keys protect themselves "
                         f"(K{plan.config.protect_bits:g}, chosen at its first compression; the panel names them)"))
    if plan.widen_bytes:
        c, kb = plan.config, format_bits(plan.config.key_bits)
        rule = (f"K{kb} whose logit error is at most {c.key_error:g}" if c.key_output_error is None else
                f"K{NARROWEST_KEY_BITS} whose output error on its first window is at most {c.key_output_error:g}")
        rows.append(("", f"at most: every layer's keys at K{WIDEST_KEY_BITS} (each takes the fewest bits from {rule}, "
                         f"at its first compression; the panel names them); -{format_bytes(plan.widen_bytes)} for "
                         f"each layer that keeps K{kb}" + ("" if c.key_output_error is None else f", more at K{NARROWEST_KEY_BITS}")))
    if plan.narrow_bytes and plan.config.value_output_error is not None:
        vb = format_bits(plan.config.value_bits)
        rows.append(("", f"at most: every layer's values at V{vb} (each takes the fewest bits from "
                         f"V{NARROWEST_VALUE_BITS} in half steps whose output error on its first window is at most "
                         f"{plan.config.value_output_error:g}, at its first compression; the panel names them); "
                         f"-{format_bytes(plan.narrow_bytes)} for each layer at V{NARROWEST_VALUE_BITS}"))
    elif plan.narrow_bytes:
        vb, least = format_bits(plan.config.value_bits), plan.config.narrowest_value_bits
        rows.append(("", f"at most: every layer's old values kept at V{vb} (each decays them to the fewest bits from "
                         f"V{least} whose output error on its first window is at most {plan.config.value_error:g}, once "
                         f"its window's last queries came; the panel names them); -{format_bytes(plan.narrow_bytes)} "
                         f"for each layer whose values decay to V{least}"))
    if plan.config:
        rows += [("mlx-lm", f"{format_bytes(plan.kv_mlx_lm)}  mlx-lm's own {plan.kv_dtype} cache for the same "
                            f"{plan.ctx:,} tokens"),
                 ("saved", saving_words(plan.saving, plan.kv_dtype))]
    if plan.config and plan.config.decay_after is not None and plan.attention_layers:
        rows.append(("decay", decay_text(plan)))
    rows += [
        ("peak", f"{format_bytes(plan.needed)} predicted for prefill ({plan.prefill_step:,}-token chunks) + decode"
                 + (f"; {format_bytes(plan.peak_float)} with mlx-lm's float cache" if plan.config else "")),
        ("total", f"{format_bytes(plan.needed)} of {format_bytes(plan.usable)} usable "
                  f"({int(USABLE_FRACTION * 100)}% of {format_bytes(plan.available)} {plan.available_source})"),
    ]
    verdict = ("fits" if plan.fits else "does NOT fit") + f" ({format_bytes(abs(plan.usable - plan.needed))} "
    verdict += "to spare)" if plan.fits else "short)"
    rows.append(("verdict", verdict))
    out = [f"{k:<11} {v}" for k, v in rows]
    if plan.bound_note:
        out.append(f"note: {plan.bound_note}")
    if plan.suggestion:
        out.append(f"{'suggestion':<11} {plan.suggestion}")
    out += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(out)


# --- a plan from a config alone ---------------------------------------------------------------------------------

# The configs tq-chat ships for the README's models (config.json numbers with their sources): benchmarks/configs in
# a checkout, installed as tq_chat/configs (pyproject.toml maps the folder).
CONFIG_DIRS = (Path(__file__).resolve().parent.parent / "benchmarks" / "configs", Path(__file__).resolve().parent / "configs")
# Bits per weight of an mlx-lm affine conversion ("...-4bit"): the bits plus a float16 scale and bias per 64 weights.
AFFINE_OVERHEAD = 0.5
# What a bare model name (a short name or a shipped config's) is planned with: mlx-community's 4-bit conversion,
# which tq-chat's short names download.
NAME_WEIGHT_BITS = 4.5


def _model_key(name: str) -> str:
    """"mlx-community/Qwen3.5-35B-A3B-4bit" and "Qwen3.5-35B-A3B" -> "qwen3.5-35b-a3b": the owner and the tags of
    a conversion or fine-tune dropped, so that every name of one model matches its shipped config."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    while True:
        shorter = re.sub(r"-(\d+(\.\d+)?bit|bf16|fp16|float16|mlx|instruct|it|chat|dwq)$", "", key)
        if shorter == key:
            return key
        key = shorter


def shipped_config(*names: str | None) -> dict | None:
    """The config tq-chat ships (CONFIG_DIRS) for any of `names` (a short name, a repo id), None if none matches;
    with its "file"."""
    wanted = {_model_key(n) for n in names if n}
    for folder in CONFIG_DIRS:
        for f in sorted(folder.glob("*.json")):
            entry = json.loads(f.read_text())
            if wanted & {_model_key(entry.get("name", "")), _model_key(entry.get("hf_repo", ""))}:
                return {**entry, "file": f.name}
    return None


def weight_bits(repo_id: str | None) -> float:
    """Bits per weight a model is planned with from its parameter count: a repo named "...-4bit" holds mlx-lm's
    affine 4 bits (4.5 with scales and biases), another repo id its original 16 bits, a bare name the 4-bit
    conversion tq-chat's short names point at (NAME_WEIGHT_BITS)."""
    if repo_id is None:
        return NAME_WEIGHT_BITS
    m = re.search(r"(\d+)-?bit", repo_id.lower())
    return int(m.group(1)) + AFFINE_OVERHEAD if m else 16


def config_only(spec: str, repo_id: str | None) -> tuple[dict, int, str] | None:
    """(config.json, weight bytes, where they came from) for a plan without the model's files or the Hub: the
    Hugging Face cache's config.json of repo_id, else the config tq-chat ships for the model; the weights from the
    shipped parameter count (0: unknown). None when neither is there."""
    cached = None
    if repo_id is not None:
        from huggingface_hub import hf_hub_download

        try:
            cached = json.loads(Path(hf_hub_download(repo_id, "config.json", local_files_only=True)).read_text())
        except Exception:  # noqa: BLE001 (not cached, or unreadable: try the shipped configs)
            cached = None
    shipped = shipped_config(spec, repo_id)
    if cached is None and shipped is None:
        return None
    weights, weights_from = 0, "weights unknown"
    if shipped is not None and shipped.get("params"):
        bits = weight_bits(repo_id)
        weights = int(shipped["params"] * bits / 8)
        weights_from = f"weights estimated as {shipped['params'] / 1e9:.3g}B parameters x {bits:g} bits"
    if cached is not None:
        return cached, weights, f"config.json from the Hugging Face cache ({repo_id}; offline); {weights_from}"
    where = f"the config tq-chat ships for {shipped['name']} (configs/{shipped['file']}; offline)"
    return shipped["config"], weights, f"{where}; {weights_from}"
