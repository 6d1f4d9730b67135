"""tq-generate, tq-server and the shared --tq-* cache flags (tq_mlx/cli.py), on a tiny random model folder."""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from tq_mlx.cli import add_cache_args, cache_flags_given, config_from_args, describe_config, generate_main

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
    )
    assert config_from_args(args) == TurboQuantConfig(
        key_bits=3, value_bits=2.5, qjl=True, window=64, compress_block=16, sinks=2, boundary_layers=1, boundary_bits=4,
        center_keys=False, center_values=False, seed=7, protect_factor=3.5, protect_bits=4,
    )
    assert len(cache_flags_given(args)) == 13


def test_key_protection_flags():
    assert config_from_args(parse("--tq-no-protect")).protect_factor is None
    assert "no key protection" in describe_config(config_from_args(parse("--tq-no-protect")))
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse("--tq-no-protect", "--tq-protect-factor", "6"))
    with pytest.raises(SystemExit):
        parse("--tq-protect-factor", "0.5")


def test_value_centering_both_ways():
    assert config_from_args(parse("--tq-center-values")).center_values is True
    assert config_from_args(parse("--tq-no-center-values")).center_values is False
    with pytest.raises(ValueError, match="contradict"):
        config_from_args(parse("--tq-center-values", "--tq-no-center-values"))


def test_key_and_value_bits_override_both():
    cfg = config_from_args(parse("--tq-bits", "2", "--tq-key-bits", "8"))
    assert (cfg.key_bits, cfg.value_bits) == (8, 2)


def test_short_aliases():
    p = add_cache_args(argparse.ArgumentParser(), short_aliases=True)
    cfg = config_from_args(p.parse_args(["--bits", "3.5", "--k-bits", "4"]))
    assert (cfg.key_bits, cfg.value_bits) == (4, 3.5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tq-bits", "5"], "allowed are 1, 2, 2.5, 3, 3.5, 4, 8"),
        (["--tq-key-bits", "four"], "allowed are 1, 2, 2.5, 3, 3.5, 4, 8"),
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
                        "--tq-bits", "3", "--tq-window", "8", "--tq-sinks", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Generation:" in out  # mlx_lm.generate's own verbose output
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("KV cache:") and "K3/V3 on all 3 attention layers" in summary
    # against mlx-lm's own float32 cache (256-token steps), never a negative saving; the window is named
    assert "mlx-lm's float32 cache would hold" in summary and re.search(r"saved [\d.]+ KB \([\d.]+x\)", summary), summary
    assert "tokens compressed, " in summary and "in float32 (2 sinks + 8-token window)" in summary, summary


def test_generate_quiet_prints_only_the_answer_and_summary_to_stderr(tiny_model_dir, capsys):
    rc = generate_main(["--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4", "--verbose", "F"])
    captured = capsys.readouterr()
    assert rc == 0 and "KV cache:" not in captured.out
    assert "K4/V3" in captured.err


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
    assert "K4/V4 on all 3 attention layers" in capsys.readouterr().out


# --- tq-server -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_answers_an_openai_chat_request(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "import sys; from tq_mlx.cli import server_main; sys.exit(server_main())",
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
    from tq_mlx.cli import server_main

    with pytest.raises(SystemExit) as e:
        server_main(["--model", "x", "--kv-bits", "4", "--tq-bits", "3"])
    assert e.value.code == 2 and "cannot be combined" in capsys.readouterr().err
