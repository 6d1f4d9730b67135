"""tq-chat (app/, installed as tq_chat): argument parsing, model resolution and preflight (the --plan estimate, what
fits, offline configs), on a tiny random model folder."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tq_chat import main as cli
from tq_chat.models import ALIASES, ModelUnavailable, resolve
from tq_chat.plan import format_ctx, format_plan, make_plan, max_context, with_bits
from tests.test_cli import tiny_model_dir  # noqa: F401  (session fixture)
from tq_mlx.cache import TurboQuantConfig
from tq_mlx.cli.flags import config_from_args
from tq_mlx.config import KEY_OUTPUT_ERROR
from tq_mlx.layout import shared_constant_bytes
from tq_mlx.models.architectures import load_model_config
from tq_mlx.planner.display import format_bytes
from tq_mlx.planner.machine import weight_bytes
from tq_mlx.planner.memory import decayed_tokens, estimate_kv_bytes, estimate_peak_bytes, protect_layer_bytes


REPO = Path(__file__).resolve().parents[1]


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


def shared(cfg: dict, *bits: int) -> int:
    """Bytes of the Lloyd-Max codebooks and tables at these widths, one of each (what every layer shares)."""
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return sum(b for w in bits for b in shared_constant_bytes(dim, w).values())


def test_plan_prices_a_layer_that_protects_its_keys(tiny_model_dir, capsys):
    cfg = load_model_config(tiny_model_dir)
    # keys that decay to K3 past 6144 tokens (protected keys do not) and the default, without decay; the widths
    # whose codebooks and tables the plan's keys (at K6, decaying a step to K5) hold and protected ones do not
    for config, dropped in ((TurboQuantConfig(decay_after=6144), (3, 5, 6)), (TurboQuantConfig(), (6,))):
        plan = make_plan("m", cfg, 10**8, 32768, config, 10**10)
        n = plan.attention_layers
        # every layer's keys at protect_bits, never decaying; the values as configured (decaying or not)
        all_protected = estimate_kv_bytes(cfg, 32768, replace(
            config, key_bits=config.protect_bits, decay_key_bits=None, key_error=None,
            decay_after=config.decay_after if config.decay_value_bits else None))
        assert plan.protect_bytes == protect_layer_bytes(cfg, 32768, config) > 0
        # every layer's keys at 8 bits, less the configured key quantizer a protected stream keeps next to its own.
        # The codebooks and tables every layer shares count once in a model: the 8-bit ones protection brings are in
        # each layer's figure; the model of protected keys holds them once and none of `dropped` (K4 is kept).
        eight, others = shared(cfg, 8), shared(cfg, *dropped)
        assert 0 < plan.protect_bytes - eight - (all_protected - plan.kv - eight + others) // n < 10**4
        assert "for each layer whose keys protect themselves (K8" in format_plan(plan)
        lines = format_plan(plan).splitlines()
        kv_row = next(i for i, line in enumerate(lines) if line.startswith("KV cache "))
        assert "protect themselves" in lines[kv_row + 1]  # under the KV cache row it adds to, before a decay row
    # nothing to price without protection, or when the keys are already at the protected bits
    for off in (TurboQuantConfig(protect_factor=None), TurboQuantConfig(key_bits=8, value_bits=8)):
        plan = make_plan("m", cfg, 10**8, 32768, off, 10**10)
        assert plan.protect_bytes == 0 and "protect themselves" not in format_plan(plan)


def test_plan_prices_a_layer_whose_keys_take_more_bits(tiny_model_dir):
    from tq_mlx.planner.memory import widen_layer_bytes

    cfg = load_model_config(tiny_model_dir)
    config = TurboQuantConfig(key_error=0.1)  # keys by their logit error (key_error's own default, the output error off)
    assert config == TurboQuantConfig(key_output_error=None) and config.key_output_error is None
    plan = make_plan("m", cfg, 10**8, 32768, config, 10**10)
    n = plan.attention_layers
    # the plan prices every layer's keys at the most they take: 6 bits, plus the K4 quantizers a widened stream
    # keeps; a layer that keeps K4 holds widen_bytes less, and the 6-bit codebook and table go once none holds K6
    all_wide = estimate_kv_bytes(cfg, 32768, replace(config, key_bits=6, key_error=None))
    floor = estimate_kv_bytes(cfg, 32768, replace(config, key_error=None))
    assert plan.kv == estimate_kv_bytes(cfg, 32768, config) == floor + n * plan.widen_bytes + shared(cfg, 6)
    assert plan.widen_bytes == widen_layer_bytes(cfg, 32768, config) > 0
    assert 0 < plan.kv - all_wide < n * 10**4
    assert plan.kv == estimate_kv_bytes(cfg, 32768, config, key_widths=[6] * n)  # what it would hold at the most
    text = format_plan(plan)
    assert "keys up to K6 where their logit error exceeds 0.1" in text
    assert ("at most: every layer's keys at K6 (each takes the fewest bits from K4 whose logit error is at most "
            "0.1") in text
    # keys by their output error: priced at the most as well, named by their own rule (K3 allowed)
    by_output = TurboQuantConfig(key_output_error=0.03)
    plan = make_plan("m", cfg, 10**8, 32768, by_output, 10**10)
    assert plan.widen_bytes == widen_layer_bytes(cfg, 32768, by_output)
    assert plan.kv == floor + n * plan.widen_bytes + shared(cfg, 6)
    text = format_plan(plan)
    assert "keys K3 to K6 by their output error (at most 0.03)" in text and "logit" not in text
    assert ("every layer's keys at K6 (each takes the fewest bits from K3 whose output error on its first window is "
            "at most 0.03") in text and "for each layer that keeps K4, more at K3" in text
    # the default's keys take their bits by this rule, at KEY_OUTPUT_ERROR
    assert TurboQuantConfig() == replace(by_output, key_output_error=KEY_OUTPUT_ERROR)
    plan = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(key_error=None), 10**10)
    assert plan.widen_bytes == 0 and "at most: every layer's keys" not in format_plan(plan)
    assert plan.kv == floor


def priced_at_the_most(cfg: dict, config: TurboQuantConfig, least: int, brings: bool = True):
    """The plan of a config whose values choose their bits by their error, after checking that it prices every
    layer's values at V4, the most, and that a layer at `least` bits holds narrow_bytes less (brings: its figure
    counts the `least`-bit codebook and table it brings, which every layer at `least` shares once); with the bytes
    of every layer at `least`."""
    from tq_mlx.planner.memory import narrow_layer_bytes

    plan = make_plan("m", cfg, 10**8, 32768, config, 10**10)
    n = plan.attention_layers
    assert plan.kv == estimate_kv_bytes(cfg, 32768, config) == estimate_kv_bytes(cfg, 32768, config, value_widths=[4] * n)
    assert plan.narrow_bytes == narrow_layer_bytes(cfg, 32768, config) > 0
    all_least = estimate_kv_bytes(cfg, 32768, config, value_widths=[least] * n)
    assert plan.kv - all_least == n * plan.narrow_bytes + (n - 1) * shared(cfg, least) * brings
    return plan, all_least


def test_plan_prices_values_that_choose_their_decay_bits(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    config = TurboQuantConfig(value_bits=4, value_error=0.05)
    # the bytes of V2 everywhere are those of a config that decays every layer's values to 2
    plan, all_v2 = priced_at_the_most(cfg, config, 2)
    assert all_v2 == estimate_kv_bytes(cfg, 32768, replace(config, value_error=None, decay_value_bits=2))
    assert ("at most: every layer's old values kept at V4 (each decays them to the fewest bits from V2 whose output "
            "error on its first window is at most 0.05") in format_plan(plan)
    plan = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(), 10**10)
    assert plan.narrow_bytes == 0 and "old values kept" not in format_plan(plan)
    # the fewest bits given (decay_value_bits=3): a layer that takes them holds V4 less V3, no decay row of V2
    least = TurboQuantConfig(value_bits=4, value_error=0.05, decay_value_bits=3)
    plan, _ = priced_at_the_most(cfg, least, 3, brings=False)  # its values decay to V3: the constants are held
    assert plan.narrow_bytes < priced_at_the_most(cfg, config, 2)[0].narrow_bytes
    text = format_plan(plan)
    assert "each decays them to the fewest bits from V3 whose output error" in text and "decay to V3" in text
    assert "(values V3 to V4 by their output error)" in text and "V2" not in text


def test_plan_prices_values_that_choose_their_width(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    config = TurboQuantConfig(value_output_error=0.03)
    # V3 everywhere is a config of V3 values holding V4's quantizer constants too
    plan, all_v3 = priced_at_the_most(cfg, config, 3)
    assert all_v3 > estimate_kv_bytes(cfg, 32768, replace(config, value_output_error=None, value_bits=3))
    assert ("at most: every layer's values at V4 (each takes the fewest bits from V3 in half steps whose output "
            "error on its first window is at most 0.03") in format_plan(plan)


def test_plan_shows_and_prices_temporal_decay(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    decay = TurboQuantConfig(value_bits=4, decay_after=2048, decay_key_bits=3, decay_value_bits=2)  # K4/V4
    plan = make_plan("m", cfg, 10**8, 32768, decay, 10**10)
    no_decay = replace(decay, decay_after=None, decay_key_bits=None, decay_value_bits=None)
    assert plan.kv == estimate_kv_bytes(cfg, 32768, decay) < estimate_kv_bytes(cfg, 32768, no_decay)
    assert plan.decayed == decayed_tokens(32768, None, decay) == 30720
    text = format_plan(plan)
    assert "decay       K4→3/V4→2 after 2048: 30,720 of 32,768 tokens at the decay bits" in text
    assert "decaying to K3/V2 after 2048 tokens" in text  # the KV cache row's description
    assert "decay " not in format_plan(make_plan("m", cfg, 10**8, 32768, no_decay, 10**10))
    # the default does not decay; an age alone decays its keys one bit (6144 and 32768 are whole blocks of 128)
    default = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(), 10**10)
    assert default.decayed == decayed_tokens(32768, None, TurboQuantConfig()) == 0
    text = format_plan(default)
    assert "decay " not in text and "decaying" not in text
    assert ("TurboQuant K4/V4, window 128, sinks 4, calibrating on 768 tokens, keys K3 to K6 by their output error "
            f"(at most {format(KEY_OUTPUT_ERROR, 'g')})") in " ".join(text.split())
    aged = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(decay_after=6144), 10**10)
    assert f"decay       K4→3/V4 after 6144: {32768 - 6144:,} of 32,768 tokens at the decay bits" in format_plan(aged)
    # only the values decay (keys left at AUTO would decay to K3 once an age is given)
    boundary = make_plan("m", cfg, 10**8, 32768, TurboQuantConfig(value_bits=4, boundary_layers=1, decay_after=2048,
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
    # the default asks for no decay, at any bits: a suggestion prices what --bits gives
    for bits in ("4", "3.5", "3", "2.5", "2"):
        assert with_bits(TurboQuantConfig(), float(bits)) == config_from_args(
            cli.build_parser().parse_args(["m", "--bits", bits])), bits
    assert with_bits(TurboQuantConfig.from_bits(8), 4) == TurboQuantConfig(value_bits=4)  # --bits 4 from K8/V8


def test_context_beyond_training_warns(tiny_model_dir, capsys):
    assert cli.main([str(tiny_model_dir), "--plan", "--ctx", "8k"]) == 0
    assert "beyond the model's trained context of 4,096 tokens" in capsys.readouterr().out


def test_refuses_what_does_not_fit_and_suggests(tiny_model_dir, monkeypatch, capsys):
    cfg = load_model_config(tiny_model_dir)
    weights = weight_bytes(tiny_model_dir)
    # room for the predicted peak with a 2-bit KV cache of 64k tokens (tq-chat prefills 512 tokens at a time):
    # the default 4 bits do not fit
    room = estimate_peak_bytes(cfg, 65536, TurboQuantConfig.from_bits(2), weights=weights, prefill_step=512)
    monkeypatch.setattr("tq_mlx.planner.machine.available_memory", lambda: int(room / 0.9) + 1)
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
    assert plan.config == fit_max_kv_size(TurboQuantConfig(), 256) and plan.config.window < TurboQuantConfig().window
    assert plan.kv == estimate_kv_bytes(cfg, 4096, plan.config, max_kv_size=256)
    text = format_plan(plan)
    assert (f"note: --max-kv-size 256 is below sinks + calibration tokens + compress block - 1 = 899 tokens (the "
            f"float sinks and window are never dropped, nor anything before the first compression): keeping 4 sinks, "
            f"a window of {plan.config.window} tokens and compress "
            f"blocks of {plan.config.compress_block_size}") in text
