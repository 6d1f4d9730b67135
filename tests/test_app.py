"""tq-chat (app/, installed as tq_chat): argument parsing, model resolution, preflight, and the Textual app driven headless by its Pilot
on a tiny random model folder."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tq_chat import main as cli
from tq_chat.chat import ChatApp, ChatSettings, Progress, Stats, Streamed
from tq_chat.models import ALIASES, ModelSource, ModelUnavailable, resolve
from tq_chat.plan import format_ctx, format_plan, make_plan, max_context, with_bits
from tq_chat.widgets import ChatMessage
from tests.test_cli import save_tiny_model, tiny_model_dir  # noqa: F401  (session fixture)
from tq_mlx.cache import TurboQuantConfig
from tq_mlx.flags import config_from_args
from tq_mlx.architectures import load_model_config
from tq_mlx.display import bits_summary, format_bytes, saving_words
from tq_mlx.memory import (chosen_key_widths, decayed_tokens, estimate_kv_bytes, estimate_peak_bytes,
                           protect_layer_bytes, weight_bytes)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 60  # seconds any single wait in the app may take


# --- arguments, models, preflight ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, n", [("4096", 4096), ("32k", 32768), ("128K", 131072), ("1m", 1 << 20), ("1.5k", 1536)])
def test_ctx_accepts_numbers_and_suffixes(text, n):
    assert cli.ctx_arg(text) == n
    assert cli.ctx_arg(format_ctx(n)) == n


@pytest.mark.parametrize("text", ["12q", "k", "-5", "8"])
def test_bad_ctx_is_an_argparse_error(text, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["m", "--ctx", text])
    assert "--ctx" in capsys.readouterr().err


def test_chat_has_the_cache_flags_and_short_bits():
    args = cli.build_parser().parse_args(["m", "--k-bits", "4", "--v-bits", "3", "--tq-window", "64"])
    assert (args.tq_key_bits, args.tq_value_bits, args.tq_window) == (4, 3, 64)


def test_resolve_local_folder_alias_and_repo_id(tiny_model_dir, tmp_path, monkeypatch):
    src = resolve(str(tiny_model_dir))
    assert src.path == tiny_model_dir.absolute() and not src.needs_download and src.repo_id is None
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    alias = resolve("qwen3.5-35b-a3b")
    assert alias.repo_id == ALIASES["Qwen3.5-35B-A3B"] and alias.needs_download
    assert resolve("someone/some-model").repo_id == "someone/some-model"


def test_a_file_given_as_model_is_called_a_file(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", str(notes), "--plan"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, TQ_MLX_OPENBLAS="0"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"tq-chat: {notes} is a file, not a model: give a model folder (config.json and "
                                   f"*.safetensors), a Hugging Face repo id (owner/name), or one of the short names")


@pytest.mark.parametrize("spec, message", [("./missing-folder", "no such model folder"),
                                           ("not a model", "unknown model"),
                                           ("/tmp", "has no config.json")])
def test_resolve_errors_are_clear(spec, message):
    with pytest.raises(ModelUnavailable, match=message):
        resolve(spec)


def test_plan_prints_the_estimate(tiny_model_dir, capsys):
    assert cli.main([str(tiny_model_dir), "--plan", "--ctx", "2k", "--bits", "3"]) == 0
    out = capsys.readouterr().out
    cfg = load_model_config(tiny_model_dir)
    assert format_bytes(weight_bytes(tiny_model_dir)) in out
    assert format_bytes(estimate_kv_bytes(cfg, 2048, None)) in out
    assert format_bytes(estimate_kv_bytes(cfg, 2048, TurboQuantConfig.from_bits(3))) in out
    assert "2,048 tokens (trained: 4,096)" in out and "verdict     fits" in out


def test_plan_prices_a_layer_that_protects_its_keys(tiny_model_dir, capsys):
    cfg = load_model_config(tiny_model_dir)
    # the default (its keys decay to K3 past 6144 tokens, which protected keys do not) and one without decay
    for config in (TurboQuantConfig(), TurboQuantConfig(decay_after=None)):
        plan = make_plan("m", cfg, 10**8, 32768, config, 10**10)
        n = plan.attention_layers
        # every layer's keys at protect_bits, never decaying; the values as configured (decaying or not)
        all_protected = estimate_kv_bytes(cfg, 32768, replace(
            config, key_bits=config.protect_bits, decay_key_bits=None, key_error=None,
            decay_after=config.decay_after if config.decay_value_bits else None))
        assert plan.protect_bytes == protect_layer_bytes(cfg, 32768, config) > 0
        # every layer's keys at 8 bits, less the configured key quantizer a protected stream keeps next to its own
        assert 0 < plan.protect_bytes - (all_protected - plan.kv) // n < 10**4
        assert "for each layer whose keys protect themselves (K8" in format_plan(plan)
        lines = format_plan(plan).splitlines()
        kv_row = next(i for i, line in enumerate(lines) if line.startswith("KV cache "))
        assert "protect themselves" in lines[kv_row + 1]  # under the KV cache row it adds to, before a decay row
    # nothing to price without protection, or when the keys are already at the protected bits
    for off in (TurboQuantConfig(protect_factor=None), TurboQuantConfig(key_bits=8, value_bits=8)):
        plan = make_plan("m", cfg, 10**8, 32768, off, 10**10)
        assert plan.protect_bytes == 0 and "protect themselves" not in format_plan(plan)


def test_plan_prices_a_layer_whose_keys_take_more_bits(tiny_model_dir):
    from tq_mlx.memory import widen_layer_bytes

    cfg = load_model_config(tiny_model_dir)
    config = TurboQuantConfig(key_error=0.1)
    assert config == TurboQuantConfig()  # the default
    plan = make_plan("m", cfg, 10**8, 32768, config, 10**10)
    n = plan.attention_layers
    # the plan prices every layer's keys at the most they take: 6 bits decaying to 5, plus the K4 quantizers a
    # widened stream keeps; a layer that keeps K4 holds widen_bytes less
    all_wide = estimate_kv_bytes(cfg, 32768, replace(config, key_bits=6, decay_key_bits=5, key_error=None))
    floor = estimate_kv_bytes(cfg, 32768, replace(config, key_error=None))
    assert plan.kv == estimate_kv_bytes(cfg, 32768, config) == floor + n * plan.widen_bytes
    assert plan.widen_bytes == widen_layer_bytes(cfg, 32768, config) > 0
    assert 0 < plan.kv - all_wide < n * 10**4
    assert plan.kv == estimate_kv_bytes(cfg, 32768, config, key_widths=[6] * n)  # what it would hold at the most
    text = format_plan(plan)
    assert "keys up to K6 where their logit error exceeds 0.1" in text
    assert ("at most: every layer's keys at K6 (each takes the fewest bits from K4 whose logit error is at most "
            "0.1") in text
    plan = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(key_error=None), 10**10)
    assert plan.widen_bytes == 0 and "at most: every layer's keys" not in format_plan(plan)
    assert plan.kv == floor


def test_plan_shows_and_prices_temporal_decay(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    decay = TurboQuantConfig(decay_after=2048, decay_key_bits=3, decay_value_bits=2)  # the default bits, K4/V4
    plan = make_plan("m", cfg, 10**8, 32768, decay, 10**10)
    no_decay = replace(decay, decay_after=None, decay_key_bits=None, decay_value_bits=None)
    assert plan.kv == estimate_kv_bytes(cfg, 32768, decay) < estimate_kv_bytes(cfg, 32768, no_decay)
    assert plan.decayed == decayed_tokens(32768, None, decay) == 30720
    text = format_plan(plan)
    assert "decay       K4→3/V4→2 after 2048: 30,720 of 32,768 tokens at the decay bits" in text
    assert "decaying to K3/V2 after 2048 tokens" in text  # the KV cache row's description
    assert "decay " not in format_plan(make_plan("m", cfg, 10**8, 32768, no_decay, 10**10))
    # the default decays: tokens 6144 old are at K3/V4 (6144 and 32768 are whole compress blocks of 128)
    default = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(), 10**10)
    assert default.decayed == decayed_tokens(32768, None, TurboQuantConfig()) == 32768 - 6144
    text = format_plan(default)
    assert f"decay       K4→3/V4 after 6144: {32768 - 6144:,} of 32,768 tokens at the decay bits" in text
    assert ("TurboQuant K4/V4, window 768, sinks 4, keys up to K6 where their logit error exceeds 0.1, decaying to "
            "K3/V4 after 6144 tokens") in " ".join(text.split())
    # only the values decay (keys left at AUTO would decay to K3 with the default bits)
    boundary = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(boundary_layers=1, decay_after=2048,
                                                                   decay_key_bits=None, decay_value_bits=2), 10**10)
    assert "K4/V4→2 after 2048: 30,720 of 32,768 tokens at the decay bits (the 2 boundary layers keep theirs)" in \
        format_plan(boundary)
    # suggestions with fewer bits keep the decay where it still lowers integer bits (before, 3.5 bits raised)
    tight = make_plan("m", cfg, 10**8, 1 << 20, decay, 10**8)
    assert not tight.fits and tight.suggestion
    assert with_bits(decay, 4) == TurboQuantConfig(key_bits=4, value_bits=4, decay_after=2048, decay_key_bits=3,
                                                   decay_value_bits=2)
    assert (with_bits(decay, 3).decay_key_bits, with_bits(decay, 3).decay_value_bits) == (None, 2)
    assert with_bits(decay, 3.5) == TurboQuantConfig(key_bits=3.5, value_bits=3.5)  # fractional bits cannot decay
    # the default's decay is the one TurboQuantConfig gives K4/V4 by itself: a suggestion prices what --bits gives
    for bits in ("4", "3.5", "3", "2.5", "2"):
        assert with_bits(TurboQuantConfig(), float(bits)) == config_from_args(
            cli.build_parser().parse_args(["m", "--bits", bits])), bits
    assert with_bits(TurboQuantConfig.from_bits(8), 4) == TurboQuantConfig()  # --bits 4 from K8/V8: the default


def test_context_beyond_training_warns(tiny_model_dir, capsys):
    assert cli.main([str(tiny_model_dir), "--plan", "--ctx", "8k"]) == 0
    assert "beyond the model's trained context of 4,096 tokens" in capsys.readouterr().out


def test_refuses_what_does_not_fit_and_suggests(tiny_model_dir, monkeypatch, capsys):
    cfg = load_model_config(tiny_model_dir)
    weights = weight_bytes(tiny_model_dir)
    # room for the predicted peak with a 2-bit KV cache of 64k tokens (tq-chat prefills 512 tokens at a time):
    # the default 4 bits do not fit
    room = estimate_peak_bytes(cfg, 65536, TurboQuantConfig.from_bits(2), weights=weights, prefill_step=512)
    monkeypatch.setattr("tq_mlx.memory.available_memory", lambda: int(room / 0.9) + 1)
    monkeypatch.setattr("tq_chat.chat.ChatApp.run", lambda self: pytest.fail("must not start"))
    assert cli.main([str(tiny_model_dir), "--ctx", "64k"]) == 1
    err = capsys.readouterr().err
    assert "does NOT fit" in err and "not starting" in err and "--force" in err
    fits_ctx = max_context(cfg, room - weights, TurboQuantConfig(), prefill_step=512)
    assert 16 * 1024 < fits_ctx < 64 * 1024
    assert f"--bits 2 fits 65,536 tokens; or --ctx {format_ctx(fits_ctx)} fits" in err
    assert cli.main([str(tiny_model_dir), "--ctx", "64k", "--plan"]) == 1

    started = []
    monkeypatch.setattr("tq_chat.chat.ChatApp.run", lambda self: started.append(self.settings))
    assert cli.main([str(tiny_model_dir), "--ctx", "64k", "--force", "--max-tokens", "9"]) == 0
    assert started[0].ctx == 65536 and started[0].max_tokens == 9


def test_plan_for_a_hybrid_counts_only_attention_layers():
    qwen35 = {"text_config": {"num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                              "head_dim": 256, "full_attention_interval": 4, "max_position_embeddings": 262144}}
    plan = make_plan("q", qwen35, 20 * 10**9, 131072, TurboQuantConfig.from_bits(3), 48 * 10**9)
    assert plan.attention_layers == 10 and plan.kv_fp16 == 20480 * 131072 and plan.fits
    weights_only = make_plan("q", qwen35, 60 * 10**9, 1024, None, 48 * 10**9)
    assert not weights_only.fits and "weights alone" in weights_only.suggestion


def test_offline_without_the_model_is_a_clear_message(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", "someone/not-downloaded", "--plan"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not in the Hugging Face cache" in proc.stderr and "local model folder" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_plan_works_offline_from_the_config_tq_chat_ships(tmp_path):
    # the README's headline command, with no model hub and an empty Hugging Face cache
    from tq_chat.plan import shipped_config

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), TQ_MLX_OPENBLAS="0")
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", "Qwen3.5-35B-A3B", "--ctx", "128k", "--plan"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr  # 0 fits, 1 does not
    shipped = shipped_config("mlx-community/Qwen3.5-35B-A3B-4bit")
    assert shipped["name"] == "Qwen3.5-35B-A3B" and shipped["file"] == "qwen3.5-35b-a3b.json"
    out = proc.stdout
    assert ("source      the config tq-chat ships for Qwen3.5-35B-A3B (configs/qwen3.5-35b-a3b.json; offline); "
            "weights estimated as 35B parameters x 4.5 bits") in out, out
    kv = estimate_kv_bytes(shipped["config"], 131072, TurboQuantConfig())
    assert f"KV cache    {format_bytes(kv)}  TurboQuant K4/V4" in out
    assert f"weights     {format_bytes(int(35e9 * 4.5 / 8))}" in out
    # a name that is neither a short name nor a repo id, but one of the README's models
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", "Llama-3.1-8B", "--plan"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1) and "the config tq-chat ships for Llama-3.1-8B" in proc.stdout, proc.stderr


def test_plan_works_offline_from_a_cached_hub_config(tiny_model_dir, tmp_path):
    # only config.json of the repo in the Hugging Face cache, no weights: the plan says so and counts the KV cache
    snapshot = tmp_path / "hub" / "models--someone--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (tmp_path / "hub" / "models--someone--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--cached" / "refs" / "main").write_text("abc123")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), TQ_MLX_OPENBLAS="0")
    proc = subprocess.run([sys.executable, "-m", "tq_chat.main", "someone/cached", "--ctx", "2k", "--plan"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "source      config.json from the Hugging Face cache (someone/cached; offline); weights unknown" in \
        proc.stdout
    assert "weights     unknown (not counted below)" in proc.stdout
    cfg = load_model_config(tiny_model_dir)
    assert f"KV cache    {format_bytes(estimate_kv_bytes(cfg, 2048, TurboQuantConfig()))}" in proc.stdout


def test_the_demo_model_is_prepared_in_the_dtype_it_runs_in(tiny_model_dir, monkeypatch, capsys):
    # "Loading smollm2-135m-instruct-float16…" with --dtype float32 named the wrong dtype: the folder now is the
    # dtype it runs in, and so is every line that names it
    asked = []

    def prepare(spec, dtype="float16", progress=False):
        asked.append((spec.name, dtype))
        named = tiny_model_dir.parent / f"{spec.name}-{dtype}"
        if not named.exists():
            named.symlink_to(tiny_model_dir, target_is_directory=True)
        return named

    monkeypatch.setattr("tq_chat.main.prepare_model", prepare)
    assert cli.main(["smollm2-135m", "--dtype", "float32", "--plan"]) == 0
    assert cli.main(["smollm2-135m", "--plan"]) == 0
    assert asked == [("smollm2-135m-instruct", "float32"), ("smollm2-135m-instruct", "float16")]
    out = capsys.readouterr().out
    assert "model       smollm2-135m-instruct-float32 (3 layers" in out
    assert "mlx-lm's own float32 cache for the same" in out


def test_plan_fits_the_config_to_a_small_bound(tiny_model_dir):
    from tq_mlx.config import fit_max_kv_size

    cfg = load_model_config(tiny_model_dir)
    plan = make_plan("m", cfg, 10**8, 4096, TurboQuantConfig(), 10**10, max_kv_size=256)
    assert plan.config == fit_max_kv_size(TurboQuantConfig(), 256) and plan.config.window < 768
    assert plan.kv == estimate_kv_bytes(cfg, 4096, plan.config, max_kv_size=256)
    text = format_plan(plan)
    assert (f"note: --max-kv-size 256 is below sinks + window + compress block - 1 = 899 tokens (the float sinks "
            f"and window are never dropped): keeping 4 sinks, a {plan.config.window}-token window and compress "
            f"blocks of {plan.config.compress_block_size}") in text


# --- the app, headless ---------------------------------------------------------------------------------------


class RecordingApp(ChatApp):
    """ChatApp that records the messages its workers post (the base handlers still run: Textual walks the MRO)."""

    def __init__(self, settings):
        super().__init__(settings)
        self.events: list = []

    def on_progress(self, m: Progress) -> None:
        self.events.append(("progress", m.label, m.done, m.total))

    def on_streamed(self, m: Streamed) -> None:
        self.events.append(("text", m.text))

    def on_stats(self, m: Stats) -> None:
        self.events.append(("stats", m.stats))


def make_app(path: Path, **kw) -> RecordingApp:
    settings = dict(ctx=1024, config=TurboQuantConfig(window=16, sinks=2), max_tokens=24)
    settings.update(kw)
    return RecordingApp(ChatSettings(source=ModelSource(str(path), path=path), **settings))


async def wait_for(pilot, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def loaded(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.session is not None, "the model to load")
    await wait_for(pilot, lambda: not pilot.app.query_one("#prompt").disabled, "the input")


async def say(pilot, text: str, keys: bool = False) -> None:
    """Submit `text` in the input box (typed key by key when `keys`) and wait for the answer."""
    app = pilot.app
    prompt = app.query_one("#prompt")
    prompt.focus()
    if keys:
        await pilot.press(*text)
    else:
        prompt.value = text
    await pilot.press("enter")
    await pilot.pause(0.05)
    await wait_for(pilot, lambda: not app.generating, "the answer")
    await pilot.pause(0.1)


def messages(app, role: str | None = None) -> list[ChatMessage]:
    return [m for m in app.query(ChatMessage) if role is None or m.role == role]


def panel_text(panel, stats: dict) -> str:
    """A memory panel's rendering of `stats` as plain text."""
    from rich.console import Console

    console = Console(width=40, record=True, file=open(os.devnull, "w"))
    console.print(panel.render_stats(stats))
    return console.export_text()


def rendered(app) -> str:
    return panel_text(app.panel, app.panel.stats)


def test_typing_streams_an_answer_and_the_panel_reads_the_cache(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir, temp=1.0, max_tokens=60)  # sampled bytes: many streamed segments
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot)
            await say(pilot, "hello there", keys=True)
            session = app.session
            answer = session.messages[-1]
            assert answer["role"] == "assistant" and answer["content"]
            # streamed in pieces, and the transcript shows exactly what the conversation keeps
            pieces = [e[1] for e in app.events if e[0] == "text"]
            assert len(pieces) > 1 and "".join(pieces) == answer["content"]
            assert messages(app, "assistant")[-1].source == answer["content"]
            assert [m.source for m in messages(app, "user")] == ["hello there"]
            # the panel's numbers are the caches' own nbytes, via memory.cache_bytes
            stats = app.panel.stats
            assert stats["kv_bytes"] == sum(c.nbytes for c in session.cache)
            assert stats["context_tokens"] == len(session.tokens) == session.cache[0].offset
            assert stats["weights"] > 0 and stats["peak"] >= stats["active"] > 0 and stats["decode_tps"] > 0
            text = rendered(app)
            for key in ("kv_bytes", "mlx_lm_bytes", "weights"):
                assert format_bytes(stats[key]) in text
            # against what mlx-lm's own float32 KVCache allocates: 256-token steps, 3 layers, 2 kv heads x 64
            n = len(session.tokens)
            assert stats["mlx_lm_bytes"] == 3 * 2 * 256 * -(-n // 256) * 2 * 64 * 4
            assert "mlx-lm float32 cache" in text and f"({stats['mlx_lm_bytes'] / stats['kv_bytes']:.2f}x)" in text
            # the default decays (after 6144 tokens, more than this context holds); the label wraps in the panel
            assert f"{len(session.tokens):,} / 1,024" in text
            # each layer's keys at the width their error chose (random weights: any of K4-K6)
            assert bits_summary(session.cache) in " ".join(text.split())
            assert re.search(r"K[456]→[345]/V4 after 6144", bits_summary(session.cache))
            assert any(e[0] == "stats" for e in app.events)  # live updates while generating

    asyncio.run(run())


def test_the_panel_never_shows_a_negative_saving_and_says_where_the_float_window_ends():
    from tq_chat.widgets import MemoryPanel

    base = dict(ctx=4096, context_tokens=85, weights=1, active=1, peak=1, prompt_tps=0, decode_tps=0, bits="K4/V3",
                config="TurboQuant K4/V3", other_bytes=0, kv_dtype="float16", sinks=4, window=768)
    early = dict(base, kv_bytes=3_230_000, mlx_lm_bytes=2_080_000, float_tokens=85, compressed_tokens=0)
    text = " ".join(panel_text(MemoryPanel(), early).split())
    assert "saved none yet" in text and "-" + format_bytes(1_150_000) not in text and "x)" not in text
    assert "all 85 tokens in float16 (4 sinks + 768-token window): compression starts at token 773" in text
    assert "mlx-lm float16 cache 2.08 MB" in text and "compressed 0 tokens" in text
    later = dict(base, context_tokens=4000, kv_bytes=10_000_000, mlx_lm_bytes=30_000_000, float_tokens=772,
                 compressed_tokens=3228)
    text = " ".join(panel_text(MemoryPanel(), later).split())
    assert "saved 20.0 MB (3.00x)" in text and "3,228 tokens compressed, 772 in float16" in text
    decayed = dict(later, decayed_tokens=1152, bits="K4→3/V3→2 after 2048 on all 3 attention layers")
    text = " ".join(panel_text(MemoryPanel(), decayed).split())
    assert "3,228 tokens compressed (1,152 decayed), 772 in float16" in text and "K4→3/V3→2 after 2048" in text


def test_the_title_shows_the_dtype_the_model_runs_in(tiny_model_dir, tmp_path):
    named = tmp_path / "tiny-float16"  # a folder named for its weights' dtype, as the demo model's is
    named.symlink_to(tiny_model_dir, target_is_directory=True)

    cfg = load_model_config(tiny_model_dir)

    async def run(dtype, expected):
        plan = make_plan("tiny-float16", cfg, weight_bytes(tiny_model_dir), 1024, TurboQuantConfig(), 10**10,
                         dtype=dtype)
        app = make_app(named, dtype=dtype, kv_dtype="float16", plan=plan)
        async with app.run_test() as pilot:
            await loaded(pilot)
            assert app.sub_title == expected
            # the plan note compares with mlx-lm's cache in the dtype the model runs in
            real = dtype or "float16"
            bytes_ = {"float32": 4, "bfloat16": 2, "float16": 2}[real]
            note = messages(app, "notice")[0].source
            assert note.startswith(f"**tiny** ({real}): weights ") and (
                f"(mlx-lm's {real} cache would be {format_bytes(plan.kv_fp16 * bytes_ // 2)})" in note), note
            # before the first question the panel already names the dtype mlx-lm's cache would hold
            assert f"mlx-lm {app.session.dtype} cache" in rendered(app)
            await say(pilot, "/clear")  # the predicted peak stays next to the measured one
            assert "planned peak" in rendered(app)

    # the default: K4/V4, decaying to K3/V2 after 6144 tokens
    asyncio.run(run("float32", "tiny · float32 · TurboQuant K4→3/V4 after 6144 · ctx 1k"))
    asyncio.run(run("bfloat16", "tiny · bfloat16 · TurboQuant K4→3/V4 after 6144 · ctx 1k"))
    # the tiny model's weights are float32
    asyncio.run(run(None, "tiny · float32 · TurboQuant K4→3/V4 after 6144 · ctx 1k"))


def test_the_title_and_the_panel_show_temporal_decay(tiny_model_dir):
    config = TurboQuantConfig(window=16, sinks=2, decay_after=32, decay_key_bits=3, decay_value_bits=2,
                              key_error=None)  # K4/V4, every layer's keys at K4

    async def run():
        app = make_app(tiny_model_dir, config=config)
        async with app.run_test() as pilot:
            await loaded(pilot)
            assert app.sub_title.endswith("TurboQuant K4→3/V4→2 after 32 · ctx 1k")
            await say(pilot, "a question long enough for its oldest tokens to decay " * 2)
            stats = app.panel.stats
            assert stats["decayed_tokens"] == max(max(c.n_decayed) for c in app.session.cache) > 0
            assert stats["kv_bytes"] == sum(c.nbytes for c in app.session.cache)
            text = " ".join(rendered(app).split())
            assert f"({stats['decayed_tokens']:,} decayed)" in text
            assert "K4→3/V4→2 after 32 on all 3 attention layers" in text

    asyncio.run(run())


def test_second_turn_reuses_the_cache(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "first question")
            before = len(app.session.tokens)
            prepare = app.session.prepare
            seen = {}

            def spy(text):
                out = prepare(text)
                seen["reused"], seen["new"] = out[2], len(out[1])
                return out

            app.session.prepare = spy
            await say(pilot, "second")
            # only the last generated token (<eos>, which the template writes as a newline) is re-fed
            assert seen["reused"] >= before - 1
            assert seen["new"] < len("user: second\nassistant: ") + 2
            assert len(messages(app, "assistant")) == 2

    asyncio.run(run())


def test_save_then_load_continues_the_conversation(tiny_model_dir, tmp_path):
    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "remember this")
            saved_tokens, saved_messages = list(app.session.tokens), list(app.session.messages)
            saved_bytes = app.panel.stats["kv_bytes"]
            await say(pilot, f"/save {tmp_path / 'conv'}")
            assert (tmp_path / "conv.safetensors").exists()
            assert messages(app, "notice")[-1].source.endswith(
                f"to `{tmp_path / 'conv.safetensors'}`: `/load {tmp_path / 'conv.safetensors'}` continues this "
                f"conversation.")
            await say(pilot, "/clear")
            assert app.session.tokens == [] and len(messages(app)) == 1
            await say(pilot, f"/load {tmp_path / 'conv.safetensors'}")
            assert app.session.tokens == saved_tokens and app.session.messages == saved_messages
            assert app.panel.stats["kv_bytes"] == saved_bytes
            assert [m.source for m in messages(app, "user")] == ["remember this"]
            prepare = app.session.prepare
            reused = []
            app.session.prepare = lambda t: (out := prepare(t), reused.append(out[2]))[0]
            await say(pilot, "go on")
            assert reused[0] >= len(saved_tokens) - 1  # continued from the loaded cache, not re-prefilled
            assert [m["role"] for m in app.session.messages] == ["user", "assistant"] * 2

    asyncio.run(run())


def in_thread(f):
    """f() in a new thread, as tq-chat runs every load and generation (its result, or the exception it raised)."""
    import threading

    out = []

    def target():
        try:
            out.append(f())
        except Exception as e:  # noqa: BLE001 (handed back to the test)
            out.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    return out[0]


def test_a_conversation_loaded_in_one_thread_continues_in_another(tiny_model_dir, tmp_path):
    """The app loads in the event loop's thread and answers in a worker thread: MLX streams are per thread, so
    a lazily loaded cache failed every later answer ("There is no Stream(cpu, 0) in current thread")."""
    from mlx_lm import load

    from tq_chat.session import ChatSession

    def start():
        model, tokenizer = load(str(tiny_model_dir))
        return ChatSession(model, tokenizer, TurboQuantConfig(window=16, sinks=2), ctx=1024, max_tokens=8)

    session = in_thread(start)
    assert in_thread(lambda: session.generate("remember this, it is a long enough question").generated) > 0
    saved = list(session.tokens)
    path = in_thread(lambda: session.save(tmp_path / "conv"))
    assert in_thread(lambda: session.load(path)) == [] and session.tokens == saved
    result = in_thread(lambda: session.generate("go on"))
    assert not isinstance(result, Exception), result
    assert result.reused_tokens >= len(saved) - 1 and result.generated > 0


def test_save_to_a_missing_folder_is_one_line_and_the_conversation_stays(tiny_model_dir, tmp_path):
    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "keep me")
            tokens, history = list(app.session.tokens), list(app.session.messages)
            await say(pilot, f"/save {tmp_path / 'no-such-dir' / 'x.safetensors'}")
            error = messages(app, "error")[-1].source
            assert error == (f"Could not save: cannot save to {tmp_path / 'no-such-dir' / 'x.safetensors'}: "
                             f"the folder {tmp_path / 'no-such-dir'} does not exist")
            (tmp_path / "ro").mkdir()
            (tmp_path / "ro").chmod(0o500)  # a folder that exists but cannot be written: MLX's RuntimeError
            try:
                await say(pilot, f"/save {tmp_path / 'ro' / 'x'}")
            finally:
                (tmp_path / "ro").chmod(0o700)
            if os.geteuid() != 0:  # root writes anywhere
                assert messages(app, "error")[-1].source.startswith(f"Could not save: cannot write {tmp_path}")
            assert app.session.tokens == tokens and app.session.messages == history
            await say(pilot, "still here?")  # the conversation goes on
            assert len(messages(app, "assistant")) == 2 and app.is_running

    asyncio.run(run())


def test_ctrl_c_stops_and_keeps_the_partial_answer(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir, max_tokens=3000, ctx=4096)
        async with app.run_test() as pilot:
            await loaded(pilot)
            app.query_one("#prompt").focus()
            await pilot.press(*"talk")
            await pilot.press("enter")
            await wait_for(pilot, lambda: any(e[0] == "text" for e in app.events), "the first token")
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: not app.generating, "the stop")
            await pilot.pause(0.1)
            session = app.session
            partial = session.messages[-1]["content"]
            assert session.messages[-1]["role"] == "assistant" and 0 < len(session.tokens) < 3000
            assert messages(app, "assistant")[-1].source == partial
            assert "Stopped" in messages(app, "notice")[-1].source
            assert len(session.tokens) == session.cache_offset()
            session.max_tokens = 8
            await say(pilot, "again")  # the conversation goes on
            assert session.messages[-2] == {"role": "user", "content": "again"}

    asyncio.run(run())


def test_prefill_progress_is_shown(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir, prefill_step_size=16, max_tokens=2)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "a long question " * 6)
            prefill = [e for e in app.events if e[0] == "progress" and e[1] == "Prefill"]
            assert len(prefill) >= 4 and prefill[-1][2] == prefill[-1][3]
            assert any(0 < e[2] < e[3] for e in prefill)
            assert not app.status.display  # hidden again when done

    asyncio.run(run())


def test_commands_and_errors(tiny_model_dir, tmp_path):
    async def run():
        app = make_app(tiny_model_dir, ctx=64)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "/bits")
            bits = messages(app, "notice")[-1].source  # the default: K4/V4, decaying to K3/V2 after 6144 tokens
            assert ("**Cache**: TurboQuant K4/V4, window 16, sinks 2, keys up to K6 where their logit error exceeds "
                    "0.1, decaying to K3/V4 after 6144 tokens") in bits
            assert "**Bits per layer**: K4→3/V4 after 6144 on all 3 attention layers" in bits
            await say(pilot, "/stats")
            assert "KV cache held" in messages(app, "notice")[-1].source
            await say(pilot, "/help")
            assert "/save FILE" in messages(app, "notice")[-1].source
            await say(pilot, "/nonsense")
            assert "Unknown command /nonsense" in messages(app, "error")[-1].source
            await say(pilot, f"/load {tmp_path / 'missing'}")
            assert "Could not load" in messages(app, "error")[-1].source
            (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
            await say(pilot, f"/load {tmp_path / 'junk.safetensors'}")
            assert "Could not load" in messages(app, "error")[-1].source
            await say(pilot, "/save")
            assert "Usage: /save FILE" in messages(app, "error")[-1].source
            # --ctx 64: a long message does not fit; the conversation is unchanged
            await say(pilot, "x" * 80)
            assert "context limit reached" in messages(app, "error")[-1].source
            assert app.session.messages == [] and app.session.tokens == []
            # a short one fits, and generation stops at the limit
            app.session.max_tokens = 1000
            await say(pilot, "hi")
            assert len(app.session.tokens) == 64
            assert "Context limit reached (64 tokens)" in messages(app, "notice")[-1].source
            assert "64 / 64" in rendered(app)

            def boom(*a, **k):
                raise RuntimeError("simulated failure")

            app.session.generate = boom
            await say(pilot, "/clear")
            await say(pilot, "hello")
            assert "generation failed: RuntimeError: simulated failure" in messages(app, "error")[-1].source
            await pilot.press("ctrl+c")  # nothing to stop: a notification, the app stays up
            await say(pilot, "/quit")
        assert app.return_code in (0, None)

    asyncio.run(run())


def test_help_lists_every_command_and_a_bare_screenshot_goes_where_the_app_says(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """Issue 35: /help's table had a blank header cell and left out /help; a bare /screenshot wrote into the
    current folder. Every table the app shows has a header, /help names every command the app knows, and a bare
    /screenshot goes to tq-mlx's cache folder ($TQ_MLX_CACHE), in a new file each time, at the path it prints."""
    import re

    from tq_chat.chat import COMMANDS, HELP, KNOWN, screenshot_dir

    monkeypatch.setenv("TQ_MLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert screenshot_dir() == tmp_path / "cache" / "screenshots"
    assert set(KNOWN) == {c.split()[0] for c in COMMANDS} and "/help" in KNOWN

    def header_cells(table: str) -> list[str]:
        return [c.strip() for c in table.strip().splitlines()[0].strip("|").split("|")]

    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "/help")
            help_text = messages(app, "notice")[-1].source
            assert help_text == HELP
            table = help_text[help_text.index("| command"):]
            assert all(header_cells(table)), table
            listed = re.findall(r"^\| `(/\w+)", table, re.M)
            assert listed == list(KNOWN), listed
            for cmd in KNOWN:  # every command listed does something other than "Unknown command"
                if cmd in ("/screenshot", "/quit"):
                    continue  # below
                await say(pilot, cmd)
                assert not any(f"Unknown command {cmd}" in m.source for m in messages(app, "error")), cmd
                if cmd == "/stats":
                    assert all(header_cells(messages(app, "notice")[-1].source))
            shots = []
            for _ in range(2):
                await say(pilot, "/screenshot")
                said = messages(app, "notice")[-1].source
                shots.append(Path(re.fullmatch(r"Saved a screenshot to `(.+)`\.", said).group(1)))
            assert shots[0] != shots[1] and all(p.parent == screenshot_dir() and p.is_file() for p in shots)
            assert not list(tmp_path.glob("*.svg"))  # nothing in the current folder
            await say(pilot, "/quit")
        assert app.return_code in (0, None)

    asyncio.run(run())


def test_a_model_that_does_not_load_is_reported(tmp_path):
    bad = save_tiny_model(tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)

    async def run():
        app = make_app(bad)
        async with app.run_test() as pilot:
            # The message widget is mounted before its text is set: wait for the text.
            await wait_for(pilot, lambda: any("could not load" in m.source for m in messages(app, "error")),
                           "the load error")
            assert app.session is None and not app.query_one("#prompt").disabled
            await say(pilot, "hello")  # nothing to talk to, but no crash
            await say(pilot, "/quit")

    asyncio.run(run())


def test_download_progress_goes_to_the_app(tiny_model_dir, monkeypatch):
    calls = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        calls["repo"] = repo_id
        bar = tqdm_class(total=1000, desc="Downloading", unit="B")
        for _ in range(4):
            bar.update(250)
            bar.refresh()
        bar.close()
        return str(tiny_model_dir)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    monkeypatch.setattr("tq_chat.models.check_hub", lambda repo_id: None)

    async def run():
        app = RecordingApp(ChatSettings(source=ModelSource("org/tiny", repo_id="org/tiny"), ctx=256,
                                        config=TurboQuantConfig(window=16)))
        async with app.run_test() as pilot:
            await loaded(pilot)
            downloads = [e for e in app.events if e[0] == "progress" and "Downloading org/tiny" in e[1]]
            assert downloads and downloads[-1][2:] == (1000, 1000)
            assert app.settings.source.path == tiny_model_dir

    asyncio.run(run())
    assert calls["repo"] == "org/tiny"


def test_download_failure_is_a_message_not_a_crash(monkeypatch):
    def offline(*a, **k):
        raise OSError("network is unreachable")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.setattr("tq_chat.models.check_hub", lambda repo_id: None)

    async def run():
        app = RecordingApp(ChatSettings(source=ModelSource("org/tiny", repo_id="org/tiny"), ctx=256))
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: messages(app, "error"), "the error")
            assert "cannot be fetched from the Hub: network is unreachable" in messages(app, "error")[-1].source

    asyncio.run(run())


# --- the conversation engine on its own -----------------------------------------------------------------------


def test_hybrid_model_reuses_its_cache_across_turns():
    """Qwen3.5-style hybrid: the linear-attention state cannot be trimmed, so a turn whose template differs at
    the end of the previous answer goes back to the checkpoint at the end of the previous prompt."""
    from tq_chat.session import ChatSession
    from tests.support.tiny_models import tiny_hybrid, tiny_tokenizer

    model, _ = tiny_hybrid()
    session = ChatSession(model, tiny_tokenizer(), TurboQuantConfig(window=16), ctx=2048, max_tokens=12)
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
    # the default (K4/V4, decaying after 6144 tokens); the label wraps in the panel
    assert "K4→3/V4 after 6144 on its 1 attention layer" in " ".join(text.split())


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


@pytest.mark.parametrize("config, n", [(TurboQuantConfig(), 42), (TurboQuantConfig(window=16, sinks=2), 300)],
                         ids=["nothing compressed yet", "compressed"])
def test_the_panel_summary_cache_bytes_and_plan_agree_on_one_state(tiny_model_dir, config, n):
    from tq_chat.widgets import MemoryPanel
    from tq_mlx.display import saving_text, summary_line, window_text
    from tq_mlx.memory import Saving, cache_bytes

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
    assert f"held {held}" in panel and f"mlx-lm float32 cache {reference}" in panel and f"saved {saved}" in panel
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
    assert f"saved       {saving_words(plan.saving)} against mlx-lm's own cache" in text
    if n == 42:  # before compression starts the first screen says so, and what --ctx will reach
        assert window == "all 42 tokens in float32 (4 sinks + 768-token window): compression starts at token 773"


def test_the_first_screen_shows_what_the_cache_reaches_at_ctx(tiny_model_dir):
    from tq_chat.widgets import MemoryPanel
    from tq_mlx.display import planned_text
    from tq_mlx.memory import planned_saving

    cfg = load_model_config(tiny_model_dir)
    session = fed_session(tiny_model_dir, TurboQuantConfig(), 0, ctx=4096)
    plan = make_plan("tiny", cfg, weight_bytes(tiny_model_dir), 4096, TurboQuantConfig(), 10**10, dtype="float32")
    assert plan.saving == planned_saving(cfg, 4096, TurboQuantConfig(), dtype="float32")
    panel = " ".join(panel_text(MemoryPanel(), {**session.snapshot(), "plan": plan}).split())
    assert ("no tokens yet; the first 772 stay in float32 (4 sinks + 768-token window): compression starts at "
            "token 773") in panel, panel
    assert planned_text(plan.saving, 4096) in panel
    assert planned_text(plan.saving, 4096).startswith(f"planned at 4,096 tokens (--ctx): {format_bytes(plan.kv)} held, "
                                                      f"saved {format_bytes(plan.kv_mlx_lm - plan.kv)} (")


def test_presets_on_a_short_prompt_show_what_they_hold_now_and_will_save_at_ctx(tiny_model_dir):
    # At 53 tokens the presets' constants decide what they hold (compact's decay quantizers hold the most): the
    # panel shows that as it is, and next to it the saving each reaches at --ctx, which orders them as they are.
    from tq_chat.widgets import MemoryPanel
    from tq_mlx.display import planned_text

    cfg = load_model_config(tiny_model_dir)
    planned = {}
    for name in ("quality", "default", "compact"):
        config = TurboQuantConfig.preset(name)
        session = fed_session(tiny_model_dir, config, 53, ctx=4096)
        plan = make_plan("tiny", cfg, weight_bytes(tiny_model_dir), 4096, config, 10**10, dtype="float32")
        stats = {**session.snapshot(), "plan": plan}
        panel = " ".join(panel_text(MemoryPanel(), stats).split())
        assert f"held {format_bytes(stats['kv_bytes'])}" in panel and planned_text(plan.saving, 4096) in panel
        planned[name] = plan.saving.ratio
    assert planned["quality"] < planned["default"] < planned["compact"], planned
