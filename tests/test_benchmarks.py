"""The benchmark scripts run end to end at their --quick sizes and write sane JSON (what CI exercises).

Each script runs once per module in a subprocess, into a temporary results folder; the tests read its JSON.
memory.py asserts real TurboQuantKVCache nbytes == tq_mlx.planner.memory.estimate_kv_bytes itself (a mismatch is a
non-zero exit); the checks here repeat that from the JSON and add range checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
EXPERIMENTS = REPO / "experiments"  # the one-off probes (each puts benchmarks/ on sys.path)
TOOLS = REPO / "tools" / "docs"  # the docs generators
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"

pytestmark = pytest.mark.slow


def script_env() -> dict:
    env = dict(os.environ)
    if sys.platform.startswith("linux") and Path(OPENBLAS).exists() and "openblas" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = OPENBLAS  # the reference BLAS of the mlx-cpu wheel is ~20x slower
    return env


def run_script(name: str, out: Path, *extra: str, timeout: float = 600) -> dict:
    env = script_env()
    cmd = [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (out / f"{name}-quick.md").exists()
    print(proc.stdout[-2500:])
    return json.loads((out / f"{name}-quick.json").read_text())


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def memory(results_dir) -> dict:
    return run_script("memory", results_dir)


@pytest.fixture(scope="module")
def quality(results_dir) -> dict:
    return run_script("quality", results_dir)


@pytest.fixture(scope="module")
def long_context(results_dir) -> dict:
    return run_script("long_context", results_dir)


@pytest.fixture(scope="module")
def speed(results_dir) -> dict:
    return run_script("speed", results_dir)


def _git(*args: str) -> str | None:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return None if out.returncode else out.stdout.strip()


def _meta_ok(meta: dict) -> None:
    for k in ("date", "machine", "mlx", "mlx_lm", "backend", "library"):
        assert meta.get(k), k
    # the code that measured it: a commit of this repository (None only where git cannot answer for it), and
    # whether tracked files differed from it
    if _git("rev-parse", "HEAD") is None:
        assert meta["commit"] is None and meta["dirty"] is None
    else:
        assert meta["commit"] and _git("cat-file", "-e", f"{meta['commit']}^{{commit}}") is not None
        assert isinstance(meta["dirty"], bool)


def test_memory_real_caches_match_formula(memory: dict) -> None:
    _meta_ok(memory["meta"])
    models = {r["model"] for r in memory["rows"]}
    for name in ("Qwen3.5-35B-A3B", "Qwen3-Coder-Next", "Qwen3.5-27B", "Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-14B"):
        assert name in models
    tq_rows = [r for r in memory["rows"] if r["cache"].startswith("TurboQuant")]
    assert memory["formula_checks"] == len(tq_rows) * len(memory["contexts"]) > 0
    for r in tq_rows:
        # real caches hold what the formula gives with the key widths they chose, never more than the plan's figure
        assert r["kv_bytes_real"] == r["kv_bytes_exact"], r["model"]
        assert all(r["kv_bytes_real"][c] <= r["kv_bytes"][c] for c in r["kv_bytes"]), r["model"]
    # the default's keys widen by their error on these random keys and queries somewhere (the bound is not idle)
    assert any(r["kv_bytes_real"] != r["kv_bytes"] for r in tq_rows if r["cache"] == "TurboQuant 4-bit")
    for c in memory["mlx_checks"]:
        assert c["nbytes"] == c["formula"], c


def test_memory_figures_are_sane(memory: dict) -> None:
    by = {(r["model"], r["cache"]): r for r in memory["rows"]}
    # Hybrids count only their attention layers: Qwen3.5-35B-A3B has 10 of 40.
    assert by[("Qwen3.5-35B-A3B", "float16")]["attention_layers"] == 10
    # float16 at 1k tokens for Llama-3.1-8B: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes x 1024.
    assert by[("Llama-3.1-8B", "float16")]["kv_bytes"]["1024"] == 32 * 8 * 128 * 2 * 2 * 1024
    for r in memory["rows"]:
        kv = [r["kv_bytes"][str(c)] for c in memory["contexts"]]
        assert kv == sorted(kv) and kv[0] > 0
        assert math.isfinite(r["ratio_vs_fp16"]) and 0.9 < r["ratio_vs_fp16"] < 8
        assert all(v is None or v in memory["mac_gb"] for v in r["smallest_mac_gb"].values())
    for model in {r["model"] for r in memory["rows"]}:
        bits = [by[(model, f"TurboQuant {b}-bit")]["bits_per_value"] for b in (4, 3.5, 3, 2.5)]
        assert bits == sorted(bits, reverse=True)


def test_quality_quick(quality: dict) -> None:
    _meta_ok(quality["meta"])
    rows = {r["setting"]: r for r in quality["models"]["smollm2"]["rows"]}
    base = rows["float (mlx-lm KVCache)"]
    assert 10 < base["ppl"] < 25 and base["attn_cos"] > 0.9999 and base["top1"] == 1.0
    for name, r in rows.items():
        if r["kind"] == "peer" and not quality["peers"]["mlx-vlm"]["runs"]:
            assert r["error"]
            continue
        assert "error" not in r, (name, r.get("error"))
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
        assert 0 < r["bits_measured"] < 64
        assert 0 <= r["top1"] <= 1 and 0 <= r["top5"] <= 1 and -1 <= r["attn_cos"] <= 1.0001
        if r["kind"] == "tq":
            assert 2 < r["bits_32k"] < 5, (name, r["bits_32k"])
    tq4 = rows["TQ K4/V4"]
    assert tq4["ppl_delta_pct"] < 5 and tq4["attn_cos"] > 0.98
    needles = quality["models"]["smollm2"]["needle"]
    assert needles and all("hit" in n for n in needles)


def test_long_context_quick(long_context: dict) -> None:
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc

    _meta_ok(long_context["meta"])
    m = long_context["models"]["smollm2"]
    assert m["contexts"] == [1024, 1152] and set(m["texts"]) == {"britannica", "hamlet"}
    rows = {r["setting"]: r for r in m["rows"]}
    for name, r in rows.items():
        for text in m["texts"]:
            cell = r["texts"][text]
            assert "error" not in cell, (name, text, cell.get("error"))
            for c in m["contexts"]:
                x = cell[str(c)]
                assert math.isfinite(x["ppl"]) and x["ppl"] > 1 and math.isfinite(x["kl"]) and x["kl"] > -1e-4
                if r["kind"] == "float":
                    assert x["kl"] == 0 and x["ppl_delta_pct"] == 0
                else:
                    assert x["kl"] < 1, (name, text, c, x)
                    assert x["kl"] <= x["kl_max"] < 512 * x["kl"] + 1e-6, (name, text, c, x)  # one token of the mean
                    if r["kind"] != "peer" or "ppl_delta_pct_se" in x:
                        assert 0 < x["ppl_delta_pct_se"] < 50, (name, text, c, x)
        if r["kind"] != "peer":
            assert 0 < r["bits"]["1152"] <= 17 and 2 < r["bits_32k"] <= 16, (name, r["bits"], r["bits_32k"])
    default = rows[lc.DEFAULT.name]
    # The default's calibration tokens (768, in float until its first compression) are most of these contexts: a
    # small loss, a fraction of the previous default's.
    previous = rows["TQ K4/V3 (window 128, block 128, the previous default)"]
    for text in m["texts"]:
        assert 0 < default["texts"][text]["1152"]["kl"] < previous["texts"][text]["1152"]["kl"] / 2
    # head_dim 64 at 32k: K4/V4 codes with 8-bit norms at every age and the 128-token float16 window: 4.19
    # bits/value before any layer's keys take other widths by their error (the † figures add what the layers chose;
    # the default until 2026-12-06, K4/V3: 3.69)
    assert 4.15 < default["bits_32k"] < 4.25
    rot = rows["rotation + affine 4-bit g64 (window 768, sinks 4)"]
    assert 4.5 < rot["bits_32k"] < 5
    assert rows["float (mlx-lm KVCache)"]["bits_32k"] == 16
    # SmolLM2's keys never protect themselves; the run says so per text, and the bits stand as computed
    assert all(r["texts"][t]["protected_layers"] == [] for r in rows.values() if r["kind"] == "tq" for t in m["texts"])


def test_long_context_scores_at_most_a_chunk(tmp_path: Path) -> None:
    # --eval-tokens scores fewer tokens than the chunk feeds (mlx-lm's 2048-token prefill, its last 512 scored);
    # more than a chunk would score a chunk cut in two: refused with what it takes, before any model loads
    proc = subprocess.run([sys.executable, str(BENCH / "long_context.py"), "--chunk", "512", "--eval-tokens", "1024",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--eval-tokens 1024: from 1 to the chunk (512)" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_long_context_merge_joins_a_longer_run(long_context: dict, tmp_path: Path) -> None:
    # A second run of some rows to a longer context: the merged table has the new column for those rows, keeps
    # every earlier cell as it was, and prices bits at the longest context every measured row reached.
    sys.path.insert(0, str(BENCH))
    import long_context_table as lc_table

    longer = json.loads(json.dumps(long_context))
    m = longer["models"]["smollm2"]
    m["contexts"] = [1024, 1152, 2048]
    m["rows"] = [r for r in m["rows"] if r["kind"] in ("float", "tq")][:2]
    for r in m["rows"]:
        r["bits"]["2048"] = r["bits"]["1152"] / 2
        for cell in r["texts"].values():
            cell["1024"] = dict(cell["1024"], kl=123.0)  # must not replace the earlier run's cell
            cell["1152"] = dict(cell["1152"], recorded_later=1.5)  # the same pass again, recording more: added
            cell["2048"] = dict(cell["1152"], kl=cell["1152"]["kl"] + 0.5)
    paths = []
    for i, run in enumerate((long_context, longer)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    lc_table.merge([str(x) for x in paths], str(tmp_path / "merged"))
    merged = json.loads((tmp_path / "merged" / "long_context.json").read_text())["models"]["smollm2"]
    assert merged["contexts"] == [1024, 1152, 2048]
    before = {r["setting"]: r for r in long_context["models"]["smollm2"]["rows"]}
    for r in merged["rows"]:
        for text, cell in r["texts"].items():
            assert cell["1024"] == before[r["setting"]]["texts"][text]["1024"]
            again = r["setting"] in {x["setting"] for x in m["rows"]}
            assert cell["1152"] == dict(before[r["setting"]]["texts"][text]["1152"], **({"recorded_later": 1.5} if again else {}))
            assert ("2048" in cell) == again
    headers, rows = lc_table.model_table(merged)
    assert headers[1] == "bits/val @1152" and "KL Brit 2k" in headers
    assert sum(row[headers.index("KL Brit 2k")] != "–" for row in rows) == 2
    # a run of other rows at a context no earlier row reached: no context in common, so bits at one the
    # default reached (not the new run's), the one most rows reached
    other = json.loads(json.dumps(longer))
    o = other["models"]["smollm2"]
    o["contexts"], o["rows"] = [4096], [r for r in o["rows"] if r["kind"] == "float"]
    for r in o["rows"]:
        r["setting"] += " (again)"
        r["bits"] = {"4096": 16.0}
        r["texts"] = {t: {"4096": dict(c["1152"])} for t, c in r["texts"].items()}
    paths.append(tmp_path / "run2.json")
    paths[-1].write_text(json.dumps(other))
    lc_table.merge([str(x) for x in paths], str(tmp_path / "merged2"))
    merged = json.loads((tmp_path / "merged2" / "long_context.json").read_text())["models"]["smollm2"]
    assert merged["contexts"] == [1024, 1152, 2048, 4096]
    headers, _ = lc_table.model_table(merged)
    assert headers[1] == "bits/val @1152" and "KL Brit 4k" in headers
    # a peer one run skipped and another ran: the merged file says it ran, with the version that ran
    skipped, ran = {"version": None, "runs": False, "reason": "skipped (--no-peers)"}, {"version": "0.1", "runs": True, "reason": None}
    for i, (a, b) in enumerate(((skipped, ran), (ran, skipped))):
        for path, p in zip(paths[:2], (a, b)):
            path.write_text(json.dumps(dict(json.loads(path.read_text()), peers={"some-peer": p})))
        lc_table.merge([str(x) for x in paths[:2]], str(tmp_path / f"peers{i}"))
        again = json.loads((tmp_path / f"peers{i}" / "long_context.json").read_text())
        assert again["peers"] == {"some-peer": ran}
        assert len(again["meta"]["runs"]) == 1  # the two runs' meta are one run's (a copy): counted once


def test_long_context_merge_keeps_each_runs_peer_bytes(long_context: dict, tmp_path: Path) -> None:
    # mlx-vlm's cache has no plan to price it: its bits are the bytes each run held, per context. A second run at
    # a longer context adds its own beside the first run's, or the pictures and tables lose its point there.
    sys.path.insert(0, str(BENCH))
    import long_context_table as lc_table

    paths = []
    for ctx, bits in (("1024", 5.1), ("2048", 5.2)):
        run = json.loads(json.dumps(long_context))
        m = run["models"]["smollm2"]
        floats = next(r for r in m["rows"] if r["kind"] == "float")
        name = "peer: mlx-vlm TurboQuant 4-bit"
        peer = {"setting": name, "name": name, "kind": "peer", "bits": {ctx: None}, "bits_32k": None,
                "bits_measured_peer": {ctx: bits},
                "texts": {t: {ctx: dict(c["1024"], kl=0.5, bits_real=bits)} for t, c in floats["texts"].items()}}
        m["rows"] = [r for r in m["rows"] if r["kind"] != "peer"] + [peer]
        paths.append(tmp_path / f"run{ctx}.json")
        paths[-1].write_text(json.dumps(run))
    lc_table.merge([str(x) for x in paths], str(tmp_path / "merged"))
    merged = json.loads((tmp_path / "merged" / "long_context.json").read_text())["models"]["smollm2"]
    row = next(r for r in merged["rows"] if r["kind"] == "peer")
    assert row["bits_measured_peer"] == {"1024": 5.1, "2048": 5.2}
    assert all(set(cell) == {"1024", "2048"} for cell in row["texts"].values())


def test_speed_quick(speed: dict) -> None:
    _meta_ok(speed["meta"])
    (model,) = speed["models"]
    assert model["contexts"]
    for ctx, rows in model["contexts"].items():
        base = rows["float (mlx-lm KVCache)"]
        assert base["decode_ratio"] == 1.0 and base["prefill_ratio"] == 1.0
        for name, r in rows.items():
            if "error" in r:
                continue
            for k in ("decode_tok_s", "prefill_tok_s", "decode_ratio", "prefill_ratio"):
                assert r[k] is not None and math.isfinite(r[k]) and r[k] > 0, (ctx, name, k)


@pytest.fixture(scope="module")
def paths(results_dir) -> dict:
    return run_script("paths", results_dir)


def test_paths_quick_measures_the_default_on_each_path(paths: dict) -> None:
    # paths.py times one layer's decode step on every fetch path, TurboQuantConfig() as it is (the script asserts
    # that the keys it times on the codes are weighed and centered before RoPE), the float cache of each layer
    # shape as the base.
    from tq_mlx import TurboQuantConfig

    _meta_ok(paths["meta"])
    assert paths["config"] == TurboQuantConfig().to_dict()
    contexts = paths["meta"]["contexts"]
    expected = {("GQA", p) for p in ("mlx-lm float cache", "on the codes", "decode-to-float")} | {
        ("MLA", p) for p in ("mlx-lm float cache", "latent on the codes", "decode-to-float")}
    assert sorted((r["layer"], r["path"], r["context"]) for r in paths["rows"]) == sorted(
        (layer, p, c) for layer, p in expected for c in contexts)
    for r in paths["rows"]:
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["vs_float"] > 0, r
        shape = paths["meta"]["gqa" if r["layer"] == "GQA" else "mla"]
        float_bytes = 2 * r["context"] * shape["kv_heads"] * shape["dim"] * 4
        assert r["transient_bytes"] == (float_bytes if r["path"] == "decode-to-float" else 0), r
        if r["path"] == "mlx-lm float cache":
            assert r["vs_float"] == 1.0


def _tables_cmd(results_dir: Path, tmp_path: Path) -> tuple[list[str], Path, Path]:
    """readme_tables.py on the --quick results, into a docs/benchmarks.md and a README.md of tmp_path's own."""
    (tmp_path / "docs").mkdir(exist_ok=True)
    docs, readme = tmp_path / "docs" / "benchmarks.md", tmp_path / "README.md"
    docs.write_text("# x\n\n<!-- benchmark-results:start -->\nOLD-SECTION-PLACEHOLDER\n<!-- benchmark-results:end -->\n\ntail\n")
    readme.write_text("# r\n\n<!-- headline-results:start -->\nOLD-HEADLINE\n<!-- headline-results:end -->\n\nmiddle\n\n"
                      "<!-- path-results:start -->\nOLD-PATHS\n<!-- path-results:end -->\n\nend\n")
    cmd = [sys.executable, str(TOOLS / "readme_tables.py"), "--docs", str(docs), "--readme", str(readme), "--results",
           str(results_dir), "--suffix=-quick", "--write"]
    return cmd, docs, readme


def test_readme_tables_render(memory: dict, quality: dict, long_context: dict, speed: dict, paths: dict,
                              results_dir: Path, tmp_path: Path) -> None:
    cmd, docs, readme = _tables_cmd(results_dir, tmp_path)
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    text = docs.read_text()
    assert "### Memory" in text and "### Quality" in text and "### Speed" in text and "OLD-SECTION-PLACEHOLDER" not in text
    assert "#### Quality at long context" in text and "rotation + affine" in text
    assert text.endswith("<!-- benchmark-results:end -->\n\ntail\n")
    # The README's headline: one small table per area, linking into the full tables
    head = readme.read_text()
    assert "OLD-HEADLINE" not in head and "OLD-PATHS" not in head and "<!-- headline-results:end -->\n\nmiddle\n" in head
    assert head.endswith("<!-- path-results:end -->\n\nend\n")
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lc
    import speed as sp

    for part in ("### Memory", "### Quality at long context", "### Speed", f"| {lc.DEFAULT.name} |",
                 f"| {sp.preset('default').name} |",
                 "(docs/benchmarks.md#memory)", "(docs/benchmarks.md#quality-at-long-context)", "(docs/benchmarks.md#speed)"):
        assert part in head, part
    # The per-path table: each path's ratios from paths-quick.json, the contexts it measured in the header
    ratio = {(r["layer"], r["path"], r["context"]): r["vs_float"] for r in paths["rows"]}
    contexts = paths["meta"]["contexts"]
    codes = " / ".join(f"{ratio['GQA', 'on the codes', c]:.2f}x" for c in contexts)
    latent = " / ".join(f"{ratio['MLA', 'latent on the codes', c]:.2f}x" for c in contexts)
    assert f"| {codes} the time, no float transient |" in head and f"decode on the codes: {latent};" in head
    assert f"float cache, {' / '.join(f'{c // 1024}k' for c in contexts)} tokens |" in head
    assert "(benchmarks/results/paths-quick.json)" not in head and "paths-quick.json)" in head
    check = subprocess.run([*cmd[:-1], "--check"], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # a hand-edited number in the per-path table fails the check, as in any generated table
    readme.write_text(head.replace(f"| {codes} the time", "| 0.50x / 0.50x the time"))
    check = subprocess.run([*cmd[:-1], "--check"], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 1 and "README.md: generated results are out of date (after <!-- path-results" in check.stderr
    readme.write_text(head)
    docs.write_text(docs.read_text().replace("rotation + affine", "rotation and affine"))
    check = subprocess.run([*cmd[:-1], "--check"], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 1 and "benchmarks.md: generated results are out of date" in check.stderr


def test_peak_quick_planner_tracks_the_measured_peak(results_dir: Path) -> None:
    # A real SmolLM2 prefill + decode per cache, in fresh processes, against tq_mlx.planner.memory.estimate_peak_bytes.
    rows = run_script("peak", results_dir)["rows"]
    assert {r["cache"] for r in rows} == {"float", "tq"}
    for r in rows:
        assert r["peak"] >= r["weights"] + r["kv"]  # the peak holds at least what stays
        assert abs(r["error"]) < 0.1, r  # the planner within 10% of the measured peak


def test_mac_check_dry_run_writes_the_report_schema(tmp_path: Path) -> None:
    # mac_check.py needs Metal; --dry-run runs the same code at tiny sizes on the CPU, kernels on the emulator
    # (when it can compile), and writes the JSON a Mac user attaches to an issue, with the same schema.
    from tests.emulator import find_compiler

    emulated = find_compiler() is not None
    proc = subprocess.run([sys.executable, str(BENCH / "mac_check.py"), "--dry-run", "--out-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DRY RUN" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mac_check-dry-run.json", "mac_check-dry-run.md"]

    def no_nan(c):
        raise AssertionError(f"{c} in the JSON: not strict JSON")

    r = json.loads((tmp_path / "mac_check-dry-run.json").read_text(), parse_constant=no_nan)
    assert r["schema"] == "tq-mlx mac_check 3" and r["dry_run"] is True
    assert r["kernel_runner"] == ("emulator (CPU)" if emulated else "none")
    import mlx.core as mx
    import mlx_lm

    m = r["machine"]
    assert {"chip", "macos", "os", "mlx", "mlx_lm", "tq_mlx", "python", "metal_available",
            "metal_device_info"} <= set(m)
    assert m["mlx"] == mx.__version__ and m["mlx_lm"] == mlx_lm.__version__ and m["metal_available"] is False
    assert m["chip"] and r["meta"]["date"]

    kernels = {c["kernel"].split()[0] for c in r["checks"]}
    assert kernels == {"rotate", "rotate-inverse", "encode", "encode-corrected", "dequantize", "recode", "decode",
                       "prefill"}
    for c in r["checks"]:
        assert {"kernel", "dim", "bits", "dtype", "max_abs_err", "ok", "reason", "seconds"} == set(c)
        # A launcher that does not take a case says so: only the WHT ones (rotate, dequantize, QJL encode) at
        # head_dim 96 (no power of two), and dequantize at fractional bits (channel groups)
        reference = (c["reason"] or "").startswith("reference path: ")
        wht_only = (c["kernel"] in ("rotate", "rotate-inverse", "dequantize")
                    or c["kernel"].startswith("encode") and "qjl" in c["bits"])
        assert reference == (wht_only and c["dim"] == 96 or c["kernel"] == "dequantize" and c["bits"] == "3.5"), c
        assert c["ok"] is (True if emulated and not reference else None), c
    assert {(c["dim"], c["bits"]) for c in r["checks"] if c["kernel"].startswith("decode") and c["ok"] is not False} \
        == {(d, b) for d in (64, 96) for b in ("4", "3+qjl", "3.5", "3tc")}
    if emulated:  # every kernel's variants went through its self-check, and passed
        assert {s["kernel"] for s in r["self_checks"]} == {"rotate", "encode", "recode", "dequantize", "decode_attention",
                                                          "prefill_attention"}
        assert all(s["passed"] and s["reason"] is None and s["variant"] for s in r["self_checks"])
    assert r["summary"] == dict(checks=len(r["checks"]), checks_failed=0, self_checks=len(r["self_checks"]),
                                self_checks_failed=0)

    s = r["settings"]
    for kind, tokens in (("decode", 1), ("prefill", s["chunk"])):
        rows = r[kind]
        assert [row["context"] for row in rows] == s["contexts"] * 2  # K4/V3, then K4/V3 with trellis codes
        assert [row["trellis"] for row in rows] == [False] * len(s["contexts"]) + [True] * len(s["contexts"])
        assert kind == "decode" or tokens > 8  # a prefill chunk takes prefill_attention, not the decode kernels
        for row in rows:
            assert set(row) == {"shape", "q_heads", "kv_heads", "head_dim", "key_bits", "value_bits", "trellis", "context",
                                "query_tokens", "fused_ms", "sdpa_fp16_ms", "reference_ms", "speedup_vs_sdpa",
                                "fused_peak_bytes", "sdpa_peak_bytes", "reference_peak_bytes", "cache_bytes",
                                "fp16_cache_bytes", "error"}
            assert row["query_tokens"] == tokens and row["sdpa_fp16_ms"] > 0 and row["reference_ms"] > 0
            assert row["cache_bytes"] < row["fp16_cache_bytes"]  # the compressed cache is smaller
            assert isinstance(row["sdpa_peak_bytes"], int) and row["reference_peak_bytes"] > 0
            if emulated:
                assert row["error"] is None and row["fused_ms"] > 0 and isinstance(row["fused_peak_bytes"], int)
                assert row["speedup_vs_sdpa"] == pytest.approx(row["sdpa_fp16_ms"] / row["fused_ms"])
            else:
                assert row["fused_ms"] is None and "skipped" in row["error"]


def test_serve_quick_load_test_against_mlx_lm_server(results_dir: Path, tmp_path: Path) -> None:
    # tq-server and mlx_lm.server on SmolLM2, one after the other on free localhost ports: every request answered,
    # the batches' KV bytes measured inside each server, and docs/benchmarks.md renders the table from the JSON.
    res = run_script("serve", results_dir, timeout=300)
    _meta_ok(res["meta"])
    assert res["settings"]["clients"] == [1, 2] and min(res["settings"]["prompt_tokens"]) > 16 + 4
    rows = {(r["server"], r["n"]): r for r in res["rows"]}
    assert set(rows) == {(s, n) for s in ("tq", "float") for n in ("sequential", 1, 2)}
    for (server, n), r in rows.items():
        assert r["answered"] == r["requests"] and r["tokens"] > 0, r
        assert math.isfinite(r["tok_s"]) and r["tok_s"] > 0 and r["vs_sequential"] > 0
        assert 1 <= r["max_rows"] <= r["requests"] and r["kv_peak"] > 0
        if n == "sequential":
            assert r["max_rows"] == 1 and r["equal"] is None
        else:
            assert 0 <= r["equal"] <= n
        if server == "tq":  # the compressed cache holds less than mlx-lm's float32 one
            assert r["kv_peak"] < rows[("float", n)]["kv_peak"], (n, r["kv_peak"], rows[("float", n)]["kv_peak"])
    cmd, docs, _ = _tables_cmd(results_dir, tmp_path)
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    text = docs.read_text()
    assert "### Serving: concurrent clients" in text and "| 2 | tq-server |" in text and "benchmarks/serve.py" in text


def test_key_error_models_rope_as_mlx_does_and_its_rope_centering_removes_a_rotating_bias() -> None:
    # key_error.py's "rope" centering stands for a cache that subtracts RoPE_p(μ0): its RoPE must be mlx's
    # (non-traditional) one, and a key that is a constant before RoPE plus noise must center to the noise.
    sys.path.insert(0, str(EXPERIMENTS))
    import key_error as ke

    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 2, 512, 64)).astype(np.float32))
    want = mx.fast.rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=0)
    assert mx.allclose(ke.rope_rotate(x, 1e4), want, atol=1e-4)
    assert mx.allclose(ke.rope_rotate(ke.rope_rotate(x, 1e4), 1e4, inverse=True), x, atol=1e-4)
    bias = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)) * 10
    k = ke.rope_rotate(bias + 0.1 * x, 1e4)
    calib = slice(4, 260)
    residual = {how: float(mx.mean(mx.linalg.norm(k - ke.centered_means(k, how, calib, 1e4), axis=-1)))
                for how in ke.CENTERINGS}
    noise = float(mx.mean(mx.linalg.norm(0.1 * x, axis=-1)))
    assert residual["rope"] < 1.1 * noise < residual["block"] < residual["global"], residual


def test_score_bias_shifts_only_the_coded_tokens_and_moves_their_mass_with_the_sign() -> None:
    # score_bias.py: a > 0 adds a·σ² to the coded tokens' scores (more mass on them), a < 0 takes it away; the
    # float sinks and window are never shifted, and 8-bit codes with no shift give nearly float attention.
    sys.path.insert(0, str(EXPERIMENTS))
    import score_bias as sb

    rng = np.random.default_rng(2)
    n = 1100  # sinks 4 + coded 328 + window 768, the last 256 queries
    q, k, v = (mx.array(rng.standard_normal((1, h, n, 64)).astype(np.float32)) for h in (4, 2, 2))
    r = sb.layer_row(q * 3, k, v, 0.125, 1e4, [3, 8], [0.5, 0.0, -0.5])
    for b in (3, 8):
        assert r[f"mass_{b}_0.5"] > r[f"mass_{b}_0"] > r[f"mass_{b}_-0.5"], r
        assert r[f"kl_{b}_0"] >= 0 and r[f"sigma_{b}"] > 0
    assert r["sigma_3"] > 4 * r["sigma_8"]
    assert r["err_8_0"] < 0.01 < r["err_3_0"] and abs(r["mass_8_0"] - r["mass_float"]) < 1e-3, r


def test_key_error_matrix_weights_are_the_channel_weights_when_moments_are_diagonal() -> None:
    # key_error.py's "matrix" mode is the full-matrix form of the cache's weights: on diagonal second moments it
    # must give w = (E q² / E k²)^(1/8) with geometric mean 1, as tq_mlx.stream.calibration.query_weights does before its clip.
    sys.path.insert(0, str(EXPERIMENTS))
    import key_error as ke

    rng = np.random.default_rng(1)
    q2, k2 = rng.uniform(0.1, 10, 16), rng.uniform(0.1, 10, 16)
    w = (q2 / k2) ** 0.125
    a = ke.matrix_weights(np.diag(q2), np.diag(k2))
    assert np.allclose(a, np.diag(w / np.exp(np.mean(np.log(w)))), atol=1e-6)
    x = rng.standard_normal((64, 16)) @ rng.standard_normal((16, 16))
    y = rng.standard_normal((64, 16)) @ rng.standard_normal((16, 16))
    a = ke.matrix_weights(x.T @ x / 64, y.T @ y / 64)
    assert np.allclose(a, a.T, atol=1e-6) and math.isclose(np.linalg.det(a), 1.0, rel_tol=1e-4)


def test_key_error_allocated_codes_are_turboquant_groups_with_the_bits_where_the_energy_is() -> None:
    # key_error.py's "allocated" mode says what bit allocation would add: each group must be TurboQuant_mse
    # itself, and the extra bit must go to the pairs that hold the energy, so that it beats one even code there.
    sys.path.insert(0, str(EXPERIMENTS))
    import key_error as ke

    from tq_mlx.quant.codebook import lloyd_max
    from tq_mlx.quant.quantizer import TurboQuantMSE

    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((300, 64)).astype(np.float32))
    q = TurboQuantMSE(64, 4, seed=3)
    assert mx.allclose(ke.group_code(x, 4, seed=3), q.dequantize(q.quantize(x)), atol=1e-5)
    # energy in pairs 0..7 (channels 0..7 and 32..39): those must land in the 5-bit group
    scale = np.ones(64, np.float32)
    scale[[*range(8), *range(32, 40)]] = 8.0
    k = mx.array(rng.standard_normal((1, 2, 300, 64)).astype(np.float32) * scale)
    coded = ke.allocated(k, slice(0, 256), 4)
    top = mx.array([*range(8), *range(32, 40)])
    err = mx.take(k - coded, top, axis=-1)
    ratio = float(mx.sum(err * err) / mx.sum(mx.take(k, top, axis=-1) ** 2))
    assert ratio < 0.6 * lloyd_max(16, 4).mse, ratio  # 5-bit codes' error, not 4-bit ones'
    even = TurboQuantMSE(64, 4, seed=1)
    even_err = float(mx.sum((k - even.dequantize(even.quantize(k))) ** 2))
    assert float(mx.sum((k - coded) ** 2)) < 0.7 * even_err


def test_attention_mass_measures_the_coded_share_and_finds_a_heavy_hitter() -> None:
    # attention_mass.py decides whether float "heavy hitter" tokens could pay: its shares must be the softmax's.
    sys.path.insert(0, str(EXPERIMENTS))
    import attention_mass as am

    H, Hq, T, L, D, lo, hi = 2, 4, 300, 16, 8, 4, 200
    q = mx.random.normal((1, Hq, L, D), key=mx.random.key(0)) + 1.0
    uniform = am.coded_mass(q, mx.zeros((1, H, T, D)), 1.0, lo, hi)  # every causal token weighs the same
    positions = np.arange(T - L, T)
    assert math.isclose(uniform["coded"], float(np.mean((hi - lo) / (positions + 1))), rel_tol=1e-5)
    assert math.isclose(uniform["top32"], 32 / (hi - lo), rel_tol=1e-4)
    assert math.isclose(uniform["top128"], 128 / (hi - lo), rel_tol=1e-4)
    assert math.isclose(uniform["per_query_top32"], 32 / (hi - lo), rel_tol=1e-4)
    k = mx.zeros((1, H, T, D))
    k[:, :, 50] = 2.0  # one coded token every query leans on (scores about 16 against 0)
    heavy = am.coded_mass(q, k, 1.0, lo, hi)
    assert heavy["coded"] > uniform["coded"] and heavy["top32"] > 0.8 > uniform["top32"], heavy


def test_attribution_splits_a_layer_error_by_side_and_by_age() -> None:
    # attribution.py says which side and which tokens a layer's error comes from: "all" must be what the cache
    # attends, a part with no tokens must cost nothing, and each part must be the error of its own tokens.
    sys.path.insert(0, str(EXPERIMENTS))
    import attribution as at

    from tq_mlx import TurboQuantConfig, TurboQuantKVCache, turboquant_attention

    H, Hq, T, L, D = 2, 4, 400, 24, 64
    rng = np.random.default_rng(0)
    kf = mx.array(rng.normal(size=(1, H, T, D)) + rng.normal(size=(1, H, 1, D)), dtype=mx.float32)
    vf = mx.array(rng.normal(size=(1, H, T, D)), dtype=mx.float32)
    q = mx.array(rng.normal(size=(1, Hq, L, D)), dtype=mx.float32)
    # (prefill not read as decode: attribution splits the error of what the cache holds, which every query reads)
    config = TurboQuantConfig(window=64, calibration_tokens=None, compress_block=32, sinks=4, decay_after=160, decay_key_bits=3,
                             decay_value_bits=None, prefill_as_decode=False)
    cache = TurboQuantKVCache(config, layer_index=2, head_dim=D)  # values keep their bits: none decay
    cache.update_and_fetch(kf[:, :, : T - L], vf[:, :, : T - L])
    keys, values = cache.update_and_fetch(kf[:, :, T - L:], vf[:, :, T - L:])
    assert keys.n_decayed > 0 and values.n_decayed == 0
    actual = turboquant_attention(q, keys, values, scale=0.125, mask="causal")
    e = at.layer_errors(q, keys, values, kf, vf, 0.125, actual)
    assert abs(e["all"][0] - e["actual"][0]) < 1e-3 * e["all"][0] + 1e-6, e
    assert e["values decayed"] == (0.0, [0.0, 0.0]) and e["values fresh"][0] == e["values"][0]
    assert e["keys decayed"][0] > 0 and e["keys fresh"][0] > 0 and e["keys"][0] > max(e["keys fresh"][0], 0.5 * e["keys decayed"][0])
    # fewer bits, more error per token: the 3-bit decayed keys' part is above its share of the tokens
    assert e["keys decayed"][0] / keys.n_decayed > e["keys fresh"][0] / keys.n_fresh
    assert len(e["all"][1]) == H and all(x > 0 for x in e["all"][1])
    with pytest.raises(RuntimeError, match="dropped tokens"):
        at.layer_errors(q, keys, values, kf[:, :, 1:], vf[:, :, 1:], 0.125, actual)


def test_value_widths_forecasts_what_real_codes_give_old_values() -> None:
    # value_widths.py measures from the window what coding old values at b bits does to the attention output, and
    # forecasts it without codes: on values whose errors are independent (no common part) the forecast must be what
    # real codes give; values sharing a large mean keep it in every output (less error) while their errors
    # correlate (codes err more than the forecast); widths must follow the target.
    sys.path.insert(0, str(EXPERIMENTS))
    import value_widths as vw

    from tq_mlx.quant.codebook import lloyd_max

    H, Hq, N, D = 2, 4, 600, 64
    rng = np.random.default_rng(0)
    k = mx.array(rng.normal(size=(1, H, N, D)), dtype=mx.float32)
    shared = np.array([3.0, 0.0])[None, :, None, None] * rng.normal(size=(1, 1, 1, D))  # head 0's values share it
    v = mx.array(rng.normal(size=(1, H, N, D)) + shared, dtype=mx.float32)
    q = mx.array(rng.normal(size=(1, Hq, N, D)), dtype=mx.float32)
    p, o = vw.attention(q, k, v, 0.125, slice(N - 128, N))
    assert p.shape == (1, H, 2 * 128, N) and mx.allclose(mx.sum(p, axis=-1), mx.array(1.0), atol=1e-5).item()
    old = slice(4, N - 256)
    unit = vw.output_error(p, o, v, old)[0]
    errors = {}
    for b in (2, 3, 4):
        errors[b] = vw.coded_error(p, o, v, old, b)[0]
        forecast = unit * math.sqrt(lloyd_max(D, b).mse)
        assert abs(forecast[1] / errors[b][1] - 1) < 0.2, (b, forecast, errors[b])
        assert forecast[0] < errors[b][0] < errors[b][1], (b, forecast, errors[b])
    assert errors[2][1] > errors[3][1] > errors[4][1]
    one = {b: float(e[1]) for b, e in errors.items()}
    assert vw.value_width(one, 4, 1.0) == 2 and vw.value_width(one, 4, 1e-9) == 4
    assert vw.value_width(one, 4, (one[2] + one[3]) / 2) == 3
    assert vw.correlation([1, 2, 3, 4], [2, 4, 6, 9])[1] == pytest.approx(1.0)


def test_trellis_codes_probe_codes_below_lloyd_max_and_refuses_a_context_before_calibration(tmp_path) -> None:
    # the probe on SmolLM2 (two layers; tests/test_trellis.py tests the codes): on random unit vectors trellis codes must err
    # less than the cache's Lloyd-Max codes at 3 and 4 bits (and more than the bound); each side's figures per layer;
    # a context the default's key streams have not calibrated in is refused, saying why
    env, out = script_env(), tmp_path / "trellis"
    base = [sys.executable, str(EXPERIMENTS / "trellis_codes.py"), "--models", "smollm2"]
    bad = subprocess.run([*base, "--context", "700"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--context must be at least 773 (the default's key streams" in bad.stderr, \
        bad.stderr[-2000:]
    proc = subprocess.run([*base, "--context", "800", "--layer-step", "15", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "trellis_codes.json").read_text())
    for b, m in results["sphere"].items():
        assert m["bound"] < m["trellis"] < m["lloyd_max"], (b, m)
    summary = results["models"]["smollm2"]["summary"]
    assert set(summary) == {"values", "keys"} and results["models"]["smollm2"]["layers"] == 2  # layers 0 and 15
    for side in summary.values():
        assert set(side) == {"3", "4"}
        for m in side.values():
            assert all(m[c]["median"] > 0 and m[c]["mse"] > 0 for c in ("lloyd_max", "lloyd_max_half", "trellis"))
            assert m["lloyd_max"]["mse"] > m["lloyd_max_half"]["mse"] and 0 <= m["layers_trellis_below_half"] <= 2


def test_tqplus_keeps_one_fork_commit_and_says_when_each_cell_was_measured(tmp_path: Path, monkeypatch) -> None:
    # cells of several runs share one file and its header is the last run's: each cell carries its own run and the
    # table's notes say which run measured which cell; a run at another fork commit is refused, not mixed in
    monkeypatch.syspath_prepend(str(BENCH))
    import tqplus

    def run(date):
        return {"date": date, "commit": "abc1234", "command": "tqplus.py ..."}

    results = {"cells": {"8192": {"f16": {"bits": 16.0, "measured": run("2026-12-03 04:00 UTC")},
                                  "q8_0/q8_0": {"bits": 8.5, "kl": 0.01, "ppl_delta_pct": 0.3,
                                                "measured": run("2026-12-02 06:32 UTC")}}},
               "meta": {"threads": 2}, "fork": {"repository": "r", "commit": "1" * 40}}
    tqplus.same_fork(results, {"commit": "1" * 40}, tmp_path / "tqplus.json")
    with pytest.raises(SystemExit, match="one table is one commit"):
        tqplus.same_fork(results, {"commit": "2" * 40}, tmp_path / "tqplus.json")
    tqplus.same_fork({"cells": {}, "fork": {"commit": "1" * 40}}, {"commit": "2" * 40}, tmp_path / "tqplus.json")
    monkeypatch.setattr(tqplus, "ours", lambda ctx: [])
    _, body, notes = tqplus.report(results)
    assert [row[0] for row in body] == [tqplus.label("q8_0/q8_0")]
    assert "8k q8_0/q8_0 on 2026-12-02 06:32 UTC; 8k f16 on 2026-12-03 04:00 UTC." in notes[0], notes[0]


def test_tqplus_reads_the_forks_summary_and_its_logits_file(tmp_path: Path) -> None:
    # benchmarks/tqplus.py: the figures come from llama-perplexity's printed summary (a missing one is an error,
    # never a zero), and the tokens it fed from its logits file's header, which must equal ours.
    sys.path.insert(0, str(BENCH))
    import tqplus

    log = ("====== Perplexity statistics ======\nMean PPL(Q)                   :  19.761615 ±   2.724676\n"
           "Mean PPL(base)                :  19.670903 ±   2.701994\n"
           "====== KL divergence statistics ======\nMean    KLD:   0.006550 ±   0.000516\nMaximum KLD:   0.173193\n"
           "====== Token probability statistics ======\nSame top p: 94.922 ± 0.971 %\n")
    got = tqplus.parse_output(log)
    assert (got["kl"], got["kl_se"], got["ppl"], got["same_top_pct"]) == (0.00655, 0.000516, 19.761615, 94.922)
    assert got["ppl_delta_pct"] == pytest.approx(100 * (19.761615 / 19.670903 - 1))
    with pytest.raises(RuntimeError, match="kl"):
        tqplus.parse_output(log.replace("Mean    KLD", "Mean KL"))
    assert (tqplus.setting_bits("q8_0/turbo3"), tqplus.setting_bits("turbo4/turbo4")) == (5.8125, 4.25)
    tokens = [151643, 785, 2, 99]
    path = tmp_path / "base.kld"
    path.write_bytes(b"_logits_" + np.array([4, 151936, 1, *tokens], dtype=np.int32).tobytes() + b"\0" * 64)
    assert tqplus.base_tokens(path) == tokens
    path.write_bytes(b"_notlog_" + path.read_bytes()[8:])
    with pytest.raises(RuntimeError, match="not a llama-perplexity logits file"):
        tqplus.base_tokens(path)


# --- turboquant-mlx-full, a peer from PyPI ------------------------------------------------------------------------


def _tq_full():
    """(caches, its turboquant-mlx-full Peer): skipped with its one-line reason where it cannot run here."""
    sys.path.insert(0, str(BENCH))
    import caches

    found = caches.load_peer(True, caches.TQ_FULL)
    if found.module is None:
        assert found.reason.startswith("turboquant-mlx-full==0.30.0 cannot run here: ") and "\n" not in found.reason
        pytest.skip(found.reason)
    return caches, found


PEER_LOADERS = {
    # requirement: (loader name, distribution, the modules it may import, the module it returns)
    "turboquant-mlx-full==0.30.0": ("load_turboquant_mlx_full", "turboquant-mlx-full", {
        "turboquant_mlx", "turboquant_mlx.core", "turboquant_mlx.core.codebook", "turboquant_mlx.core.rotation",
        "turboquant_mlx.core.packing", "turboquant_mlx.layers", "turboquant_mlx.layers.polar_kv_cache"}),
    "mlx-vlm==0.7.10": ("load_mlx_vlm_turboquant", "mlx-vlm", {
        "mlx_vlm", "mlx_vlm.turboquant", "mlx_vlm.models", "mlx_vlm.models.cache"}),
}


@pytest.mark.parametrize("requirement", sorted(PEER_LOADERS))
def test_a_peer_loads_from_its_distribution_unpacked_not_installed(requirement, monkeypatch) -> None:
    # The wheel or sdist is unpacked into the tq-mlx cache and only the KV cache's modules are imported from there:
    # not its __init__s (transformers, weight layers, kernels), nothing installed; a failure is one line that says
    # which peer.
    import importlib.metadata

    sys.path.insert(0, str(BENCH))
    import common

    from tests.support import real_models

    loader_name, distribution, modules = PEER_LOADERS[requirement]
    loader = getattr(common, loader_name)
    mod, version, reason = loader()
    if mod is None:
        assert reason.startswith(f"{requirement} cannot run here: ") and "\n" not in reason
        pytest.skip(reason)
    assert (version, reason) == (requirement.split("==")[1], None)
    assert Path(mod.__file__).resolve().is_relative_to((real_models.cache_dir() / "peers").resolve())
    assert hasattr(mod, "TurboQuantKVCache") and hasattr(mod.TurboQuantKVCache, "update_and_fetch")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution(distribution)
    top = next(iter(modules)).split(".")[0]
    assert {k for k in sys.modules if k.split(".")[0] == top} == modules
    assert loader()[0] is mod  # loaded once

    def offline(*a, **k):
        raise RuntimeError(f"could not download {requirement} from PyPI\nsecond line")

    monkeypatch.setattr(real_models, "pip_download", offline)
    mod, version, reason = loader()
    assert (mod, version) == (None, None)
    assert reason == f"{requirement} cannot run here: RuntimeError: could not download {requirement} from PyPI"


def test_turboquant_mlx_full_settings_parse_and_price_what_they_hold() -> None:
    sys.path.insert(0, str(BENCH))
    import caches
    import common
    import long_context_settings as lc

    from tests.support.tiny_models import tiny_llama

    s = lc.parse_setting("tqfull8v3")
    assert s is lc.TQFULL8V3 and s in lc.ALL and lc.BY_KEY["tqfull8v3"] is s
    assert (s.name, s.kind, s.peer, s.key_bits, s.bits, s.fp16_tokens) == (
        "peer: turboquant-mlx-full K8/V3", "peer", "turboquant-mlx-full", 8, 3, None)
    assert s.to_dict() == {"name": s.name, "kind": "peer", "bits": 3, "key_bits": 8, "peer": "turboquant-mlx-full"}
    m = lc.parse_setting("tqfull4v2m128")
    assert (m.name, m.key_bits, m.bits, m.fp16_tokens) == ("peer: turboquant-mlx-full K4/V2 (first 128 tokens float16)",
                                                           4, 2, 128)
    assert m.to_dict()["fp16_tokens"] == 128
    for bad in ("tqfull9v3", "tqfull8v0"):
        with pytest.raises(SystemExit, match="1 to 8 bits"):
            lc.parse_setting(bad)
    # mlx-vlm's settings stay mlx-vlm's, named and stored as before
    assert lc.parse_setting("peer3").peer is None and "peer" not in lc.parse_setting("peer3").to_dict()
    # bits/value: head_dim 64 in groups of 64, K8 = 16 words + a float16 scale = 8.25 bits, V3 = 7 words (10 codes a
    # word) + a scale = 3.75 bits; plus per layer float16 signs and codebooks, and the float32 codebooks once
    _, args = tiny_llama()
    cfg = {"model_type": "llama", **dataclasses.asdict(args)}
    n_att, H, D = caches.kv_geometry(cfg)
    assert (n_att, H, D) == (3, 2, 64)
    constants = n_att * (2 * D * 2 + (256 + 8) * 2) + (511 + 15) * 4
    for ctx in (1024, 32768):
        assert caches.tq_full_bytes(s, ctx, (n_att, H, D)) == n_att * H * ctx * (16 * 4 + 2 + 7 * 4 + 2) + constants
        assert lc.bits_at(s, cfg, ctx) == common.bits_per_value(n_att * H * ctx * 96 + constants, ctx, (n_att, H, D))
    assert 6.0 < lc.bits_at(s, cfg, 32768) < 6.01
    # its float16 first tokens are a whole buffer from the first token: 16 bits/value at 128 tokens, with the codebooks
    g = (n_att, H, D)
    assert caches.tq_full_bytes(m, 1, g) == caches.tq_full_bytes(m, 128, g) > n_att * H * 128 * D * 4
    assert 16 < lc.bits_at(m, cfg, 128) < 16.5 and lc.bits_at(m, cfg, 32768) < 4


def test_turboquant_mlx_full_peer_runs_on_a_tiny_model_near_float_and_counts_the_arrays_it_holds(monkeypatch) -> None:
    # Prefill and a decode step through its caches: mlx-lm's own attention on the float16 keys and values they hand
    # it (no hook), logits near the float cache's (nearer at V8 than at V3); the bytes counted are those of every array
    # they hold (its buffers of whole 256-token steps), which the formula gives when the buffers are full; no float
    # copy: float16 only its scales, signs, codebooks and float16 tier, float32 only the shared codebooks.
    caches, found = _tq_full()
    import long_context as lc_run
    import long_context_settings as lc

    from tests.support.tiny_models import VOCAB, random_tokens, tiny_qwen3

    model, args = tiny_qwen3()  # head_dim 128: two groups of 64 a head, one float16 scale each
    cfg = {"model_type": "qwen3", **dataclasses.asdict(args)}
    geometry = caches.kv_geometry(cfg)
    assert geometry == (2, 2, 128)
    module = sys.modules[type(model).__module__]
    sdpa = module.scaled_dot_product_attention
    ids = mx.array(random_tokens(640, vocab=VOCAB))[None]

    def run(s, n):
        cache = caches.make_cache(model, s)
        prefill = model(ids[:, : n - 1], cache=cache)
        caches.eval_cache(cache)
        decode = model(ids[:, n - 1 : n], cache=cache)
        caches.eval_cache(cache)
        return cache, prefill, decode

    def rel(x, y):
        return (mx.abs(x - y).max() / mx.abs(y).max()).item()

    err = {}
    for key, n in (("tqfull8v8", 512), ("tqfull8v3", 512), ("tqfull8v3m128", 640)):
        s = lc.parse_setting(key)
        _, fp, fd = run(caches.FLOAT, n)
        cache, p, d = run(s, n)
        kb, vb, first = s.key_bits, s.bits, s.fp16_tokens or 0
        layers, H, D = geometry
        assert all(type(c) is found.module.TurboQuantKVCache and c.offset == n for c in cache)
        # keys at K bits, values at V bits: uint32 words of 32 // bits codes (its state: codes, scales of each side)
        assert all(c.state[0][0].shape == (1, H, n - first, -(-D // (32 // kb))) and c.state[1][0].shape[-1]
                   == -(-D // (32 // vb)) and c.state[0][1].shape[-1] == D // 64 for c in cache)
        assert module.scaled_dot_product_attention is sdpa  # no hook: mlx-lm's attention reads its float16 keys
        err[key] = (rel(p, fp), rel(d, fd))
        held = list({id(a): a for c in cache for a in caches.tq_full_arrays(c)}.values())
        assert caches.held_bytes(cache) == sum(a.nbytes for a in held)
        assert caches.held_bytes(cache) == caches.tq_full_bytes(s, n, geometry)  # every buffer full at n tokens
        assert caches.bits_per_value(cache, n, geometry) == lc.bits_at(s, cfg, n)
        codes = layers * H * (n - first) * 4 * (-(-D // (32 // kb)) + -(-D // (32 // vb)))
        assert sum(a.nbytes for a in held if a.dtype == mx.uint32) == codes
        assert sum(a.nbytes for a in held if a.dtype == mx.float32) == sum((2 * 2**b - 1) * 4 for b in {kb, vb})
        scales, tier = H * (n - first) * 2 * (D // 64) * 2, 2 * H * first * D * 2
        float16 = layers * (scales + 2 * D * 2 + (2**kb + 2**vb) * 2 + tier)
        assert sum(a.nbytes for a in held if a.dtype == mx.float16) == float16
        assert {a.dtype for a in held} <= {mx.uint32, mx.float16, mx.float32}
        # its own nbytes: the same codes, scales and float16 tokens, without its constants
        assert sum(c.nbytes for c in cache) == caches.held_bytes(cache) - (
            layers * (2 * D * 2 + (2**kb + 2**vb) * 2) + sum((2 * 2**b - 1) * 4 for b in {kb, vb}))
    assert 0 < err["tqfull8v8"][1] < 0.01 and 1e-3 < err["tqfull8v3"][1] < 0.1, err
    assert err["tqfull8v8"][0] < err["tqfull8v3"][0] < 0.25 and err["tqfull8v3m128"][1] < 0.1, err
    # 300 tokens: buffers of 512 tokens, counted in full (its nbytes counts 300)
    s = lc.TQFULL8V3
    cache = caches.make_cache(model, s)
    model(ids[:, :300], cache=cache)
    caches.eval_cache(cache)
    assert caches.held_bytes(cache) == caches.tq_full_bytes(s, 512, geometry) > caches.tq_full_bytes(s, 300, geometry)
    # long_context's pass: KL against the float pass, the bytes measured as the formula prices them
    monkeypatch.setattr(lc_run, "_MODEL_CONFIG", [cfg])
    tokens = random_tokens(257, vocab=VOCAB)
    _, logps = lc_run.run_pass(model, caches.make_cache(model, caches.FLOAT), tokens, [256], 128, 128, None)
    out, _ = lc_run.run_pass(model, caches.make_cache(model, s), tokens, [256], 128, 128, logps)
    assert 1e-6 < out[256]["kl"] < 0.05 and out[256]["bits_real"] == lc.bits_at(s, cfg, 256), out


def run_probe(tmp_path, probe: str, refused: list[str], message: str, args: list[str]) -> list[dict]:
    """An experiments/ probe on a SmolLM2 1k cell: with `refused` it must fail saying `message`; with args it must
    write its JSON. Returns the cells written."""
    env, out = script_env(), tmp_path / "probe.json"
    base = [sys.executable, str(EXPERIMENTS / probe), "--models", "smollm2", "--context", "1024"]
    bad = subprocess.run([*base, *refused], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-2000:]
    proc = subprocess.run([*base, *args, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())["cells"]


def test_model_dtype_runs_the_cell_with_the_weights_and_the_float_cache_in_each_dtype(tmp_path) -> None:
    # model_dtype.py: the same SmolLM2 cell in float32 and float16, each setting against the float cache in its own
    # dtype (a float16 model's mlx-lm cache holds 16 bits a value); an unknown dtype is refused with what is allowed.
    cells = run_probe(tmp_path, "model_dtype.py", ["--dtypes", "float8"],
                      "--dtypes takes float32, float16, bfloat16; got float8",
                      ["--dtypes", "float32,float16", "--settings", "default"])
    cells = {c["dtype"]: c["rows"] for c in cells}
    assert set(cells) == {"float32", "float16"}
    for dtype, rows in cells.items():
        assert rows["float"]["kl"] == 0 and rows["float"]["bits_real"] == (32 if dtype == "float32" else 16)
        assert 0 < rows["default"]["kl"] < 0.05 and abs(rows["default"]["ppl_delta_pct"]) < 5, (dtype, rows)
    assert cells["float16"]["float"]["ppl"] == pytest.approx(cells["float32"]["float"]["ppl"], rel=0.02)


def test_calibration_shift_scores_the_body_behind_another_texts_opening(tmp_path) -> None:
    # calibration_shift.py: the body alone and the body whose first tokens are code's, each setting against the float
    # pass of its own tokens, the widths its layers took recorded; a lead past the scored tokens is refused.
    sys.path.insert(0, str(EXPERIMENTS))
    import calibration_shift as cs

    from tests.support import real_models

    _, tok = real_models.load_smollm2()
    led = cs.context_ids(tok, "britannica", "code", 300, 1024)
    alone = cs.context_ids(tok, "britannica", cs.NONE, 300, 1024)
    assert len(led) == len(alone) == 1025 and led[300:] == alone[300:] and led[:300] != alone[:300]
    cells = run_probe(tmp_path, "calibration_shift.py", ["--lead-tokens", "600"], "--lead-tokens must be between 1 and",
                      ["--leads", "none,code", "--lead-tokens", "300"])
    cells = {c["lead"]: c for c in cells}
    assert set(cells) == {"none", "code"} and cells["none"]["lead_tokens"] == 0 and cells["code"]["lead_tokens"] == 300
    for cell in cells.values():
        rows = cell["rows"]
        assert rows["float"]["kl"] == 0 and 0 < rows["default"]["kl"] < 0.05, rows
        # the layers whose keys took other bits than K4: K3 to K6 by their output error
        assert rows["default"]["widened"] and all(bits in (3, 5, 6) for _, bits in rows["default"]["widened"])
    assert cells["none"]["rows"]["float"]["ppl"] != cells["code"]["rows"]["float"]["ppl"]


def test_layer_sensitivity_allocations_and_widths_follow_the_costs() -> None:
    # layer_sensitivity.py's rules: a width by output error is the fewest bits whose error (K4's scaled by D_mse) holds
    # the target, K6 when none does, a protected layer none; the greedy allocation meets its budget with the fewest
    # bits and widens the costly layer first.
    sys.path.insert(0, str(EXPERIMENTS))
    import layer_sensitivity as ls

    from tq_mlx.quant.codebook import lloyd_max

    r5 = lloyd_max(64, 5).mse / lloyd_max(64, 4).mse
    assert ls.output_widths([1e-3, 1e-3 / r5 * 0.99, 1.0, None, 0.0], 1e-3, 64) == [4.0, 5.0, 6.0, None, 3.0]
    w = ls.allocate([1.0, 0.01], 1.05, 64)
    assert w == [4, 3], w
    w = ls.allocate([1.0, 0.01], 0.5, 64)
    assert w == [5, 3] and 1.0 * r5 + 0.01 * lloyd_max(64, 3).mse / lloyd_max(64, 4).mse <= 0.5


def test_layer_sensitivity_measures_each_layer_alone(tmp_path) -> None:
    # layer_sensitivity.py on two SmolLM2 layers at 1.5k: each layer alone gives a KL above 0 (its keys coded, the
    # rest float), beside the cache's own predicted error and output error; a context too short is refused.
    env, out = script_env(), tmp_path / "probe.json"
    base = [sys.executable, str(EXPERIMENTS / "layer_sensitivity.py"), "--models", "smollm2"]
    bad = subprocess.run([*base, "--context", "1024"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--context must be at least 1412" in bad.stderr, bad.stderr[-2000:]
    proc = subprocess.run([*base, "--context", "1536", "--layers", "3,11", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["kind"] == "layers" and [r["layer"] for r in cell["layers"]] == [3, 11]
    for r in cell["layers"]:
        assert r["kl"] > 0 and r["predicted_4"] > 0 and r["output_error_4"] > 0 and 4 <= r["width"] <= 6, r
    # layer 3's keys cost the model more than layer 11's, and its own output error says so
    a, b = cell["layers"]
    assert a["kl"] > b["kl"] and a["output_error_4"] > b["output_error_4"], cell["layers"]


def test_a_probe_run_again_replaces_its_own_cells_and_keeps_the_rest(tmp_path) -> None:
    # common.write_cells, called after each cell: an earlier run's cells that this run does not measure stay, the one it
    # measures again is replaced (once, however many times it writes), and a fresh file holds just this run's.
    sys.path.insert(0, str(BENCH))
    import common

    out = tmp_path / "probe.json"
    key = lambda c: (c["model"], c["context"])  # noqa: E731
    common.write_cells(out, {"meta": {"run": 1}, "cells": [{"model": "a", "context": 1, "kl": 1.0},
                                                          {"model": "a", "context": 2, "kl": 2.0}]}, key)
    run = {"meta": {"run": 2}, "cells": [{"model": "a", "context": 2, "kl": 3.0}]}
    common.write_cells(out, run, key)
    run["cells"].append({"model": "b", "context": 2, "kl": 4.0})
    common.write_cells(out, run, key)
    d = json.loads(out.read_text())
    assert d["meta"] == {"run": 2}
    assert [(c["model"], c["context"], c["kl"]) for c in d["cells"]] == [("a", 1, 1.0), ("a", 2, 3.0), ("b", 2, 4.0)]


def test_long_context_merge_counts_a_needle_probe_run_again_once() -> None:
    # Two runs that both probe float at the same length and depth (each run repeats the float probes): the merged
    # file holds one probe per (setting, length, depth), the earlier one, unless it erred and the later did not.
    sys.path.insert(0, str(BENCH))
    import long_context_table as lc_table

    probe = lambda s, d, **x: {"setting": s, "length": 8192, "depth": d, **x}  # noqa: E731
    first = [probe("float", 0.1, hit=False, seconds=1), probe("default", 0.1, error="skipped: time budget spent")]
    again = [probe("float", 0.1, hit=True, seconds=2), probe("float", 0.5, hit=True),
             probe("default", 0.1, hit=False, seconds=3)]
    merged = lc_table.merge_needles(first, again)
    assert merged == [first[0], again[2], again[1]]
    assert lc_table.merge_needles(merged, again) == merged


def test_long_context_merge_names_a_needle_probe_by_its_config_or_another_runs_row(long_context: dict,
                                                                                  tmp_path: Path) -> None:
    # A needle-only run holds no row of the setting it probed: a probe that records its config takes the name the
    # merged file gives that config (a later default renames it), one that does not takes the name another run's
    # row of the same label takes, so a probe and its setting's row keep one name.
    sys.path.insert(0, str(BENCH))
    import long_context_settings as lcs
    import long_context_table as lc_table

    old = dict(lcs.DEFAULT_1206B.config.to_dict())
    row = {"setting": "TQ (as it ran, the default)", "kind": "tq", "config": old, "bits": {"1024": 4.5},
           "texts": {"britannica": {"1024": {"kl": 0.001, "ppl": 10.0}}}}
    model = lambda rows, needles: {"rows": rows, "needles": needles, "texts": ["britannica"], "model": "Q",  # noqa: E731
                                   "geometry": {"attention_layers": 28, "kv_heads": 2, "head_dim": 128},
                                   "contexts": [1024]}
    probe = lambda d, **x: {"setting": "TQ (as it ran, the default)", "length": 16384, "depth": d, "hit": True, **x}  # noqa: E731
    run = lambda cmd, m: dict(long_context, meta=dict(long_context["meta"], command=cmd), models={"qwen15": m})  # noqa: E731
    runs = [run("a", model([row], [])), run("b", model([], [probe(0.1)])), run("c", model([], [probe(0.5, config=old)]))]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    lc_table.merge([str(x) for x in paths], str(tmp_path / "merged"))
    merged = json.loads((tmp_path / "merged" / "long_context.json").read_text())["models"]["qwen15"]
    assert [r["setting"] for r in merged["rows"]] == [lcs.DEFAULT_1206B.name]
    assert sorted((p["depth"], p["setting"]) for p in merged["needles"]) == [(0.1, lcs.DEFAULT_1206B.name),
                                                                          (0.5, lcs.DEFAULT_1206B.name)]
