"""The README and docs/ say only what is true, and stay generated.

Every `mlx_lm.*` / `tq_mlx.*` name they mention exists; the README's Python runs as written (a tiny model stands in
for the hub's); what the README says about prompt-cache files holds in a fresh process; every local link and
anchor resolves; the generated tables match benchmarks/results/*.json; tools/docs/plots.py draws the pictures from
that JSON; every picture and command output the docs show is what `python tools/docs/docs_assets.py` makes now.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TOOLS = REPO / "tools" / "docs"  # the docs generators (each puts benchmarks/ on sys.path)
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "DEFAULTS.md",
        REPO / "experiments" / "README.md"]

NAME = re.compile(r"(?<![\w./-])((?:mlx_lm|tq_mlx)(?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT = re.compile(r"^\s*from ((?:mlx_lm|tq_mlx)[\w.]*) import ([\w, ]+)$", re.M)
# tq_mlx's modules named on their own in backticks, as the design notes do (`packing.unpack_lookup`): the short
# name and the module it names
SHORT = {"codebook": "quant.codebook", "rotation": "quant.rotation", "packing": "quant.packing",
         "quantizer": "quant.quantizer", "config": "config", "stream": "stream.compressed",
         "attention": "attention.reference", "kernels": "attention", "cache": "cache", "memory": "planner.memory",
         "integration": "integration", "batch": "batch", "blas": "blas", "cli": "cli", "plan": "plan",
         "calibration": "stream.calibration", "codec": "stream.codec", "view": "stream.view", "hook": "hook"}
SUBMODULE = re.compile(r"`((" + "|".join(SHORT) + r")\.(?!py\b)[A-Za-z_]\w*)")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def resolve(dotted: str) -> object:
    """The module or attribute a dotted name names; raises if there is none. Modules are found, not imported,
    where the name ends at one (mlx_lm.models.olmo exits at import without its package)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if i == len(parts):
            return spec
        obj = importlib.import_module(module)
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def mentioned_names(text: str) -> set[str]:
    names = set(NAME.findall(text)) | {f"tq_mlx.{SHORT[m]}{n[len(m):]}" for n, m in SUBMODULE.findall(text)}
    for module, imported in FROM_IMPORT.findall(text):
        names |= {f"{module}.{n.strip()}" for n in imported.split(",") if n.strip()}
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_name_the_docs_mention_exists(doc: Path) -> None:
    missing = []
    for name in sorted(mentioned_names(doc.read_text())):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    assert not missing, f"{doc.name} names what does not exist: {missing}"


def test_the_name_check_catches_the_names_that_never_existed() -> None:
    # What the README used to say (issue 22): prompt-cache functions at mlx_lm's top level.
    assert {"mlx_lm.save_prompt_cache", "mlx_lm.load_prompt_cache"} <= mentioned_names(
        "`mlx_lm.save_prompt_cache`/`mlx_lm.load_prompt_cache` round-trip it")
    for name in ("mlx_lm.save_prompt_cache", "mlx_lm.load_prompt_cache", "tq_mlx.no_such_thing"):
        with pytest.raises(AttributeError):
            resolve(name)
    assert resolve("mlx_lm.models.cache.load_prompt_cache") is not None
    assert mentioned_names("from tq_mlx import TurboQuantMSE, Nope\n`packing.unpack_lookup` `cache.py`") == {
        "tq_mlx.TurboQuantMSE", "tq_mlx.Nope", "tq_mlx.quant.packing.unpack_lookup"}


@pytest.mark.filterwarnings("ignore::tq_mlx.blas.ReferenceBLASWarning")  # the README says how to get OpenBLAS
def test_readme_python_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's blocks in order, in one namespace, with mlx_lm.load handing back a tiny model instead of
    # downloading one; its prompt-cache file lands in a temporary folder.
    import mlx_lm

    import tq_mlx
    from tests.support.tiny_models import tiny_llama, tiny_tokenizer

    model, _ = tiny_llama(layers=2)
    tokenizer = tiny_tokenizer()
    loaded = []
    monkeypatch.setattr(mlx_lm, "load", lambda *a, **k: loaded.append(a) or (model, tokenizer))
    monkeypatch.chdir(tmp_path)
    blocks = PYTHON_BLOCK.findall(README.read_text())
    assert len(blocks) >= 2, "the README shows Python use and prompt-cache files"
    scope: dict = {}
    try:
        for block in blocks:
            exec(compile(block, str(README), "exec"), scope)
    finally:
        tq_mlx.unpatch_model(model)
    assert loaded and isinstance(scope["cache"][0], tq_mlx.TurboQuantKVCache)
    assert scope["cache"][0].offset > 0 and list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize("doc", [p for p in DOCS if p != README and PYTHON_BLOCK.search(p.read_text())],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_docs_python_runs_as_written(doc: Path) -> None:
    for block in PYTHON_BLOCK.findall(doc.read_text()):
        exec(compile(block, str(doc), "exec"), {})


def test_prompt_cache_files_load_as_the_readme_says(tmp_path: Path) -> None:
    # README, "Prompt-cache files": in a fresh process mlx-lm's loader does not know TurboQuantKVCache (KeyError);
    # tq_mlx.load_prompt_cache does, and so does mlx-lm's after patch_model.
    path = tmp_path / "prompt.safetensors"
    common = f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import mlx.core as mx
        from mlx_lm.models import cache as mlx_cache
        import tq_mlx
        from tests.support.tiny_models import tiny_llama
        model, _ = tiny_llama(layers=1)
        path = {str(path)!r}
    """
    steps = {
        "save": """
            cache = tq_mlx.make_prompt_cache(model, tq_mlx.TurboQuantConfig(window=8, compress_block=4, sinks=2))
            model(mx.array([list(range(40))]), cache=cache)
            mlx_cache.save_prompt_cache(path, cache)
            print("saved")
        """,
        "mlx-lm alone": """
            try:
                mlx_cache.load_prompt_cache(path)
                print("loaded")
            except KeyError as e:
                print("KeyError", e)
        """,
        "tq_mlx": "print(type(tq_mlx.load_prompt_cache(path, model)[0]).__name__)",
        "mlx-lm after patch_model": """
            tq_mlx.patch_model(model)
            print(type(mlx_cache.load_prompt_cache(path)[0]).__name__)
        """,
    }
    expected = {"save": "saved", "mlx-lm alone": "KeyError 'TurboQuantKVCache'", "tq_mlx": "TurboQuantKVCache",
                "mlx-lm after patch_model": "TurboQuantKVCache"}
    for step, code in steps.items():
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(common) + textwrap.dedent(code)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (step, proc.stderr[-2000:])
        assert proc.stdout.strip().splitlines()[-1] == expected[step], (
            f"{step}: {proc.stdout.strip()!r}; update the README's 'Prompt-cache files' if this changed on purpose")


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_local_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


def test_readme_is_a_front_page_with_its_two_commands() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/"
    # .ci/run takes the test command as the 2nd line after its marker; the main command sits the same way
    for marker, command in (("<!-- main-command -->", 'pip install ".[demo]" && tq-chat smollm2-135m'),
                            ("<!-- test-command -->", 'pip install -e ".[test]" && python -m pytest -q')):
        i = lines.index(marker)
        assert lines[i + 1] == "```bash" and lines[i + 2].startswith(command), marker
    for picture in ("docs/memory_vs_context.png", "docs/kl_vs_bits.png"):
        assert f"({picture})" in text and (REPO / picture).stat().st_size > 10_000


def test_every_probe_in_experiments_has_its_claim_and_results() -> None:
    # experiments/README.md's table: one row per probe (its claim, command and results file; the links resolve above)
    text = (REPO / "experiments" / "README.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| \[(\w+\.py)\]\(\1\) \|", text, re.M)}
    assert rows == {p.name for p in (REPO / "experiments").glob("*.py")}, "experiments/README.md: a row per probe"
    for name in rows:
        results = REPO / "experiments" / "results" / name.replace(".py", ".json")
        assert results.exists() == (f"](results/{results.name})" in text), name


def test_generated_tables_match_the_results() -> None:
    # docs/benchmarks.md's tables and the README's headline tables, rendered again from benchmarks/results/*.json
    proc = subprocess.run([sys.executable, str(TOOLS / "readme_tables.py"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_per_path_table_is_generated_from_the_default_measured() -> None:
    # The README's per-path decode table sits between readme_tables' markers, rendered from paths.json, and that
    # file measured TurboQuantConfig() as it is now (a new default needs python benchmarks/paths.py again).
    import json

    sys.path.insert(0, str(TOOLS))
    import readme_tables

    from tq_mlx import TurboQuantConfig

    res = json.loads((REPO / "benchmarks" / "results" / "paths.json").read_text())
    # (fields the file predates held their defaults then: TurboQuantConfig.from_dict)
    assert TurboQuantConfig.from_dict(res["config"]) == TurboQuantConfig(), "benchmarks/results/paths.json: rerun benchmarks/paths.py"
    text = README.read_text()
    body = readme_tables.paths_section()
    assert readme_tables.splice(text, body, readme_tables.PATHS_START, readme_tables.PATHS_END) == text
    inside = text.split(readme_tables.PATHS_START, 1)[1].split(readme_tables.PATHS_END, 1)[0]
    outside = text.replace(inside, "")
    assert "MLA-shaped" in inside and "MLA-shaped" not in outside and "| on the codes |" not in outside
    # any ratio edited by hand is out of date
    ratios = re.findall(r"\d+\.\d+x", inside)
    assert len(ratios) == 8
    for r in ratios:
        edited = text.replace(inside, inside.replace(r, "9.99x", 1))
        assert readme_tables.splice(edited, body, readme_tables.PATHS_START, readme_tables.PATHS_END) != edited


def test_plots_draw_from_the_results(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (in the test extra, so this test runs wherever the tests do: no skip)

    proc = subprocess.run([sys.executable, str(TOOLS / "plots.py"), "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("kl_vs_bits.png", "peers_vs_bits.png", "peers_vs_bits_16k.png", "memory_vs_context.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
        assert (REPO / "docs" / name).exists(), f"docs/{name}: run python tools/docs/plots.py"
    sys.path.insert(0, str(TOOLS))
    import json

    import plots  # (puts benchmarks/ on sys.path)

    import long_context_settings as lc_settings

    # every setting and peer of the long-context JSON measured at 8k is a point, the default among them
    lc = json.loads((REPO / "benchmarks" / "results" / "long_context.json").read_text())
    names = {p["name"] for p in plots.kl_points(lc)}
    assert lc_settings.DEFAULT.name in names and lc_settings.DEFAULT_MEAN.name in names
    assert "TQ K4/V3 (the default until 2026-11-26)" in names and "peer: mlx-vlm TurboQuant 4-bit" in names
    rows = [r for r in lc["models"]["smollm2"]["rows"] if r["kind"] != "float"
            and any("8192" in c for c in r["texts"].values())]
    assert len(names) == len(rows)
    # the peers picture: TurboQuant+'s every cell of tqplus.json beside the long-context rows, on its one text
    inputs = plots.load_inputs()
    peers = plots.figure_data("peers_vs_bits", inputs)["points"]
    cells = inputs["tqplus"]["cells"][str(plots.PEERS_CONTEXT)]
    fork = {(p["name"], p["bits"], p["kl"][plots.PEERS_TEXT]) for p in peers if p["family"] == "TurboQuant+"}
    assert fork == {(f"TurboQuant+ {s} (K/V)", c["bits"], c["kl"]) for s, c in cells.items() if "kl" in c} != set()
    assert all(set(p["kl"]) == {plots.PEERS_TEXT} for p in peers)
    assert lc_settings.DEFAULT.name in {p["name"] for p in peers}
    # at 16k: the peers measured there, and the footnote names each peer of the 8k picture that is not
    at16 = plots.figure_data("peers_vs_bits_16k", inputs)
    peer_names = lambda pts: {p["name"] for p in pts if p["family"] in plots.PEER_FAMILIES}  # noqa: E731
    missing = peer_names(peers) - peer_names(at16["points"])
    assert all(set(p["kl"]) == {plots.PEERS_TEXT} for p in at16["points"])
    assert all(name in at16["footnote"] for name in missing)
    assert ("every peer" in at16["title"]) == (not missing) == ("Not measured at 16k" not in at16["footnote"])
    at = plots.PEERS_FIGURES["peers_vs_bits_16k"]
    drawn16 = {p["name"] for p in plots.kl_points(lc, plots.PEERS_MODEL, at, (plots.PEERS_TEXT,))}
    assert drawn16 <= {p["name"] for p in at16["points"]} and lc_settings.DEFAULT.name in drawn16
    # each peer in its own colour and legend entry: mlx-vlm's rows carry no "peer" field, turboquant-mlx-full's do
    vlm, full = {"kind": "peer", "name": "peer: mlx-vlm TurboQuant 4-bit"}, {"kind": "peer", "peer": "turboquant-mlx-full"}
    assert plots.STYLE[plots._family(vlm)][2] == "peer: mlx-vlm TurboQuant"
    assert plots.STYLE[plots._family(full)][2] == "peer: turboquant-mlx-full"


# --- every generated picture and example: tools/docs/docs_assets.py ---------------------------------------------


def _docs_assets():
    sys.path.insert(0, str(TOOLS))
    import docs_assets

    return docs_assets


def test_pictures_examples_and_screenshot_are_what_docs_assets_makes_now() -> None:
    # docs/*.png against their sidecars (the data drawn, never pixels), every command output in docs/ between
    # generated-example markers run again (tq-chat --plan and tq-generate on the demo model), and the app
    # screenshot's panel drawn again from its snapshot. The tables have their own test above.
    proc = subprocess.run([sys.executable, str(TOOLS / "docs_assets.py"), "--check", "--only", "pictures",
                           "--only", "examples", "--only", "screenshot"], cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_every_picture_in_the_docs_is_generated_and_checked() -> None:
    # each picture README.md and docs/ show is one docs_assets.py makes (and so --check checks)
    shot = _docs_assets().SHOT  # (puts tools/docs/ on sys.path)
    import plots

    made = {f"{name}.png" for name in plots.FIGURES} | {shot.name}
    shown = {Path(target).name for doc in DOCS for target in LINK.findall(doc.read_text())
             if target.endswith((".png", ".svg", ".jpg", ".gif"))}
    assert shown and shown <= made, f"pictures nothing generates: {shown - made}"
    for name in made:
        assert (REPO / "docs" / name).with_suffix(".json").exists(), f"docs/{name}: no sidecar"


def test_the_picture_check_catches_a_stale_picture(tmp_path: Path) -> None:
    import json
    import shutil

    _docs_assets()  # (puts tools/docs/ on sys.path)
    import plots

    inputs = plots.load_inputs()
    for name in plots.FIGURES:
        for ext in (".png", ".json"):
            shutil.copy(REPO / "docs" / f"{name}{ext}", tmp_path / f"{name}{ext}")
        assert plots.check(name, inputs, tmp_path) == [], f"docs/{name}.png is stale"
        side = json.loads((tmp_path / f"{name}.json").read_text())
        key = "panels" if name == "memory_vs_context" else "key"
        side[key] = side[key][1:]  # a setting or a model less than the results have
        (tmp_path / f"{name}.json").write_text(json.dumps(side))
        assert any(repr(key) in p for p in plots.check(name, inputs, tmp_path))
        shutil.copy(REPO / "docs" / f"{name}.json", tmp_path / f"{name}.json")
        (tmp_path / f"{name}.png").write_bytes((REPO / "docs" / f"{name}.png").read_bytes() + b"\0")
        assert any("not the picture" in p for p in plots.check(name, inputs, tmp_path))


def test_the_screenshot_check_catches_a_stale_panel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The panel's text is drawn again from the screenshot's snapshot, its KV figures derived again from
    # tq_mlx.planner.memory, the config from today's flags: each, changed, is found.
    import json
    import shutil

    da = _docs_assets()
    shot = tmp_path / "tq-chat.png"
    shutil.copy(da.SHOT, shot)
    monkeypatch.setattr(da, "SHOT", shot)
    side = json.loads((REPO / "docs" / "tq-chat.json").read_text())

    def problems(edit) -> list[str]:
        changed = json.loads(json.dumps(side))
        edit(changed)
        shot.with_suffix(".json").write_text(json.dumps(changed))
        return da.check_screenshot()

    assert problems(lambda s: None) == []
    assert any("panel's text" in p for p in problems(lambda s: s["panel"].__setitem__(1, "held 1 byte")))
    assert any("kv_bytes" in p for p in problems(lambda s: s["stats"].__setitem__("kv_bytes", 1)))
    assert any("cache config" in p for p in problems(lambda s: s["facts"]["config"].__setitem__("window", 768)))
    assert any("sha256" in p for p in problems(lambda s: s.__setitem__("png_sha256", "0" * 64)))


# --- every number in the README's prose is generated (tools/docs/readme_prose.py: FIGURES, ALLOWED) --------------


def _readme_prose():
    sys.path.insert(0, str(TOOLS))
    import readme_prose

    return readme_prose


def test_every_number_in_the_readme_is_generated_or_allowed() -> None:
    # Outside the generated blocks and code, each number README.md shows is a readme_prose.FIGURES figure equal to
    # what the code and benchmarks/results give now, or one of the few ALLOWED non-results (a version, a model's
    # name, a CLI example). `python tools/docs/readme_tables.py --check` says the same (the test above runs it).
    rt = _readme_prose()
    text = README.read_text()
    problems, fixed = rt.readme_problems(text)
    assert problems == [], "\n".join(problems)
    assert fixed == text
    numbers = [m for m in rt.NUMBER.finditer(text)]
    spans = rt.prose_check(text).spans
    assert len(spans) >= 60 and all(any(a <= m.start(1) and m.end(1) <= b for a, b in rt.covered_spans(text, spans))
                                    for m in numbers)


def test_a_number_typed_by_hand_into_the_readme_fails() -> None:
    rt = _readme_prose()
    text = README.read_text()
    anchor = "## How it works\n"
    assert text.count(anchor) == 1

    def typed(extra: str) -> list[str]:
        t = text.replace(anchor, anchor + "\n" + extra, 1)
        return [u.split(": ", 1)[1].split(" in ")[0] for u in rt.uncovered_numbers(t, rt.prose_check(t).spans)]

    # a new claim in prose: each of its numbers is named, bit settings too
    assert typed("On a Mac it decodes 3.7x faster, K3/V2 at 12 GB and 4,096 tokens.\n") == [
        "'3.7x'", "'K3'", "'V2'", "'12'", "'4,096'"]
    # numbers in code, comments and link targets are not prose
    for harmless in ("```bash\ntq-chat x --ctx 3.7k\n```\n", "    tq-chat --bits 3.7\n", "<!-- 3.7x -->\n",
                     "[a page](docs/x-12.md)\n"):
        assert typed(harmless) == [], harmless
    # the allowlist stays short, and each entry is still needed
    assert len(rt.ALLOWED) <= 10
    for pattern, why in rt.ALLOWED:
        assert re.search(pattern, text), f"readme_prose.ALLOWED {pattern!r} ({why}) matches nothing in README.md"


def test_every_prose_figure_is_checked_and_written_back() -> None:
    # Each number of each figure, changed by hand, is named stale (with its figure), and the text --write makes
    # is the README as it is; a list the code no longer matches, or a sentence reworded, is named too.
    rt = _readme_prose()
    text = README.read_text()
    for fig in rt.FIGURES:
        m = rt.figure_pattern(fig.text).search(text)
        assert m, fig.name
        for i in range(1, len(m.groups()) + 1):
            a, b = m.span(i)
            check = rt.prose_check(text[:a] + "999" + text[b:])
            assert len(check.problems) == 1 and f"{fig.name!r} is stale" in check.problems[0], (fig.name, i, check)
            assert "'999'" in check.problems[0] and check.text == text
    # the architectures a count counts must be named beside it (docs/models.md's refused rows)
    assert "rwkv7" in rt.zoo_refused()
    assert rt.prose_check(text.replace("rwkv7, ", "", 1)).problems == [
        "prose figure 'zoo': its paragraph does not name ['rwkv7']"]
    # a sentence reworded: its figure says so rather than passing silently
    assert text.count("are compressed;") == 1
    problems = rt.prose_check(text.replace("are compressed;", "are compressed, and", 1)).problems
    assert len(problems) == 1 and "'zoo'" in problems[0] and "0 times" in problems[0]
    fig = rt.Figure("two", "nothing but Python {}+ and pip", lambda: ("3.10", "3.11"))
    assert "gives 2 numbers" in rt.prose_check(text, [fig]).problems[0]

    def reword():
        raise rt.Reword("the preset decays now")

    assert "the preset decays now" in rt.prose_check(text, [fig._replace(values=reword)]).problems[0]


def test_readme_tables_check_names_a_stale_prose_figure(tmp_path: Path) -> None:
    # end to end: --check on a copy of the README with one figure edited exits 1 naming it; --write fixes it
    readme = tmp_path / "README.md"
    rt = _readme_prose()
    fig = next(f for f in rt.FIGURES if f.name == "bound floor")
    text = README.read_text()
    m = rt.figure_pattern(fig.text).search(text)
    readme.write_text(text[:m.start(1)] + "900" + text[m.end(1):])
    cmd = [sys.executable, str(TOOLS / "readme_tables.py"), "--readme", str(readme), "--docs",
           str(tmp_path / "benchmarks.md"), "--prose"]
    (tmp_path / "benchmarks.md").write_text((REPO / "docs" / "benchmarks.md").read_text())
    proc = subprocess.run([*cmd, "--check"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "prose figure 'bound floor' is stale: the README says '900'" in proc.stderr
    subprocess.run([*cmd, "--write"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rt.figure_pattern(fig.text).search(readme.read_text()).group(1) == m.group(1)


def test_readme_long_context_table_shows_presets_and_settings_within_the_target() -> None:
    # The front page's 16k-and-past tables: the presets, and only those other settings whose every KL shown holds
    # the target at fewer bits than the default and that no other row beats; the rest are in docs/benchmarks.md.
    import json

    sys.path.insert(0, str(TOOLS))
    sys.path.insert(0, str(REPO / "benchmarks"))
    import long_context_settings as lc_settings
    import readme_tables

    res = json.loads((REPO / "benchmarks" / "results" / "long_context.json").read_text())
    text = readme_tables.longest_table(res, "docs/benchmarks.md")
    tables = [block.splitlines() for block in text.split("\n\n") if block.startswith("| cache ")]
    assert tables
    missing, wider, beaten = [], [], []
    for table in tables:
        heads = [h.strip(" |") for h in table[0].split(" | ")]
        kl = [i for i, h in enumerate(heads) if h.startswith("KL")]
        lines = [[c.strip(" |") for c in line.split(" | ")] for line in table[2:]]
        bits = {cells[0]: float(cells[1].rstrip("†*")) for cells in lines}
        for cells in lines:
            if cells[0] not in lc_settings.HEADLINE_PRESETS and any(
                    cells[i] != "–" and float(cells[i]) > readme_tables.TARGET_KL for i in kl):
                missing.append(cells[0])
            # ... and that hold fewer bits than the default: one at no fewer says nothing more to a reader
            if cells[0] not in lc_settings.HEADLINE_PRESETS and bits[cells[0]] >= bits[lc_settings.DEFAULT.name]:
                wider.append(cells[0])
            # ... and that no other row shown beats: at no more bits, no more KL in every cell this one fills
            if cells[0] not in lc_settings.HEADLINE_PRESETS and any(
                    other is not cells and bits[other[0]] <= bits[cells[0]]
                    and all(cells[i] == "–" or (other[i] != "–" and float(other[i]) <= float(cells[i])) for i in kl)
                    for other in lines):
                beaten.append(cells[0])
    assert not missing and not wider and not beaten, (missing, wider, beaten)
    # and the rules do drop something: settings that miss the target were measured past 16k, and a setting of the
    # default's bits and KL (its own row under another name and config) says nothing more
    assert "0.0309" not in text
    import copy

    rows = res["models"]["qwen05"]["rows"]
    twin = copy.deepcopy(next(r for r in rows if lc_settings.canonical_name(r) == lc_settings.DEFAULT.name))
    assert "16384" in twin["texts"]["britannica"]
    twin.update(setting="TQ the default's twin", name="TQ the default's twin",
                config=dict(twin["config"], correct_norms=not twin["config"].get("correct_norms")))
    rows.append(twin)
    assert "the default's twin" not in readme_tables.longest_table(res, "docs/benchmarks.md")
