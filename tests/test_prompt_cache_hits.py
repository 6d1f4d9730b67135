"""Every kind of prompt-cache hit answers as the same request on a fresh prefill does: a memory hit, a disk hit after
a restart, a hit whose common prefix ends inside the compressed tokens (the cache trimmed into its codes, and into
its decayed codes), and two concurrent requests sharing a prefix.

* The demo model (SmolLM2-135M-Instruct): tq-server with the disk tier, the same greedy tokens as a server that
  keeps no prompt cache. A small window (64, compress blocks of 32, decay after 256) makes a 500-token prompt
  compress and decay, so a trim lands in the codes.
* A real model (Qwen2.5-Coder-0.5B-Instruct) with a needle in the middle of a long shared prefix: tq-server's
  prompt cache in process (server_cache.PromptCache over a PromptStore), the needle found after each kind of hit as
  on the fresh prefill.

Both run on OpenBLAS (in a subprocess where this process has the reference BLAS), as tq-server does on Linux."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tq_mlx.blas import OPENBLAS_LIB, openblas_preloaded

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import serve  # noqa: E402

# read as decode: a prompt's logits do not depend on where a hit splits its prefill, so a hit can equal a fresh prefill
# to the token (without it the chunk moves them; on an AMD EPYC CPU the disk hit's greedy answer parts at token 8)
SMALL = ["--tq-prefill-as-decode", "--tq-window", "64", "--tq-calibration-tokens", "64", "--tq-compress-block", "32", "--tq-decay-after", "256", "--tq-max-context", "0",
         "--max-tokens", "16"]
NEEDLE = " The special magic number for the archive is 7314926. "
TIMEOUT = 600


def openblas_env() -> dict:
    env = dict(os.environ)
    if Path(OPENBLAS_LIB).exists():
        env["LD_PRELOAD"] = OPENBLAS_LIB
    return env


def cached(reply: dict) -> int:
    return reply["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]


def hits(log: Path, since: int) -> list[str]:
    with open(log, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return re.findall(r"Prompt cache: (memory hit|disk hit|miss)", text)


def written(port: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        s = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/prompt_cache", timeout=10).read())
        if s["disk"]["pending_writes"] == 0:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.2)


@pytest.mark.slow
def test_every_kind_of_hit_on_the_demo_model_answers_as_a_fresh_prefill(tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tests.support.real_models import SMOLLM2, prepare_model
    from tests.support.texts import britannica_text

    path = prepare_model(SMOLLM2, "float32")  # float32: float16 matmuls bypass BLAS on a CPU
    tok = load_tokenizer(path)
    hay = tok.decode(tok.encode(britannica_text()[:4000])[:450])
    part = hay[: len(hay) * 2 // 3]
    asks = {
        "cold": hay + "\n\nSummarize the text above in one sentence.",
        "memory": hay + "\n\nWhat is the text above about? Answer briefly.",
        "disk": hay + "\n\nName one thing the text above mentions.",
        "codes": part + "\n\nWhat is this text about?",
        "pair-1": hay + "\n\nWho would read the text above?",
        "pair-2": hay + "\n\nGive the text above a title.",
    }
    fresh = {}
    with serve.Server("tq", path, [*SMALL, "--prompt-cache-size", "0"], tmp_path / "fresh.log", env=openblas_env(),
                      start_timeout=180) as srv:
        for k, content in asks.items():
            fresh[k] = serve.chat(srv.port, content, 16, TIMEOUT)
            assert fresh[k]["status"] == 200 and cached(fresh[k]) == 0
    store = ["--tq-prompt-cache-dir", str(tmp_path / "store")]
    got, log1, log2 = {}, tmp_path / "first.log", tmp_path / "restarted.log"
    with serve.Server("tq", path, [*SMALL, *store], log1, env=openblas_env(), start_timeout=180) as srv:
        for k in ("cold", "memory"):
            got[k] = serve.chat(srv.port, asks[k], 16, TIMEOUT)
        written(srv.port)
    assert hits(log1, 0) == ["miss", "memory hit"]
    with serve.Server("tq", path, [*SMALL, *store], log2, env=openblas_env(), start_timeout=180) as srv:
        for k in ("disk", "codes"):
            got[k] = serve.chat(srv.port, asks[k], 16, TIMEOUT)
        at = srv.log_offset()
        _, pair = serve.concurrent(srv.port, [asks["pair-1"], asks["pair-2"]], 16, TIMEOUT)
        got["pair-1"], got["pair-2"] = pair
        batches = srv.batches_since(at)
    said = hits(log2, 0)  # after the restart the first hit is from disk; later ones from memory or disk
    assert said[0] == "disk hit" and len(said) == 4 and "miss" not in said, said
    assert max(b["max_rows"] for b in batches) == 2  # the pair shared a batch
    # the codes hit kept fewer tokens than it shares with the cache it came from: trimmed into its codes
    shared = len(tok.apply_chat_template([{"role": "user", "content": part}], add_generation_prompt=False)) - 8
    assert 4 < cached(got["codes"]) < shared
    assert all(cached(got[k]) > 300 for k in ("memory", "disk", "pair-1", "pair-2"))
    for k in asks:
        assert serve.answer(got[k]) == serve.answer(fresh[k]), (k, serve.answer(got[k]), serve.answer(fresh[k]))


# --- a needle in a long shared prefix, on a real model ---------------------------------------------------------


def needle_run(folder: str) -> dict:
    """Qwen2.5-Coder-0.5B (window 256, compress blocks of 64) with a 1500-token prefix holding NEEDLE: the answers
    after a fresh prefill, a memory hit, a disk hit in a new store and prompt cache (a restart), a hit trimmed into
    the codes, and two hits batched together; with the tokens each kept."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generate_step

    import tq_mlx
    from tests.support.real_models import load_qwen25_coder_05b
    from tests.support.texts import britannica_text
    from tq_mlx import TurboQuantConfig
    from tq_mlx.prompt_cache.store import PromptStore, model_id
    from tq_mlx.prompt_cache.lru import PromptCache

    model, tok = load_qwen25_coder_05b(mx.float32)
    config = TurboQuantConfig(window=256, calibration_tokens=None, compress_block=64)
    tq_mlx.patch_model(model, config)
    hay = tok.decode(tok.encode(britannica_text()[:12000])[:1440])
    at = hay.find(". ", len(hay) // 2) + 1
    hay = f"{hay[:at]}{NEEDLE}{hay[at:].lstrip()}"
    cut = hay.find(". ", at + len(NEEDLE) + 400) + 1  # a shorter prefix that ends inside the codes, after the needle

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)

    def answer(prompt: list[int], cache=None) -> tuple[str, list[int], list]:
        """The answer's text, every token generated (the end-of-sequence one too: it was fed) and the cache."""
        cache = cache if cache is not None else tq_mlx.make_prompt_cache(model, config)
        out = []
        for y, _ in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=24):
            out.append(int(y))
            if int(y) in tok.eos_token_ids:
                break
        return tok.decode([t for t in out if t not in tok.eos_token_ids]), out, cache

    q = ["What is the special magic number for the archive? Answer with the number.",
         "Which number is the special magic number for the archive?",
         "Tell me the special magic number for the archive.",
         "What is the archive's special magic number?",
         "Repeat the special magic number for the archive."]
    store_args = dict(model_id=model_id(model), config=config, model_name="qwen", min_tokens=256)

    def tiers(store):
        return PromptCache(10, stores=lambda key: (store, model) if key == "m" else None)

    out = {}
    cold = chat(hay + "\n\n" + q[0])
    text, gen, cache = answer(cold)
    out["fresh"] = (text, 0)
    lru = tiers(PromptStore(folder, 10**10, **store_args))
    lru.insert_cache("m", (cold + gen)[: cache[0].offset], cache)
    lru.stores("m")[0].flush(120)
    for name, prompt in (("memory", chat(hay + "\n\n" + q[1])),):
        c, rest = lru.fetch_nearest_cache("m", prompt)
        out[name] = (answer(rest, c)[0], len(prompt) - len(rest))
    lru = tiers(PromptStore(folder, 10**10, **store_args))  # a restart: a new store and prompt cache
    for name, prompt in (("disk", chat(hay + "\n\n" + q[2])), ("codes", chat(hay[:cut] + "\n\n" + q[3]))):
        c, rest = lru.fetch_nearest_cache("m", prompt)
        text, gen, c = answer(rest, c)
        out[name] = (text, len(prompt) - len(rest))
        lru.insert_cache("m", (prompt + gen)[: c[0].offset], c)
    out["counters"] = dict(lru.counters)
    pair = [chat(hay + "\n\n" + q[4]), chat(hay + "\n\n" + q[1])]
    fetched = [lru.fetch_nearest_cache("m", p) for p in pair]
    gen = BatchGenerator(model, stop_tokens=[list(tok.eos_token_ids)])
    uids = gen.insert([rest for _, rest in fetched], [24, 24], caches=[c for c, _ in fetched])
    tokens = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                tokens[r.uid].append(r.token)
    gen.close()
    for i, (u, (c, rest)) in enumerate(zip(uids, fetched)):
        out[f"pair-{i + 1}"] = (tok.decode(tokens[u]), len(pair[i]) - len(rest))
    out["shared_codes_prefix"] = len(chat(hay[:cut])) - 8
    return out


@pytest.mark.slow
def test_a_needle_in_a_long_shared_prefix_is_found_after_every_kind_of_hit(tmp_path):
    code = f"import json; from tests.test_prompt_cache_hits import needle_run; print(json.dumps(needle_run({str(tmp_path)!r})))"
    env = openblas_env() if not openblas_preloaded() else dict(os.environ)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for kind in ("fresh", "memory", "disk", "codes", "pair-1", "pair-2"):
        text, kept = out[kind]
        assert "7314926" in text, (kind, text)
        if kind != "fresh":
            assert kept > 256, (kind, kept)
    assert out["counters"]["disk_hits"] >= 1 and out["counters"]["misses"] == 0
    assert out["codes"][1] < out["shared_codes_prefix"]  # trimmed into its codes: fewer kept than shared
