"""The README and docs/ say only what is true, and stay generated.

Every `mlx_lm.*` / `tq_mlx.*` name they mention exists; the README's Python runs as written (a tiny model stands in
for the hub's); what the README says about prompt-cache files holds in a fresh process; every local link and
anchor resolves; the generated tables match benchmarks/results/*.json; benchmarks/plots.py draws the pictures from
that JSON.
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
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "DEFAULTS.md"]

NAME = re.compile(r"(?<![\w./-])((?:mlx_lm|tq_mlx)(?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT = re.compile(r"^\s*from ((?:mlx_lm|tq_mlx)[\w.]*) import ([\w, ]+)$", re.M)
# tq_mlx's modules named on their own in backticks, as the design notes do: `packing.unpack_lookup`
SUBMODULE = re.compile(r"`((?:codebook|rotation|packing|quantizer|config|stream|attention|kernels|cache|memory|"
                       r"integration|batch|blas|cli)\.(?!py\b)[A-Za-z_]\w*)")
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
    names = set(NAME.findall(text)) | {f"tq_mlx.{n}" for n in SUBMODULE.findall(text)}
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
        "tq_mlx.TurboQuantMSE", "tq_mlx.Nope", "tq_mlx.packing.unpack_lookup"}


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


def test_generated_tables_match_the_results() -> None:
    # docs/benchmarks.md's tables and the README's headline tables, rendered again from benchmarks/results/*.json
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "readme_tables.py"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plots_draw_from_the_results(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (in the test extra, so this test runs wherever the tests do: no skip)

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plots.py"), "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("kl_vs_bits.png", "memory_vs_context.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
        assert (REPO / "docs" / name).exists(), f"docs/{name}: run python benchmarks/plots.py"
    sys.path.insert(0, str(REPO / "benchmarks"))
    import json

    import long_context
    import plots

    # every setting and peer of the long-context JSON measured at 8k is a point, the default among them
    lc = json.loads((REPO / "benchmarks" / "results" / "long_context.json").read_text())
    names = {p["name"] for p in plots.kl_points(lc)}
    assert long_context.DEFAULT.name in names and long_context.DEFAULT_MEAN.name in names
    assert "TQ K4/V3 (the default until 2026-11-26)" in names and "peer: mlx-vlm TurboQuant 4-bit" in names
    rows = [r for r in lc["models"]["smollm2"]["rows"] if r["kind"] != "float"
            and any("8192" in c for c in r["texts"].values())]
    assert len(names) == len(rows)
