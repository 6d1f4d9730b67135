"""benchmarks/prompt_cache.py at CI size: time to first token on a repeated 1k system prompt, cold, after a memory hit
and after a restart, tq-server (its disk tier) beside mlx_lm.server, and the bytes each keeps, rendered into
docs/benchmarks.md by tools/docs/readme_tables.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.test_benchmarks import REPO, _meta_ok, _tables_cmd, results_dir, run_script  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


def test_prompt_cache_quick_times_a_repeated_prefix_beside_mlx_lm_server(results_dir: Path, tmp_path: Path) -> None:
    # A 1k system prompt on SmolLM2, cold, after a memory hit and after a restart, on tq-server and mlx_lm.server:
    # tq-server's restart finds the prefix on disk, mlx-lm's starts cold; the bytes read inside the servers.
    res = run_script("prompt_cache", results_dir, timeout=1200)
    _meta_ok(res["meta"])
    rows = {(r["server"], r["phase"]): r for r in res["rows"]}
    assert set(rows) == {(s, p) for s in ("tq", "float") for p in ("cold", "memory hit", "after a restart")}
    assert all(r["status"] == 200 and r["ttft_s"] > 0 and r["prefix"] == 1024 for r in rows.values())
    for server in ("tq", "float"):
        assert rows[(server, "cold")]["cached_tokens"] < 16 and rows[(server, "memory hit")]["cached_tokens"] > 1000
    tq_restart, float_restart = rows[("tq", "after a restart")], rows[("float", "after a restart")]
    assert tq_restart["cached_tokens"] > 1000 and res["hits"]["1024"] == "disk hit"  # from disk
    assert float_restart["cached_tokens"] < 16 and tq_restart["ttft_s"] < rows[("tq", "cold")]["ttft_s"]
    by = {b["server"]: b for b in res["bytes"]}
    assert 0 < by["tq"]["request_cache"]["nbytes"] < by["float"]["request_cache"]["nbytes"]
    assert by["tq"]["disk_bytes"] > 0 and by["float"]["disk_bytes"] is None  # no disk tier
    cmd, docs, _ = _tables_cmd(results_dir, tmp_path)
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    text = docs.read_text()
    assert "### Serving: a repeated long prefix (prompt cache)" in text and "benchmarks/prompt_cache.py" in text
