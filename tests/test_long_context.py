"""long_context.py's parts without a model run (and value_mix.py's, which mixes its settings layer by layer): its
settings and their names, the bits it counts, the float pass's checkpoint, needles and arguments (the --quick run
itself is tests/test_benchmarks.py's)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
EXPERIMENTS = BENCH.parent / "experiments"  # value_mix.py
sys.path.insert(0, str(BENCH))


def test_long_context_rows_measured_with_values_centered_say_so() -> None:
    # The default stopped centering values: rows stored before keep what they measured under a name that says so
    # (and never merge with a row of the new default), and sort beside the setting they came from.
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc

    old = {"setting": "TQ K4/V3 (the default)", "kind": "tq", "config": dict(lc.K4V3.config.to_dict(), center_values=True)}
    new = {"setting": "TQ K4/V3 (the default)", "kind": "tq", "config": lc.K4V3.config.to_dict()}
    assert lc.canonical_name(new) == lc.K4V3.name == "TQ K4/V3 (the default until 2026-11-26)"
    renamed = lc.canonical_name(old)
    assert renamed == "TQ K4/V3 (the default until 2026-11-25, values centered)"
    assert lc.canonical_name(dict(old, setting=renamed)) == renamed and lc.base_name(renamed) == lc.K4V3.name
    # The default decayed from 2026-11-26 to 2026-12-05: a row of it spelled out (or stored before norm_bits and the decay
    # fields existed, meaning 16-bit norms and no decay) is named by what it measured.
    spelled = {"setting": "TQ K4/V4 (8-bit norms, decaying to K3/V4 after 6144, keys centered before RoPE, keys weighed by the queries, keys up to K6 above logit error 0.1)",
               "kind": "tq", "config": lc.parse_setting("k4v4w768b128d6144k3v4n8rqe0.1").config.to_dict()}
    assert lc.canonical_name(spelled) == lc.DEFAULT_1203.name and lc.parse_setting("k4v4w768b128d6144k3v4n8rqe0.1") is lc.DEFAULT_1203
    # ... and reads a prefill chunk as decode steps would since 2026-12-03: the default's rows stored before keep
    # their numbers under the name of the default until then (shown beside today's, never merged into it), and a
    # row of the spelled-out setting read as decode is today's default's
    stored = dict(spelled, setting=spelled["setting"][:-1] + ", the default)")
    assert lc.canonical_name(stored) == lc.DEFAULT_1203.name == "TQ K4/V4 (8-bit norms, decaying to K3/V4 after 6144, keys centered before RoPE, keys weighed by the queries, keys up to K6 above logit error 0.1, the default until 2026-12-03)"
    assert lc.parse_setting("default-1203") is lc.DEFAULT_1203 and lc.DEFAULT_1203.name in lc.HEADLINE_PRESETS
    pd = {"setting": spelled["setting"][:-1] + ", prefill read as decode)", "kind": "tq",
          "config": lc.parse_setting("k4v4w768b128d6144k3v4n8rqe0.1pd").config.to_dict()}
    assert lc.canonical_name(pd) == lc.DEFAULT_1204.name and lc.parse_setting("k4v4w768b128d6144k3v4n8rqe0.1pd") is lc.DEFAULT_1204
    assert lc.parse_setting("default-1204") is lc.DEFAULT_1204 and lc.DEFAULT_1204.name.endswith("the default until 2026-12-04)")
    # ... and keeps 128 tokens in float since 2026-12-04, calibrating on 768: that spelled-out row is the default
    # until 2026-12-05's, when values fell to V3 with their norms corrected and keys stopped decaying: today's
    small = {"setting": "x", "kind": "tq", "config": lc.parse_setting("k4v4w128b128d6144k3v4n8rqe0.1pdc768").config.to_dict()}
    assert lc.canonical_name(small) == lc.DEFAULT_1205.name and lc.parse_setting("k4v4w128b128d6144k3v4n8rqe0.1pdc768") is lc.DEFAULT_1205
    assert lc.parse_setting("default-1205") is lc.DEFAULT_1205 and lc.DEFAULT_1205.name.endswith("the default until 2026-12-05)")
    v3 = {"setting": "x", "kind": "tq", "config": lc.parse_setting("k4v3w128b128n8rqe0.1ncpdc768").config.to_dict()}
    assert lc.canonical_name(v3) == lc.DEFAULT_1206.name and lc.parse_setting("k4v3w128b128n8rqe0.1ncpdc768") is lc.DEFAULT_1206
    assert lc.parse_setting("default-1206") is lc.DEFAULT_1206 and lc.DEFAULT_1206.name.endswith("the default until 2026-12-06)")
    # ... and since 2026-12-06 its values are V4 and its keys take K3-K6 by their output error, its 8-bit norms in
    # the coarse code until later that day, then the fine one; then the keys' target fell to 0.024: today's
    coarse = {"setting": "x", "kind": "tq", "config": lc.parse_setting("k4v4w128b128n8rqo0.028ncpdc768").config.to_dict()}
    assert lc.canonical_name(coarse) == lc.DEFAULT_1206B.name and lc.parse_setting("k4v4w128b128n8rqo0.028ncpdc768") is lc.DEFAULT_1206B
    assert lc.parse_setting("default-1206b") is lc.DEFAULT_1206B and lc.DEFAULT_1206B.name.endswith("the default until 2026-12-06, later)")
    fine = {"setting": "x", "kind": "tq", "config": lc.parse_setting("k4v4w128b128n8frqo0.028ncpdc768").config.to_dict()}
    assert lc.canonical_name(fine) == lc.DEFAULT_1206C.name and lc.parse_setting("k4v4w128b128n8frqo0.028ncpdc768") is lc.DEFAULT_1206C
    assert lc.parse_setting("default-1206c") is lc.DEFAULT_1206C and lc.DEFAULT_1206C.name.endswith("the default until 2026-12-06, third)")
    today = {"setting": "x", "kind": "tq", "config": lc.parse_setting("k4v4w128b128n8frqo0.024ncpdc768").config.to_dict()}
    assert lc.canonical_name(today) == lc.DEFAULT.name and lc.parse_setting("k4v4w128b128n8frqo0.024ncpdc768") is lc.DEFAULT
    # a row stored before configs named norm_steps was measured with the coarse code
    older = dict(coarse, config={k: v for k, v in coarse["config"].items() if k != "norm_steps"})
    assert lc.canonical_name(older) == lc.DEFAULT_1206B.name
    # compact and quality too: the same presets before it, by name
    for key, old in (("compact", lc.COMPACT_1203), ("quality", lc.QUALITY_1203)):
        before = dataclasses.replace(lc.parse_setting(key).config, prefill_as_decode=False)
        assert lc.canonical_name({"setting": "x", "kind": "tq", "config": before.to_dict()}) == old.name
        assert lc.parse_setting(f"{key}-1203") is old and old.name.endswith(f"{key} until 2026-12-03)")
    # ... with keys widened by their error and values at 4 bits at every age since 2026-11-28: the rows of the
    # default before (values decayed to V2, keys at K4) keep their numbers under the name of what they measured
    was = {"setting": "TQ K4/V4 (8-bit norms, decaying to K3/V2 after 6144, keys centered before RoPE, keys weighed by the queries, the default)",
           "kind": "tq", "config": lc.parse_setting("k4v4w768b128d6144k3v2n8rq").config.to_dict()}
    assert lc.canonical_name(was) == lc.DECAY_V2.name != lc.DEFAULT.name
    assert lc.DECAY_V2.name in lc.HEADLINE_PRESETS and lc.parse_setting("default-1127") is lc.DECAY_V2
    # ... and its keys are weighed by the queries later on 2026-11-26: the default's rows from before measured them
    # unweighed and keep their numbers under that name (docs/benchmarks.md; the README's headline keeps the two
    # defaults before today's)
    unweighed = {"setting": "TQ K4/V4 (8-bit norms, decaying to K3/V2 after 6144, keys centered before RoPE, the default)",
                 "kind": "tq", "config": lc.parse_setting("k4v4w768b128d6144k3v2n8r").config.to_dict()}
    assert lc.canonical_name(unweighed) == lc.DEFAULT_ROPE.name != lc.DEFAULT.name
    assert lc.DEFAULT_ROPE.name == "TQ K4/V4 (8-bit norms, decaying to K3/V2 after 6144, keys centered before RoPE)"
    assert lc.parse_setting("default-rope") is lc.DEFAULT_ROPE
    # ... and its keys are centered before RoPE since later that day: the rows of the default and of compact
    # measured with the mean after RoPE keep their numbers under the name of what they measured
    before = {"setting": "TQ K4/V4 (8-bit norms, decaying to K3/V2 after 6144, the default)", "kind": "tq",
              "config": lc.parse_setting("k4v4w768b128d6144k3v2n8").config.to_dict()}
    assert lc.canonical_name(before) == lc.DEFAULT_MEAN.name == "TQ K4/V4 (8-bit norms, decaying to K3/V2 after 6144)"
    assert before["config"]["center_keys"] is True and lc.DEFAULT.config.center_keys == "rope"
    compact = {"setting": "TQ K4/V3 (8-bit norms, decaying to K2/V2 after 4096, compact)", "kind": "tq",
               "config": lc.parse_setting("k4v3w768b128d4096k2v2n8").config.to_dict()}
    assert lc.canonical_name(compact) == "TQ K4/V3 (8-bit norms, decaying to K2/V2 after 4096)" != lc.COMPACT.name
    assert lc.canonical_name(dict(compact, config=lc.COMPACT.config.to_dict())) == lc.COMPACT.name
    rope = dict(compact, setting=compact["setting"].replace(", compact)", ", keys centered before RoPE, compact)"),
                config=lc.parse_setting("k4v3w768b128d4096k2v2n8r").config.to_dict())
    assert lc.canonical_name(rope) == "TQ K4/V3 (8-bit norms, decaying to K2/V2 after 4096, keys centered before RoPE)"
    assert lc.parse_setting("k4v3w768b128d4096k2v2n8rq") is lc.COMPACT_1203
    assert lc.parse_setting("k4v3w768b128d4096k2v2n8rqpd") is lc.COMPACT
    # Every preset's row is what --tq-preset builds (the blocks compressed alike: None means the library's 128),
    # and the quality preset spelled out (8-bit keys, 2026-11-27) is that row
    from tq_mlx import TurboQuantConfig
    from tq_mlx.config import PRESETS

    for name in PRESETS:
        built = TurboQuantConfig.preset(name)
        row = lc.parse_setting(name).config
        assert row.to_dict() | {"compress_block": None} == built.to_dict() | {"compress_block": None}, name
        assert row.compress_block_size == built.compress_block_size
    assert lc.parse_setting("k8v4w768b128n8rqpd") is lc.QUALITY and lc.QUALITY.name.endswith(", quality)")
    legacy = {k: v for k, v in lc.K4V3.config.to_dict().items() if k not in ("norm_bits", "decay_after")}
    assert lc.canonical_name({"setting": "TQ K4/V3 (the default)", "kind": "tq", "config": legacy}) == lc.K4V3.name
    assert lc.canonical_name({"setting": "TQ K4/V4", "kind": "tq", "config": dict(legacy, value_bits=4)}) == "TQ K4/V4"
    plain = {"setting": "TQ K4/V4", "kind": "tq", "config": dict(lc.K4V4.config.to_dict(), center_values=True)}
    assert lc.canonical_name(plain) == "TQ K4/V4 (values centered)" and lc.base_name("TQ K4/V4 (values centered)") == "TQ K4/V4"
    assert lc.tq(4, 4, center_values=True).name == "TQ K4/V4 (values centered)"


def test_long_context_counts_protected_layers_in_the_bits() -> None:
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc

    g = {"attention_layers": 24, "kv_heads": 2, "head_dim": 64}
    row = {"kind": "tq", "config": lc.K4V3.config.to_dict(),
           "texts": {"britannica": {"protected_layers": [0]}, "hamlet": {"protected_layers": []}}}
    # K4/V3 without decay: one layer of 24 with its keys at 8 instead of 4 bits: +4 bits on 1/48 of the values,
    # times the compressed share of the context: 250 blocks of 128 (the window keeps the other 764 tokens after
    # the 4 sinks), plus the protecting quantizer's constants (its 8-bit codebook and lookup tables)
    compressed = 250 * 128
    plain = lc.protection_bits(row, g, 32768)
    assert 4 / 48 * compressed / 32768 < plain < 1.01 * 4 / 48 * compressed / 32768
    # With decay the protected keys also stay out of it: 8 bits instead of the 3 the others decay to
    row["config"] = dict(row["config"], decay_after=2048, decay_key_bits=3, decay_value_bits=2)
    assert lc.protection_bits(row, g, 32768) > 1.2 * plain
    # The default until 2026-12-05's protected keys: 8 bits with float16 norms, against K4/K3 codes with uint8 norms
    row["config"] = lc.DEFAULT_1205.config.to_dict()
    assert lc.protection_bits(row, g, 32768) > 1.2 * plain
    row["texts"]["britannica"]["protected_layers"] = []
    assert lc.protection_bits(row, g, 32768) == 0


def test_long_context_counts_the_bits_old_values_chose() -> None:
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc

    g = {"attention_layers": 24, "kv_heads": 2, "head_dim": 64}
    setting = lc.parse_setting("k4v4w768b128d6144k3v4n8rqe0.1ve0.05")
    assert setting.config.value_error == 0.05 and "old values down to V2 within output error 0.05" in setting.name
    row = {"kind": "tq", "config": setting.config.to_dict(),
           "texts": {"britannica": {"value_widths": [[3, 2], [5, 4]]}, "hamlet": {"value_widths": [[3, 3], [5, 4]]}}}
    # layer 3 decayed its old values to 3 bits in one text and 2 in the other: priced at 3 (the most); layer 5
    # kept V4, as bits_at prices every layer. Tokens past 6144 decay in whole blocks: 26,624 of the 32,768 are old
    # (decayed_tokens), so V3 instead of V4 there takes about 1 bit off 1/48 of the values on 26,624/32,768 tokens.
    from tq_mlx.planner.memory import decayed_tokens

    old = decayed_tokens(32768, None, setting.config)
    got = lc.protection_bits(row, g, 32768)
    assert -1.0 / 48 * old / 32768 * 1.01 < got < -1.0 / 48 * old / 32768 * 0.9
    row["texts"]["hamlet"]["value_widths"] = [[3, 2], [5, 4]]
    assert lc.protection_bits(row, g, 32768) < 1.9 * got  # V2: two bits off, less the 8-bit norms' share
    row["texts"] = {"britannica": {"value_widths": [[3, 4]]}}
    assert lc.protection_bits(row, g, 32768) == 0


def test_long_context_table_at_32k_gives_the_bits_once() -> None:
    # A run whose longest context is 32k gives one bits column (it was "bits/val @32k" twice), and the README's
    # tables find the 32k bits by their header wherever it stands.
    import long_context_table as lc_table

    row = lambda name, kind, kl: {"setting": name, "kind": kind, "bits": {"32768": 4.5}, "bits_32k": 4.5,  # noqa: E731
                                  "texts": {"britannica": {"32768": {"kl": kl, "ppl": 10.0, "ppl_delta_pct": 1.0}}}}
    m = {"contexts": [32768], "texts": ["britannica"], "geometry": {"attention_layers": 2, "kv_heads": 1, "head_dim": 64},
         "rows": [row("float (mlx-lm KVCache)", "float", 0.0), row("mlx-lm affine 4-bit g64 (QuantizedKVCache)", "mlx", 0.1)]}
    headers, rows = lc_table.model_table(m)
    assert headers == ["cache", "bits/val @32k", "KL Brit 32k", "ΔPPL Brit 32k"], headers
    assert rows[1] == ["mlx-lm affine 4-bit g64 (QuantizedKVCache)", "4.50", "0.100", "1.00%"], rows
    m["contexts"] = [16384, 32768]  # one row measured to 16k only: bits at 16k, and at 32k beside them
    for r in m["rows"]:
        r["bits"]["16384"] = 5.0
    del m["rows"][1]["bits"]["32768"], m["rows"][1]["texts"]["britannica"]["32768"]
    headers, rows = lc_table.model_table(m)
    assert headers[:3] == ["cache", "bits/val @16k", "bits/val @32k"] and rows[1][1:3] == ["5.00", "4.50"], (headers, rows)


def test_long_context_table_has_no_column_that_no_row_measured() -> None:
    # Runs merged at other contexts (Britannica at 8k, Novel at 8k and 16k) give columns for the cells some row
    # measured, not every text at every context: a column of dashes says nothing.
    import long_context_table as lc_table

    cell = {"kl": 0.01, "ppl": 10.0, "ppl_delta_pct": 1.0}
    rows = [{"setting": name, "kind": kind, "bits": {"8192": 6.0, "16384": 5.0}, "bits_32k": None,
             "texts": {"britannica": {"8192": cell}, "novel": {"8192": cell, "16384": cell}}}
            for name, kind in (("float (mlx-lm KVCache)", "float"), ("mlx-lm affine 4-bit g64 (QuantizedKVCache)", "mlx"))]
    m = {"contexts": [8192, 16384], "texts": ["britannica", "novel"], "rows": rows,
         "geometry": {"attention_layers": 2, "kv_heads": 1, "head_dim": 64}}
    headers, table = lc_table.model_table(m)
    kl_headers = [h for h in headers if h.startswith("KL ")]
    assert kl_headers == ["KL Brit 8k", "KL Novel 8k", "KL Novel 16k"], headers
    assert all(len(r) == len(headers) for r in table)
    del rows[1]["texts"]["novel"]["16384"]  # one row measured it: the column stays, the other row's cell is a dash
    headers, table = lc_table.model_table(m)
    assert "KL Novel 16k" in headers and table[1][headers.index("KL Novel 16k")] == "–"


def test_long_context_default_row_is_the_library_default() -> None:
    # The row labelled "the default" spells its config out; it must be what TurboQuantConfig() gives.
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc

    from tq_mlx import TurboQuantConfig

    library = TurboQuantConfig()
    assert lc.DEFAULT.config == dataclasses.replace(library, compress_block=library.compress_block_size)


def test_long_context_spec_q_weighs_the_keys_and_stored_rows_did_not() -> None:
    # `q` spells weigh_keys=True; a stored row from before the field existed measured keys without weights, so it
    # is not the default's row (the default weighs them), whatever name it was stored under.
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc

    weighed = lc.parse_setting("k4v4w768b128d6144k3v2n8rq")
    assert weighed.config.weigh_keys and "keys weighed by the queries" in weighed.name
    # (the default until 2026-11-28, before its keys widened by their error and its values stopped decaying)
    assert weighed.config == lc.DECAY_V2.config and lc.DEFAULT.config.weigh_keys
    plain = lc.parse_setting("k4v4w768b128d6144k3v2n8r")
    assert plain.config == dataclasses.replace(lc.DECAY_V2.config, weigh_keys=False) and plain == lc.DEFAULT_ROPE
    stored = {k: v for k, v in lc.DECAY_V2.config.to_dict().items() if k not in ("weigh_keys", "key_error")}
    before = lc.DEFAULT_ROPE.name[:-1] + ", the default)"  # the name the default's rows were stored under
    assert lc.canonical_name({"kind": "tq", "config": stored, "setting": before}) == lc.DEFAULT_ROPE.name
    row = {"kind": "tq", "config": weighed.config.to_dict(), "setting": weighed.name[:-1] + ", the default)"}
    assert lc.canonical_name(row) == lc.DECAY_V2.name


def test_needle_line_names_each_setting_apart_and_quotes_the_number_given() -> None:
    # Two settings whose short names agree are named in full; a miss quotes the end of the answer (the number).
    sys.path.insert(0, str(BENCH))
    import long_context as lc
    import long_context_table as lc_table

    a, b = "TQ K4/V4 (8-bit norms)", "TQ K4/V4 (8-bit norms, keys weighed by the queries)"
    probe = lambda name, depth, hit, answer: dict(setting=name, length=8192, depth=depth, hit=hit,  # noqa: E731
                                                  answer=f"The special magic number for the archive is {answer}.")
    m = {"model": "M", "needles": [probe("float (mlx-lm KVCache)", 0.5, True, "7314926"),
                                   probe(a, 0.5, False, "1661-1663"), probe(b, 0.5, True, "7314926")]}
    line = lc_table.needle_line(m)
    assert line.startswith("Needles on M (the magic number at depths 0.5 of")
    assert f"{a} 0/1 (missed: 0.5: 'he archive is 1661-1663.')" in line and f"{b} 1/1" in line
    assert "float 1/1" in line and "only" not in line
    # A length whose probes cover fewer depths than the line names says which ones it counted.
    m["needles"] += [dict(probe(b, 0.1, True, "7314926"), length=16384), probe(b, 0.1, True, "7314926")]
    line = lc_table.needle_line(m)
    assert line.startswith("Needles on M (the magic number at depths 0.1/0.5 of")
    assert "8k: float 1/1 (depth 0.5 only)" in line and f"{b} 2/2;" in line
    assert line.endswith(f"16k: {b} 1/1 (depth 0.1 only)")
    assert lc.needle_depths("0.25,0.75") == (0.25, 0.75)
    for bad in ("0,0.5", "1", "x", ""):
        with pytest.raises(SystemExit, match="strictly between 0 and 1"):
            lc.needle_depths(bad)


def test_needle_models_and_texts_must_be_known(monkeypatch) -> None:
    sys.path.insert(0, str(BENCH))
    import long_context as lc

    for argv, said in ((["--needle-models", "qwen7"], "unknown model 'qwen7'"),
                       (["--texts", "britannica,python"], "unknown text 'python': --texts takes britannica,hamlet,kjv,code"),
                       (["--models", "qwen05", "--needle-models", "qwen15"], "--needle-models qwen15 is not in --models")):
        monkeypatch.setattr(sys, "argv", ["long_context.py", *argv])
        with pytest.raises(SystemExit) as e:
            lc.main()
        assert said in str(e.value)


def test_the_chunk_divides_the_contexts_of_the_models_that_run(monkeypatch) -> None:
    sys.path.insert(0, str(BENCH))
    import long_context as lc

    monkeypatch.setattr(sys, "argv", ["long_context.py", "--models", "smollm2", "--contexts", "1000", "--chunk", "512"])
    with pytest.raises(SystemExit, match="smollm2: context 1000 is not a multiple of the chunk 512"):
        lc.main()
    # Another model's default contexts (SmolLM2's 1024, Qwen2.5-Coder-1.5B's 1024) do not refuse a 2048-token chunk.
    monkeypatch.setattr(lc.caches, "load_peer", lambda wanted: (_ for _ in ()).throw(RuntimeError("past the checks")))
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--models", "qwen05", "--qwen-contexts", "8192",
                                      "--chunk", "2048", "--needles", "", "--no-peers"])
    with pytest.raises(RuntimeError, match="past the checks"):
        lc.main()


class Stopping:
    """The model, stopped (as a session's end stops a run) after `after` chunks."""

    def __init__(self, model, after: int | None = None):
        self.model, self.after, self.calls = model, after, 0

    def __call__(self, x, cache):
        if self.after is not None and self.calls == self.after:
            raise KeyboardInterrupt
        self.calls += 1
        return self.model(x, cache=cache)


def test_a_pass_stopped_midway_resumes_from_its_checkpoint(tmp_path, monkeypatch) -> None:
    # A pass to 32k outlives a session here: stopped, the float pass and a TurboQuant pass resume where their last
    # checkpoint was, and give what an unbroken pass gives (log-probs, KL, the layers' chosen widths).
    import caches
    import long_context as lc
    from caches import Checkpoint, Setting

    from tests.support.tiny_models import VOCAB, tiny_llama
    from tq_mlx import TurboQuantConfig

    monkeypatch.setenv("TQ_MLX_CACHE", str(tmp_path))
    model, args = tiny_llama()
    monkeypatch.setattr(lc, "_MODEL_CONFIG", [{"model_type": "llama", **dataclasses.asdict(args)}])
    ids = np.random.default_rng(0).integers(0, VOCAB, 330).tolist()
    contexts, chunk, scored = [96, 320], 32, 32
    want, logps = lc.run_pass(model, model.make_cache(), ids, contexts, chunk, scored, None)

    store = lc.FloatReference("tiny", "random", ids, chunk, scored)
    monkeypatch.setattr(caches, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every chunk that scores nothing
    with pytest.raises(KeyboardInterrupt):
        lc.run_pass(Stopping(model, after=6), model.make_cache(), ids, contexts, chunk, scored, None, store=store,
                    checkpoint=Checkpoint(store.partial(320), caches.pass_code(caches.FLOAT)))
    assert store.partial(320).exists() and store.has([96]) and not store.has([320])
    assert "library" not in caches.saved_metadata(store.partial(320))  # float runs mlx-lm's code alone

    resumed = Stopping(model)
    got, _ = lc.run_pass(resumed, model.make_cache(), ids, contexts, chunk, scored, None, store=store,
                         checkpoint=Checkpoint(store.partial(320), caches.pass_code(caches.FLOAT)))
    assert resumed.calls == 320 // chunk - 6  # from its checkpoint on, not from the start
    assert not store.partial(320).exists()  # a finished pass leaves no checkpoint behind
    for c in contexts:
        assert got[c]["ppl"] == pytest.approx(want[c]["ppl"], rel=1e-5), c
        assert mx.allclose(store[c], logps[c], atol=1e-5), c

    # A TurboQuant pass (tokens compressed, decayed and widened by their error before the stop) resumes the same way
    s = Setting("tiny TQ", "tq", config=TurboQuantConfig(value_bits=3, window=64, calibration_tokens=None, compress_block=32, sinks=4,
                                                         decay_after=96, key_error=0.01))
    cache = lc.make_cache(model, s)
    want, _ = lc.run_pass(model, cache, ids, contexts, chunk, scored, store)
    widths = lc.widened_layers(cache)
    assert widths and want[320]["kl"] > 0
    path = store.partial(320, s)
    assert path != store.partial(320) and path != store.partial(320, dataclasses.replace(s, config=TurboQuantConfig()))
    with pytest.raises(KeyboardInterrupt):
        lc.run_pass(Stopping(model, after=7), lc.make_cache(model, s), ids, contexts, chunk, scored, store,
                    checkpoint=Checkpoint(path, caches.pass_code(s)))
    cache, resumed = lc.make_cache(model, s), Stopping(model)
    got, _ = lc.run_pass(resumed, cache, ids, contexts, chunk, scored, store,
                         checkpoint=Checkpoint(path, caches.pass_code(s)))
    assert resumed.calls == 320 // chunk - 7 and not path.exists() and lc.widened_layers(cache) == widths
    for c in contexts:
        assert got[c]["kl"] == pytest.approx(want[c]["kl"], rel=1e-4), c
        assert got[c]["bits_real"] == want[c]["bits_real"], c

    # A checkpoint of other tokens (another text, another tokenizer) is not this pass's
    other = lc.FloatReference("tiny", "random", ids[:200] + [(t + 1) % VOCAB for t in ids[200:]], chunk, scored)
    assert other.partial(320) != store.partial(320)


def test_a_checkpoint_made_by_other_library_code_is_not_resumed(tmp_path, monkeypatch, capsys) -> None:
    # A pass that resumes runs one library version: a TurboQuant pass's checkpoint records the fingerprint of the
    # library code that made it, and one made by other code, or before checkpoints recorded it, is not resumed (the
    # pass starts afresh, one line says why, and gives an unbroken pass's figures); the same code resumes it. The
    # float pass runs mlx-lm's KVCache alone: its checkpoints and log-probs on disk keep their names and resume
    # whatever the library.
    import caches
    import common
    import long_context as lc
    from caches import FLOAT, Checkpoint, Setting

    from tests.support.tiny_models import VOCAB, tiny_llama
    from tq_mlx import TurboQuantConfig

    monkeypatch.setenv("TQ_MLX_CACHE", str(tmp_path))
    model, args = tiny_llama()
    monkeypatch.setattr(lc, "_MODEL_CONFIG", [{"model_type": "llama", **dataclasses.asdict(args)}])
    ids = np.random.default_rng(1).integers(0, VOCAB, 170).tolist()
    contexts, chunk, scored = [64, 160], 32, 32
    store = lc.FloatReference("tiny", "random", ids, chunk, scored)
    lc.run_pass(model, model.make_cache(), ids, contexts, chunk, scored, None, store=store)
    assert store.dir == tmp_path / "logprobs" / "tiny-random-c32-e32"  # the float pass's files, named as before
    assert store.partial(160).name == f"160-{caches.digest(ids[:161])[:16]}.partial.safetensors"

    s = Setting("tiny TQ", "tq", config=TurboQuantConfig(window=32, calibration_tokens=None, compress_block=32, sinks=4, decay_after=64))
    this = common.library_fingerprint()
    assert caches.pass_code(FLOAT) is None and caches.pass_code(s) == this and len(this) == 64
    want, _ = lc.run_pass(model, lc.make_cache(model, s), ids, contexts, chunk, scored, store)
    path = store.partial(160, s)
    monkeypatch.setattr(caches, "CHECKPOINT_SECONDS", 0.0)

    def stop(code):
        with pytest.raises(KeyboardInterrupt):
            lc.run_pass(Stopping(model, after=3), lc.make_cache(model, s), ids, contexts, chunk, scored, store,
                        checkpoint=Checkpoint(path, code))
        capsys.readouterr()

    def resume(code):
        resumed = Stopping(model)
        got, _ = lc.run_pass(resumed, lc.make_cache(model, s), ids, contexts, chunk, scored, store,
                             checkpoint=Checkpoint(path, code))
        assert got == want and not path.exists(), code
        return resumed.calls, capsys.readouterr().out

    for made, said in (("0" * 64, "made by other library code (000000000000, this is " + this[:12] + ")"),
                       (None, "made by library code it does not record")):
        stop(made)
        assert caches.saved_metadata(path).get("library") == made
        calls, out = resume(this)
        assert calls == 160 // chunk and f"not resuming {path}: {said}; starting afresh" in out, made
    stop(this)
    assert caches.saved_metadata(path)["library"] == this
    calls, out = resume(this)
    assert calls == 160 // chunk - 3 and "resumed at 96 tokens" in out  # the same code: from its checkpoint on

    # the float pass's checkpoint records no library code and resumes under any
    with pytest.raises(KeyboardInterrupt):
        lc.run_pass(Stopping(model, after=3), model.make_cache(), ids, contexts, chunk, scored, None, store=store,
                    checkpoint=Checkpoint(store.partial(160), caches.pass_code(FLOAT)))
    assert "library" not in caches.saved_metadata(store.partial(160))
    resumed = Stopping(model)
    lc.run_pass(resumed, model.make_cache(), ids, contexts, chunk, scored, None, store=store,
                checkpoint=Checkpoint(store.partial(160), caches.pass_code(FLOAT)))
    assert resumed.calls == 160 // chunk - 3


def test_results_record_the_commit_and_whether_the_tree_was_dirty(tmp_path, monkeypatch, capsys) -> None:
    # Every results file's meta (common.metadata) says which code measured it: the commit, whether tracked files
    # differed from it, and the library's fingerprint. Where git cannot answer (a copy of the tree without .git)
    # the commit is None and one line says why, and the fingerprint is still there.
    import subprocess

    import common

    def git(*a):
        return subprocess.run(["git", "-C", str(common.REPO), *a], capture_output=True, text=True)

    meta = common.metadata()
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        assert meta["commit"] is None and meta["dirty"] is None
    else:
        assert meta["commit"] == head.stdout.strip()
        assert meta["dirty"] is bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
    assert meta["library"] == common.library_fingerprint()

    capsys.readouterr()
    monkeypatch.setattr(common, "REPO", tmp_path)
    monkeypatch.setattr(common, "_SAID", set())
    assert common.code_version() == common.code_version() == {"commit": None, "dirty": None,
                                                              "library": common.library_fingerprint()}
    err = capsys.readouterr().err
    assert err.count(f"no commit recorded for {tmp_path} (") == 1 and "not a git repository" in err

    # the fingerprint is of the library's sources: any of its .py files or Metal sources, nothing else
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    base = common.fingerprint(pkg, {"k": "kernel"})
    (pkg / "README.md").write_text("docs")
    assert common.fingerprint(pkg, {"k": "kernel"}) == base
    assert common.fingerprint(pkg, {"k": "kernel2"}) != base
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert common.fingerprint(pkg, {"k": "kernel"}) != base


def test_value_mix_gives_each_layer_the_value_width_asked_and_counts_its_bits() -> None:
    # value_mix.py measures value widths per layer before the cache chooses them: layer i's cache must be the one
    # of its width's setting (values decaying to V2, V3 or keeping V4, the same keys everywhere), the bits must be
    # each layer's share, and a layer list that names a layer twice or past the model is refused.
    sys.path.insert(0, str(EXPERIMENTS))
    import long_context_settings as lcs
    import value_mix as vm

    from tests.support.tiny_models import tiny_llama

    model = tiny_llama(layers=3)[0]
    widths = vm.layer_widths(3, [0], [2])
    assert widths == [4, 2, 3]
    cache = vm.mixed_cache(model, widths)
    assert [c.decay_bits for c in cache] == [(3, None), (3, 2), (3, 3)]
    assert len({c.config.key_error for c in cache}) == 1 and cache[0].config.key_error == 0.1
    mcfg = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 256, "head_dim": 64, "torch_dtype": "float16"}
    one = {w: lcs.bits_at(lcs.parse_setting(vm.BY_WIDTH[w]), mcfg, 32768) for w in (2, 3, 4)}
    assert one[2] < one[3] < one[4]
    assert vm.bits_at(mcfg, 32768, widths, cache) == pytest.approx((one[4] + one[2] + one[3]) / 3)
    for v4, v3 in (([0], [0]), ([3], [])):
        with pytest.raises(SystemExit, match="each layer once"):
            vm.layer_widths(3, v4, v3)


def held(cache: list) -> list:
    """All a cache holds, layer by layer (its class, offset and every part of its state, arrays by a hash of their
    bytes): two caches that took the same tokens the same way give equal lists."""
    import hashlib

    from mlx.utils import tree_flatten

    out = []
    for i, c in enumerate(cache):
        out += [(f"{i}.class", type(c).__name__), (f"{i}.offset", c.offset)]
        out += [(f"{i}.{k}", (v.dtype, v.shape, hashlib.sha256(np.array(v).tobytes()).hexdigest()) if isinstance(v, mx.array) else v)
                for k, v in tree_flatten(c.state)]
    return out


def test_a_needle_probe_stopped_midway_resumes_and_a_finished_one_is_read_from_disk(tmp_path, monkeypatch) -> None:
    # A needle probe at 32k outlives a session too: stopped in its prefill, the same probe resumes from its
    # checkpoint and ends with the cache an unbroken probe ends with, bit for bit (every layer's offset and state:
    # the prompt and the answer's tokens, which the tiny model's answer, spaces, cannot show); finished, it is read
    # back, not run again.
    import caches
    import quality
    from caches import FLOAT, Setting

    from tests.support.tiny_models import tiny_llama, tiny_tokenizer
    from tq_mlx import TurboQuantConfig

    model, _ = tiny_llama()
    tok = tiny_tokenizer()
    monkeypatch.setattr(caches, "CHECKPOINT_SECONDS", 0.0)
    made = []  # the probes' caches, as needle_probe builds them (a resumed one is filled in place)
    monkeypatch.setattr(quality, "make_cache", lambda _, s: made.append(caches.make_cache(model, s)) or made[-1])
    tq = Setting("tiny TQ", "tq", config=TurboQuantConfig(window=64, calibration_tokens=None, compress_block=32, sinks=4, decay_after=96,
                                                          key_error=0.01))
    for s in (FLOAT, tq):
        store = tmp_path / s.kind
        unbroken = Stopping(model)
        want = quality.needle_probe(unbroken, tok, s, 400, 0.5, 32)
        want_held = held(made[-1])
        with pytest.raises(KeyboardInterrupt):
            quality.needle_probe(Stopping(model, after=5), tok, s, 400, 0.5, 32, store=store)
        assert len(list(store.glob("*.partial.safetensors"))) == 1 and not list(store.glob("*.json"))

        resumed = Stopping(model)
        got = quality.needle_probe(resumed, tok, s, 400, 0.5, 32, store=store)
        assert resumed.calls == unbroken.calls - 5, s.kind  # from its checkpoint on, not from the start
        assert got["answer"] == want["answer"] and got["hit"] == want["hit"] and got["prompt_tokens"] > 350, s.kind
        got_held = held(made[-1])
        assert [k for k, _ in got_held] == [k for k, _ in want_held], s.kind
        for (k, a), (_, b) in zip(got_held, want_held):
            assert a == b, (s.kind, k)
        assert made[-1][0].offset == got["prompt_tokens"] - 1 + 24, s.kind  # the prompt and the answer's tokens
        assert not list(store.glob("*.partial.safetensors")) and len(list(store.glob("*.json"))) == 1

        again = Stopping(model, after=0)  # would stop at its first call
        assert quality.needle_probe(again, tok, s, 400, 0.5, 32, store=store) == {**got, "from_disk": True}
        # another depth is another probe, not this one read back
        with pytest.raises(KeyboardInterrupt):
            quality.needle_probe(again, tok, s, 400, 0.9, 32, store=store)
