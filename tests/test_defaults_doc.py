"""benchmarks/DEFAULTS.md, the rationale of TurboQuantConfig's defaults, says only what its results files hold.

Each figure in it is written with a comment naming its results file and cell (tools/docs/defaults_figures.py):
every figure equals what that file gives now, a figure typed differently or a number that names no file fails, the
defaults its headings name are TurboQuantConfig()'s, every default has its section, and its commands run scripts
that exist with settings long_context.py knows. The dated history is experiments/HISTORY.md.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "benchmarks" / "DEFAULTS.md"
HISTORY = REPO / "experiments" / "HISTORY.md"
TOOL = REPO / "tools" / "docs" / "defaults_figures.py"


@pytest.fixture(scope="module")
def figures():
    sys.path.insert(0, str(TOOL.parent))
    import defaults_figures  # (puts benchmarks/ on sys.path)

    return defaults_figures


def test_every_figure_is_its_results_files(figures) -> None:
    check = figures.check(DOC.read_text())
    assert check.problems == [], "\n".join(check.problems)
    assert check.text == DOC.read_text()
    assert check.figures >= 200


def test_a_figure_typed_differently_fails_and_write_restores_it(figures) -> None:
    text = DOC.read_text()
    cell = "<!-- lc qwen05 default-1203 britannica 16k kl -->"
    written = re.search(r"(\S+?)" + re.escape(cell), text).group(1)
    assert written == figures.value(cell[5:-4])  # 0.0079: Qwen2.5-Coder-0.5B, Britannica 16k, the default's KL
    typed = text.replace(written + cell, "0.0080" + cell, 1)
    check = figures.check(typed)
    assert len(check.problems) == 1 and "'0.0080'" in check.problems[0] and f"'{written}'" in check.problems[0]
    assert check.text == text  # what --write makes of it
    # a percentage, a count of layers, a needle count and a 1k-study figure are checked the same way
    for cell in ("<!-- lc qwen05 default-1203 hamlet 32k dppl -->", "<!-- lc qwen05 default-1203 britannica 32k K6 -->",
                 "<!-- needle smollm2 float 8k -->", '<!-- q smollm2 "TQ K4+qjl/V4" dppl -->'):
        m = re.search(r"(\S+?)" + re.escape(cell), text)
        assert m, cell
        problems = figures.check(text.replace(m.group(0), "9" + cell, 1)).problems
        assert len(problems) == 1 and "'9'" in problems[0], cell


def test_a_number_without_a_source_fails(figures) -> None:
    text = DOC.read_text()
    anchor = "## qjl = False\n"
    assert text.count(anchor) == 1
    added = figures.check(text.replace(anchor, anchor + "\nOn a fourth text its KL is 0.0123 at 8k.\n", 1)).problems
    assert len(added) == 1 and "'0.0123' has no reference" in added[0]
    # a reference that names no cell, and a heading whose default is not the config's
    nowhere = "\n0.5<!-- lc qwen05 default britannica 64k kl -->\n"
    bad = figures.check(text.replace(anchor, anchor + nowhere, 1)).problems
    assert len(bad) == 1 and "no britannica cell at 64k" in bad[0]
    heading = figures.check(text.replace("## window = 128", "## window = 512", 1)).problems
    assert len(heading) == 1 and "window = 512" in heading[0] and "'128'" in heading[0]


def test_the_command_line_check(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, str(TOOL), "--check"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc = tmp_path / "DEFAULTS.md"
    doc.write_text(DOC.read_text().replace("0.0079<!-- lc qwen05 default-1203 britannica 16k kl -->",
                                           "0.0070<!-- lc qwen05 default-1203 britannica 16k kl -->", 1))
    stale = subprocess.run([sys.executable, str(TOOL), "--doc", str(doc), "--check"], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert stale.returncode == 1 and "the figure is '0.0070' where its results file gives '0.0079'" in stale.stderr
    subprocess.run([sys.executable, str(TOOL), "--doc", str(doc), "--write"], cwd=REPO, capture_output=True,
                   timeout=300)
    assert doc.read_text() == DOC.read_text()


def test_every_default_has_its_section() -> None:
    import dataclasses

    from tq_mlx import TurboQuantConfig

    text = DOC.read_text()
    headings = " ".join(re.findall(r"^## (.+)$", text, re.M))
    sections = {"boundary_bits": "boundary_layers", "boundary_sides": "boundary_layers", "decay_key_bits": "decay_after", "decay_value_bits": "decay_after",
                "compress_block": "compress_block_size"}  # fields a sibling's section explains
    fields = [f.name for f in dataclasses.fields(TurboQuantConfig) if f.name not in ("seed", "step")]
    missing = [f for f in fields if not re.search(rf"\b{sections.get(f, f)}\b", headings)]
    assert not missing, f"benchmarks/DEFAULTS.md has no section for {missing}"
    for f in sections:
        assert f in text, f
    # each section says what, why, with which figures, and links its history
    for body in re.split(r"^## ", text, flags=re.M)[2:-1]:  # (after the default's table, before what it misses)
        title = body.splitlines()[0]
        assert "    python " in body, f"{title}: no command"
        if "presets" not in title:
            assert "**What:**" in body and "**Why" in body and "**Figures" in body, title


def test_its_commands_run_scripts_that_exist_with_settings_that_parse(figures) -> None:
    import long_context_settings as lc

    commands = [line.strip() for line in DOC.read_text().splitlines() if line.startswith("    python ")]
    assert len(commands) >= 15
    for command in commands:
        words = shlex.split(command)
        assert (REPO / words[1]).exists(), command
        if "--settings" in words:
            for key in words[words.index("--settings") + 1].split(","):
                lc.parse_setting(key)  # SystemExit if long_context.py does not know it


def test_the_history_is_the_diary_and_points_to_the_rationale() -> None:
    lines = HISTORY.read_text().splitlines()
    assert lines[0].startswith("# ") and "history" in lines[0]
    assert "[benchmarks/DEFAULTS.md](../benchmarks/DEFAULTS.md)" in lines[2]
    assert len(lines) > 1000  # the diary, whole
    # the rationale links the history's sections by anchors that exist (test_readme checks every link resolves)
    assert len(re.findall(r"\]\(\.\./experiments/HISTORY\.md#", DOC.read_text())) >= 10


def test_the_readme_quality_caption_names_the_runs_its_rows_come_from() -> None:
    # long_context.json joins many runs; its meta's own date and machine are its first run's. The README's 8k
    # table (SmolLM2's rows) names the runs that measured SmolLM2: how many, the first and last date, the machines.
    import json

    sys.path[:0] = [str(TOOL.parent), str(REPO / "benchmarks")]
    import long_context_table as lc_table

    meta = json.loads((REPO / "benchmarks" / "results" / "long_context.json").read_text())["meta"]
    runs = lc_table.runs_of(meta, "smollm2")
    assert 1 < len(runs) < len(meta["runs"]) and all("smollm2" in r["command"] for r in runs)
    caption = next(line for line in (REPO / "README.md").read_text().splitlines()
                   if line.startswith("SmolLM2-135M-Instruct at 8k tokens"))
    dates = sorted(r["date"] for r in runs)
    assert f"Rows from {len(runs)} runs, {dates[0]} to {dates[-1]} · " in caption
    assert all(r["machine"] in caption for r in runs)
    # two machines are both named, with their runs
    two = dict(meta, runs=[dict(runs[0], machine="A"), dict(runs[-1], machine="B"), dict(runs[1], machine="B")])
    assert "B (2 runs) and A (1 run)" in lc_table.runs_text(two, "smollm2")
    one = {k: v for k, v in runs[0].items()}
    assert lc_table.runs_text(one) == f"{one['date']} · {one['machine']} · cpu, OpenBLAS"
