"""tq-chat (app/, installed as tq_chat): the conversation engine on its own, and one state on every surface: the
panel, tq-generate's summary, cache_bytes and the plan, on a tiny random model folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tq_chat.plan import format_plan, make_plan
from tests.test_app import panel_text
from tests.test_cli import tiny_model_dir  # noqa: F401  (session fixture)
from tq_mlx.cache import TurboQuantConfig
from tq_mlx.models.architectures import load_model_config
from tq_mlx.planner.display import bits_summary, format_bytes, saving_words
from tq_mlx.planner.machine import weight_bytes
from tq_mlx.planner.memory import chosen_key_widths, estimate_kv_bytes


# --- the conversation engine on its own -----------------------------------------------------------------------


def test_hybrid_model_reuses_its_cache_across_turns():
    """Qwen3.5-style hybrid: the linear-attention state cannot be trimmed, so a turn whose template differs at
    the end of the previous answer goes back to the checkpoint at the end of the previous prompt."""
    from tq_chat.session import ChatSession
    from tests.support.tiny_models import tiny_hybrid, tiny_tokenizer

    model, _ = tiny_hybrid()
    session = ChatSession(model, tiny_tokenizer(), TurboQuantConfig(window=16, calibration_tokens=None), ctx=2048, max_tokens=12)
    first = session.generate("first question")
    assert first.reused_tokens == 0 and first.generated > 0
    prompt_end = first.new_tokens - 1  # the checkpoint: everything but the last prompt token
    second = session.generate("second")
    assert second.reused_tokens >= prompt_end > 0
    assert session.cache_offset() == len(session.tokens)
    # the cache holds exactly the conversation as the template renders it, then the answer
    prompt = session.render(session.messages[:-1])
    assert session.tokens[: len(prompt)] == prompt
    assert len(session.tokens) == len(prompt) + second.generated
    # the panel shows the linear-attention state apart from the KV cache
    from tq_chat.widgets import MemoryPanel

    stats = session.snapshot()
    text = panel_text(MemoryPanel(), stats)
    assert stats["other_bytes"] > 0 and format_bytes(stats["other_bytes"]) in text and "other cache state" in text
    # V4 at every age, the layer's keys at the width their logit error chose (its first window is the window: the
    # output error has nothing coded to measure on there, tq_mlx.config.output_error_first_window); the label
    # wraps in the panel
    assert re.fullmatch(r"K[4-6]/V4 on its 1 attention layer", bits_summary(session.cache))
    assert bits_summary(session.cache) in " ".join(text.split()), text


# --- one state, every surface: the panel, tq-generate's summary, cache_bytes and the plan --------------------------


def fed_session(path: Path, config: TurboQuantConfig, n: int, ctx: int = 1024):
    """A ChatSession on the tiny model with n prompt tokens in its cache (one prefill)."""
    import mlx.core as mx
    from mlx_lm import load

    from tq_chat.session import ChatSession

    model, tokenizer = load(str(path))
    session = ChatSession(model, tokenizer, config, ctx)
    if n:
        session.model(mx.array([[(7 * i) % 200 + 3 for i in range(n)]]), cache=session.cache)
        mx.eval([c.state for c in session.cache])
    return session


@pytest.mark.parametrize("config, n", [(TurboQuantConfig(), 42), (TurboQuantConfig(window=16, calibration_tokens=None, sinks=2), 300)],
                         ids=["nothing compressed yet", "compressed"])
def test_the_panel_summary_cache_bytes_and_plan_agree_on_one_state(tiny_model_dir, config, n):
    from tq_chat.widgets import MemoryPanel
    from tq_mlx.planner.display import saving_text, summary_line, window_text
    from tq_mlx.planner.memory import Saving, cache_bytes

    session = fed_session(tiny_model_dir, config, n)
    s = cache_bytes(session.cache)
    assert s["tokens"] == n and (s["saved_bytes"], s["ratio"]) == (Saving(s["kv_bytes"], s["mlx_lm_bytes"]).saved,
                                                                    Saving(s["kv_bytes"], s["mlx_lm_bytes"]).ratio)
    held, reference, saved, window = (format_bytes(s["kv_bytes"]), format_bytes(s["mlx_lm_bytes"]), saving_text(s),
                                      window_text(s))
    # tq-generate's summary line
    summary = summary_line(session.cache)
    assert (f"KV cache: {held} for {n:,} tokens; mlx-lm's float32 cache would hold {reference}; saved {saved}; "
            f"{window}") in summary, summary
    # tq-chat's panel
    panel = " ".join(panel_text(MemoryPanel(), session.snapshot()).split())
    assert f"held {held}" in panel and f"mlx-lm float32 cache {reference}" in panel
    assert f"saved {saving_text(s, basis=False)}" in panel  # the row above names the basis
    assert " ".join(window.split()) in panel
    # --plan for the same state: the same bytes from config.json alone, worded by the same function
    plan = make_plan("tiny", load_model_config(tiny_model_dir), weight_bytes(tiny_model_dir), n, config, 10**10,
                     dtype="float32")
    # (each layer's keys at the most they take: the widths this cache's layers chose give its bytes exactly)
    widths = chosen_key_widths(session.cache)
    exact = estimate_kv_bytes(load_model_config(tiny_model_dir), n, config, dtype="float32", key_widths=widths)
    assert (exact, plan.kv_mlx_lm) == (s["kv_bytes"], s["mlx_lm_bytes"]) and exact <= plan.kv
    text = format_plan(plan)
    assert f"KV cache    {format_bytes(plan.kv)}  " in text
    assert f"mlx-lm      {reference}  mlx-lm's own float32 cache" in text
    # every ratio says what it is against: mlx-lm's cache in the model's dtype (float16 on a Mac)
    assert f"saved       {saving_words(plan.saving, 'float32')}" in text
    if plan.saving.saved > 0:
        assert saving_words(plan.saving, "float32").endswith("x) against mlx-lm's float32 cache")
    if s["saved_bytes"] > 0:
        assert saved.endswith("x) against mlx-lm's float32 cache") and f"saved {saved}" in summary
    if n == 42:  # before compression starts the first screen says so, and what --ctx will reach
        assert window == ("all 42 tokens in float32 (4 sinks + 128-token window, 768 tokens until the first compression "
                          "calibrates on them): compression starts at token 773")


def test_the_first_screen_shows_what_the_cache_reaches_at_ctx(tiny_model_dir):
    from tq_chat.widgets import MemoryPanel
    from tq_mlx.planner.display import planned_text
    from tq_mlx.planner.memory import planned_saving

    cfg = load_model_config(tiny_model_dir)
    session = fed_session(tiny_model_dir, TurboQuantConfig(), 0, ctx=4096)
    plan = make_plan("tiny", cfg, weight_bytes(tiny_model_dir), 4096, TurboQuantConfig(), 10**10, dtype="float32")
    assert plan.saving == planned_saving(cfg, 4096, TurboQuantConfig(), dtype="float32")
    panel = " ".join(panel_text(MemoryPanel(), {**session.snapshot(), "plan": plan}).split())
    assert ("no tokens yet; the first 772 stay in float32 (4 sinks + 128-token window, 768 tokens until the first "
            "compression calibrates on them): compression starts at token 773") in panel, panel
    assert planned_text(plan.saving, 4096, plan.kv_dtype) in panel
    assert planned_text(plan.saving, 4096, "float32") == (
        f"planned at 4,096 tokens (--ctx): {format_bytes(plan.kv)} held, saved "
        f"{format_bytes(plan.kv_mlx_lm - plan.kv)} ({plan.saving.ratio:.2f}x) against mlx-lm's float32 cache")


def test_presets_on_a_short_prompt_show_what_they_hold_now_and_will_save_at_ctx(tiny_model_dir):
    # At 53 tokens the presets' constants decide what they hold (compact's decay quantizers hold the most): the
    # panel shows that as it is, and next to it the saving each reaches at --ctx, which orders them as they are.
    from tq_chat.widgets import MemoryPanel
    from tq_mlx.planner.display import planned_text

    cfg = load_model_config(tiny_model_dir)
    planned = {}
    for name in ("quality", "default", "compact"):
        config = TurboQuantConfig.preset(name)
        session = fed_session(tiny_model_dir, config, 53, ctx=4096)
        plan = make_plan("tiny", cfg, weight_bytes(tiny_model_dir), 4096, config, 10**10, dtype="float32")
        stats = {**session.snapshot(), "plan": plan}
        panel = " ".join(panel_text(MemoryPanel(), stats).split())
        assert f"held {format_bytes(stats['kv_bytes'])}" in panel and planned_text(plan.saving, 4096, plan.kv_dtype) in panel
        planned[name] = plan.saving.ratio
    # at 4k the default's 128-token window holds less than compact's 768 (compact is the fewest bytes past ~8k)
    assert planned["quality"] < planned["compact"] < planned["default"], planned
