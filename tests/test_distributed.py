"""Sharded models (mlx-lm's tensor parallel `model.shard` and pipeline `model.model.pipeline`) generating with
TurboQuant caches under `mlx.launch --backend ring -n 2` on localhost, against a single-process run.

The test launches this file as the distributed program (`python tests/test_distributed.py worker ...`): each
rank loads the same tiny random qwen2 folder with mlx-lm's sharded_load, patches it with tq_mlx, greedily
generates and writes its tokens and cache shapes to a JSON file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script by mlx.launch
    sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from tests.support.server import stop, wait_until_healthy  # noqa: E402
from tests.support.tiny_models import EOS, VOCAB, _randomize, tiny_tokenizer  # noqa: E402
from tq_mlx.config import TurboQuantConfig  # noqa: E402

# A small window so that most of the prompt and of the answer are compressed; the first and last layers at 8 bits,
# which a pipeline stage must count in the whole model. Keys widen by their logit error (key_error), whose widths a
# tensor-parallel rank chooses on its half of the heads as one process does on both here; by their output error each
# rank would choose on its own heads' attention outputs.
CONFIG = TurboQuantConfig(key_bits=4, value_bits=3, window=16, calibration_tokens=None, compress_block=8, sinks=2, boundary_layers=1,
                          key_output_error=None)
TQ_FLAGS = ["--tq-key-bits", "4", "--tq-value-bits", "3", "--tq-window", "16", "--tq-calibration-tokens", "16", "--tq-compress-block", "8",
            "--tq-sinks", "2", "--tq-boundary-layers", "1", "--tq-key-output-error", "off"]
PROMPT = [(7 * i + 3) % 256 for i in range(40)]
MAX_TOKENS = 24
LAYERS = 4
BITS = [[8, 8], [4, 3], [4, 3], [8, 8]]  # (key, value) bits of each layer: boundary_layers=1
TIMEOUT = 300


def save_tiny_qwen2(path: Path) -> Path:
    """A tiny random qwen2 folder (4 layers, 4 q / 2 kv heads, head_dim 64, float32), which mlx-lm 0.32.2 can
    shard both ways: `shard` (tensor parallel) and `model.pipeline` (PipelineMixin). sharded_load needs the
    weight index to pick each pipeline stage's files."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=256,
        num_hidden_layers=LAYERS,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = _randomize(qwen2.Model(args), seed=3, dtype=mx.float32)
    # Smaller embeddings let attention (so the cache) outweigh the current token: the greedy answer varies with
    # the context instead of repeating one byte.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.3
    path.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    config.update(eos_token_id=EOS, max_position_embeddings=4096)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    tiny_tokenizer()._tokenizer.save_pretrained(str(path))
    return path


def run_generation(model_dir: str, mode: str) -> dict:
    """Load (sharded for "tensor" / "pipeline"), patch, greedily generate; the tokens and every cache's shape."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load, sharded_load

    from tq_mlx.cache import TurboQuantKVCache
    from tq_mlx.integration import patch_model

    group = mx.distributed.init()
    if mode == "single":
        model, _ = load(model_dir)
    else:
        model, _ = sharded_load(model_dir, pipeline_group=group if mode == "pipeline" else None,
                                tensor_group=group if mode == "tensor" else None)
    patch_model(model, CONFIG)
    cache = make_prompt_cache(model)
    # Prefill in chunks, so that generate's mx.eval of the cache state after each chunk runs the pipeline's send.
    steps = generate_step(mx.array(PROMPT), model, prompt_cache=cache, max_tokens=MAX_TOKENS, prefill_step_size=16)
    tokens, logprobs = [], []
    for t, lp in steps:
        tokens.append(int(t))
        logprobs.append(lp.tolist())
    # generate_step leaves one more step in flight: finish it everywhere before any rank exits and closes its
    # sockets under a peer that is still receiving.
    mx.synchronize()
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    caches = [
        {"layer": c.layer_index, "heads": c.batch_heads()[1], "compressed": c.n_coded,
         "bits": [c.key_bits, c.value_bits]}
        for c in cache
        if isinstance(c, TurboQuantKVCache)
    ]
    return {"rank": group.rank(), "size": group.size(), "tokens": tokens, "logprobs": logprobs, "caches": caches}


def free_port_pair() -> int:
    """A port p with p and p + 1 free (mlx.launch's ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def launch_command(*command: str) -> list[str]:
    """`mlx.launch --backend ring -n 2 <command>` on localhost (mlx.launch's main, with this Python)."""
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
            "--backend", "ring", "-n", "2", "--starting-port", str(free_port_pair()), "--", *command]


def mlx_launch(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(launch_command(*command), cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=TIMEOUT)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def single(qwen2_dir) -> dict:
    return run_generation(str(qwen2_dir), "single")


def test_ring_backend_runs_two_processes_here():
    # Checked, not assumed: if this fails, the sharded tests below cannot run on this machine.
    # One write per rank: print() writes its pieces one by one when unbuffered, and the two ranks' pieces could
    # interleave in mlx.launch's relayed output ('rank 1rank 0 2 3' seen once in CI).
    script = "import os, mlx.core as mx; g = mx.distributed.init(); " \
             "os.write(1, f'rank {g.rank()} {g.size()} {mx.distributed.all_sum(mx.array(g.rank() + 1)).item()}\\n'" \
             ".encode()); os._exit(0)"
    r = mlx_launch(sys.executable, "-c", script)
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank")) == ["rank 0 2 3", "rank 1 2 3"]


def launch_workers(mode: str, model_dir: Path, tmp_path: Path) -> list[dict]:
    """Each rank's run_generation result. mlx.launch exits 0 even when a rank fails, hence the files."""
    out = tmp_path / f"{mode}-rank{{}}.json"
    r = mlx_launch(sys.executable, str(Path(__file__).resolve()), "worker", str(model_dir), mode, str(out))
    files = [Path(str(out).format(rank)) for rank in range(2)]
    assert r.returncode == 0 and all(f.exists() for f in files), f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return [json.loads(f.read_text()) for f in files]


def max_logprob_diff(a: dict, b: dict) -> float:
    return float(np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"])).max())


def test_single_process_reference_compresses(single):
    assert len(single["tokens"]) == MAX_TOKENS
    assert len(set(single["tokens"])) > 1  # the answer depends on the context, not only on the last token
    # Every layer compressed most of the 64 tokens: 2 sinks + 48 compressed + 14 in the window.
    assert [(c["layer"], c["heads"], c["compressed"], c["bits"]) for c in single["caches"]] == \
        [(i, 2, 48, BITS[i]) for i in range(LAYERS)]


def test_tensor_parallel_matches_single_process(qwen2_dir, single, tmp_path):
    ranks = launch_workers("tensor", qwen2_dir, tmp_path)
    for res in ranks:
        assert res["size"] == 2
        assert res["tokens"] == single["tokens"]
        # All-reduced partial sums round differently (about 1e-5 on the keys), which can move a key across a
        # quantization boundary: one flipped code moved a log-probability by 1.8e-3 under OpenBLAS. Another
        # rotation seed moves them by ~2.
        assert max_logprob_diff(res, single) < 2e-2
        # Every rank caches every layer, on its half of the kv heads.
        assert [(c["layer"], c["heads"], c["compressed"], c["bits"]) for c in res["caches"]] == \
            [(i, 1, 48, BITS[i]) for i in range(LAYERS)]


def test_pipeline_matches_single_process(qwen2_dir, single, tmp_path):
    ranks = launch_workers("pipeline", qwen2_dir, tmp_path)
    for res in ranks:
        assert res["size"] == 2
        assert res["tokens"] == single["tokens"]
        assert max_logprob_diff(res, single) == 0.0  # the same operations, split between two processes
    # Rank 1 runs the first layers, rank 0 the last ones; each caches its own under their model indices, which
    # seed the rotations and place the boundary layers as in the single process.
    for res, layers in ((ranks[1], [0, 1]), (ranks[0], [2, 3])):
        assert [(c["layer"], c["heads"], c["compressed"], c["bits"]) for c in res["caches"]] == \
            [(i, 2, 48, BITS[i]) for i in layers]


# --- tq-generate under mlx.launch -------------------------------------------------------------------------------

# As the tq-generate command does: exit without MLX's teardown, which can abort (losing buffered output, and
# making mlx.launch stop the other rank).
GENERATE = [sys.executable, "-c", "import sys; from tq_mlx.cli.flags import exit_without_teardown; from tq_mlx.cli.generate import generate_main; "
            "exit_without_teardown(generate_main(sys.argv[1:]))"]


PROMPT_TEXT = "The quick brown fox jumps over the lazy dog, again and again."  # 61 byte tokens


def generate_args(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--prompt", PROMPT_TEXT,
            "--ignore-chat-template", "--max-tokens", str(MAX_TOKENS), "--verbose", "False", *TQ_FLAGS]


def float16_kb(summary: str) -> float:
    """What mlx-lm's own cache would hold, from tq-generate's summary line ("KV cache: 292 KB for 85 tokens;
    mlx-lm's float32 cache would hold 1.05 MB; ...")."""
    size, unit = summary.split(" cache would hold ")[1].split(";")[0].split()
    return float(size) * {"KB": 1, "MB": 1000}[unit]  # format_bytes: decimal units


@pytest.fixture(scope="module")
def generate_single(qwen2_dir) -> tuple[str, str]:
    """tq-generate's stdout and summary line in one process (run as a command, like the launched ones)."""
    r = subprocess.run([*GENERATE, *generate_args(qwen2_dir)], cwd=REPO, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    return r.stdout, next(line for line in r.stderr.splitlines() if line.startswith("KV cache:"))


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_tq_generate_under_mlx_launch_matches_single_process(mode, qwen2_dir, generate_single):
    text, summary = generate_single
    # boundary layers at 8 bits; the middle ones' keys at the width their error chose
    assert text.strip() and re.search(r"L0 K8/V8 · (L[\d-]+ K[4-6]/V3 · )+L3 K8/V8$", summary), summary
    r = mlx_launch(*GENERATE, *generate_args(qwen2_dir), *(["--pipeline"] if mode == "pipeline" else []))
    shard = [line for line in r.stderr.splitlines() if line.startswith("KV cache:")]
    assert r.returncode == 0 and len(shard) == 1, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    # Rank 0 prints the answer and its summary, rank 1 nothing: the same answer as one process.
    assert r.stdout == text
    # Rank 0's cache is a shard: half the heads of every layer (tensor parallel) or the last half of the layers.
    assert shard[0].endswith("(rank 0's shard of 2)")
    assert float16_kb(shard[0]) == pytest.approx(float16_kb(summary) / 2, rel=0.02)


# --- tq-server under mlx.launch ---------------------------------------------------------------------------------


def test_tq_server_pipeline_under_mlx_launch_answers_like_one_process(qwen2_dir, generate_single, tmp_path):
    """mlx_lm.server's --pipeline passes through tq-server: rank 0 serves HTTP, both ranks generate (unbatched:
    the batch cache cannot carry a pipeline stage's send). Its greedy answer is tq-generate's single-process one."""
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = [sys.executable, "-c", "import sys; from tq_mlx.cli.server import server_main; sys.exit(server_main())",
              "--model", str(qwen2_dir), "--port", str(port), "--pipeline", *TQ_FLAGS]
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(launch_command(*server), stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=ENV,
                                start_new_session=True)
    try:
        wait_until_healthy(proc, port, log, TIMEOUT)
        body = json.dumps({"prompt": PROMPT_TEXT, "max_tokens": MAX_TOKENS, "temperature": 0.0})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=TIMEOUT).read())
    finally:
        stop(proc)
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert reply["choices"][0]["text"] == generate_single[0].rstrip("\n")
    text = log.read_text()
    assert text.count("KV cache: TurboQuant K4/V3, window 16, sinks 2, boundary 1 layers at 8 bits, keys up to K6 where "
                      "their logit error exceeds 0.1; batching off") == 2  # both ranks


def _worker(model_dir: str, mode: str, out: str) -> None:
    res = run_generation(model_dir, mode)
    Path(out.format(res["rank"])).write_text(json.dumps(res))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        from tq_mlx.cli.flags import exit_without_teardown

        _worker(*sys.argv[2:])
        # mlx.launch stops every rank once one exits with an error, and MLX's exit-time teardown can abort
        # (tq_mlx.cli.flags.exit_without_teardown): a rank done first could take down a peer still writing its result.
        exit_without_teardown(0)
    else:
        sys.exit(f"usage: {sys.argv[0]} worker MODEL_DIR tensor|pipeline OUT_PATTERN")
