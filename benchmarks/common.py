"""What the benchmark scripts share: run metadata, markdown tables, bits per value, and where results are written.

Each script prints its table, then writes benchmarks/results/<name>.json (rows + metadata) and
benchmarks/results/<name>.md (the same table with the date and machine), which tools/docs/readme_tables.py copies
into docs/benchmarks.md (and a headline of them into the README). What attention sees is read through one spy
(attention_spy, wrap_attention).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"

# `python benchmarks/x.py` from anywhere: tests.support (real models, texts) and the tq_mlx beside these scripts,
# first on the path before anything imports tq_mlx, so a checkout measures its own code whatever is installed.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tq_mlx.integration import tune_malloc  # noqa: E402


def backend() -> str:
    """'metal' on Apple silicon with a GPU build, else 'cpu'."""
    try:
        if mx.metal.is_available():
            return "metal"
    except AttributeError:
        pass
    return "cpu"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


_SAID: set[str] = set()


def code_version() -> dict:
    """{"commit", "dirty", "library"} of this run, for every results file (metadata) and checkpoint (caches.py).

    commit: HEAD's short hash, None where git cannot answer for REPO (a copy of the tree without .git, say: git's
    reason is printed once, as results written that way once carried a silent null); dirty: whether any tracked
    file differs from HEAD (None with no commit); library: library_fingerprint(), which a copy of the tree has too."""
    try:
        head, status = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
        commit = head.stdout.strip() if head.returncode == 0 else None
        why = (head.stderr.strip().splitlines() or [f"git exited {head.returncode}"])[-1] if commit is None else None
    except OSError as e:
        commit, status, why = None, None, f"{type(e).__name__}: {e}"
    if why and why not in _SAID:
        _SAID.add(why)
        print(f"benchmarks: no commit recorded for {REPO} ({why})", file=sys.stderr, flush=True)
    dirty = None if commit is None or status.returncode else bool(status.stdout.strip())
    return {"commit": commit, "dirty": dirty, "library": library_fingerprint()}


def fingerprint(package: Path, kernels: dict[str, str]) -> str:
    """sha256 over a package's *.py sources (by path inside it) and the Metal kernel sources (by name)."""
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(f"{f.relative_to(package).as_posix()}\0".encode() + f.read_bytes() + b"\0")
    for name in sorted(kernels):
        h.update(f"{name}.metal\0{kernels[name]}\0".encode())
    return h.hexdigest()


@functools.cache
def library_fingerprint() -> str:
    """The fingerprint of the library code this process runs: tq_mlx's sources where it was imported from and the
    Metal sources its kernels were built from, taken once (the first call; files edited later are not this run's)."""
    import tq_mlx
    from tq_mlx.attention import launch

    return fingerprint(Path(tq_mlx.__file__).resolve().parent, launch.SOURCES)


# Every benchmark process runs with the allocator setting the command-line tools use (tq_mlx.integration.
# tune_malloc), for every cache it compares, so that no path pays a page fault per transient buffer.
MALLOC_TUNED = tune_malloc()
library_fingerprint()  # taken as the process starts, beside its imports of tq_mlx


def metadata(**extra: Any) -> dict:
    """Date, machine and software of this run (every results file carries it)."""
    import mlx_lm

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.system()} {platform.machine()}, {_cpu_name()}, {os.cpu_count()} cores"
        + (f", {mem / 2**30:.0f} GB" if mem else ""),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "backend": backend(),
        "device": str(mx.default_device()),
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
        "malloc_tuned": MALLOC_TUNED,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **code_version(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    meta.update(extra)
    return meta


def meta_line(meta: dict) -> str:
    """One line for the top of a markdown table: when, where, what software."""
    blas = ", OpenBLAS" if meta.get("openblas_preloaded") else ""
    return (
        f"{meta['date']} · {meta['machine']} · {meta['backend']}{blas} · mlx {meta['mlx']}, "
        f"mlx-lm {meta['mlx_lm']} · `{meta['command']}`"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; align is one of 'l'/'r' per column (default: first left, rest right)."""
    align = (align or "l" + "r" * (len(headers) - 1))[: len(headers)]
    cells = [[str(c) for c in r] for r in rows]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(":--" if a == "l" else "--:" for a in align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(out)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """The same table padded for a terminal."""
    align = (align or "l" + "r" * (len(headers) - 1))[: len(headers)]
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(vals):
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(vals, widths, align))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def render(title: str, meta: dict, headers, rows, notes: Sequence[str], align: str | None = None, extra: str = "") -> str:
    """A results section: heading, when/where line, the table, its notes."""
    md = f"### {title}\n\n{meta_line(meta)}\n\n{markdown_table(headers, rows, align)}\n\n"
    md += "\n".join(f"* {n}" for n in notes)
    return md + (f"\n\n{extra}" if extra else "")


def fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    """Numbers for tables; None and NaN print as '–'."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}{suffix}"


def bits_per_value(nbytes: float, tokens: int, geometry: Sequence[int]) -> float:
    """The one bits/value accounting of every table (float16 = 16): nbytes · 8 / (tokens · attention layers · kv
    heads · head_dim · 2), geometry = (attention layers, kv heads, head_dim)."""
    n_att, heads, dim = geometry
    return nbytes * 8 / (tokens * n_att * heads * dim * 2)


def write_results(name: str, payload: dict, markdown: str, out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write <out_dir>/<name>.json and <name>.md (default benchmarks/results/) and return the two paths."""
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / f"{name}.json", out / f"{name}.md"
    jp.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")
    mp.write_text(markdown.rstrip() + "\n")
    return jp, mp


def write_probe(results: dict, out_dir: str | os.PathLike, name: str) -> Path:
    """An experiments/ probe's results (per_model's, with what the probe adds) as <out_dir>/<name>.json; says where."""
    out = Path(out_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out} ({results['seconds']:.0f} s)")
    return out


def write_cells(path: Path, results: dict, key: Callable[[dict], tuple]) -> None:
    """Write results (its "cells": what this run measured so far) to path, keeping the cells already there that it
    has not run again (the same key(cell)): a probe writes after each cell, so a run that stops keeps what it got."""
    ran = {key(c) for c in results["cells"]}
    earlier = json.loads(path.read_text())["cells"] if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**results, "cells": [c for c in earlier if key(c) not in ran] + results["cells"]},
                               indent=1))


def per_model(keys: str, names: dict, run) -> dict:
    """A per-model benchmark's results: {"meta", "models": {key: run(key)}, "seconds"} for the comma-separated
    keys, each model named (names[key][0]) as it starts."""
    t0 = time.perf_counter()
    results = {"meta": metadata(), "models": {}}
    for key in keys.split(","):
        print(f"{names[key][0]}:", flush=True)
        results["models"][key] = run(key)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    return results


def _jsonable(o):
    if isinstance(o, (mx.array,)):
        return o.tolist()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


class Budget:
    """A wall-clock budget: `left()` seconds remain; `over()` once spent (None = unlimited)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def over(self) -> bool:
        return self.left() <= 0


# --- peers ---------------------------------------------------------------------------------------------------

MLX_VLM = "mlx-vlm==0.7.10"
TQ_FULL = "turboquant-mlx-full==0.30.0"


def _load_peer(requirement: str, packages: dict[str, str], module: str, smoke: Callable[[Any], None]):
    """(module, version, None) or (None, None, one-line reason `requirement` cannot run here).

    The distribution (a wheel or an sdist) is `pip download --no-deps`-ed into the tq-mlx cache and unpacked there,
    never installed or built. `packages` ({dotted name: folder in the distribution}) are made empty packages over
    their folders, so their __init__s (which pull in the rest of the distribution and its requirements) never run,
    and only `module` and what it imports are loaded: the project's environment stays as it is. `smoke(module)` runs
    a prefill and a decode step on this back end; whatever fails is the reason.
    """
    import importlib
    import tarfile
    import types
    import zipfile

    try:
        from tests.support.real_models import cache_dir, pip_download

        (dist,) = pip_download([requirement], cache_dir() / "downloads")
        peers = cache_dir() / "peers"
        if dist.suffix == ".whl":
            root = peers / dist.stem
        else:  # an sdist unpacks into its one top folder
            root = peers / dist.name.removesuffix(".tar.gz")
        parent, _, leaf = module.rpartition(".")
        if not (root / packages[parent] / f"{leaf}.py").exists():
            if dist.suffix == ".whl":
                with zipfile.ZipFile(dist) as zf:
                    zf.extractall(root)
            else:
                with tarfile.open(dist) as tf:
                    tf.extractall(peers, filter="data")
        for name, sub in packages.items():
            if name not in sys.modules:
                pkg = types.ModuleType(name)
                pkg.__path__ = [str(root / sub)]
                sys.modules[name] = pkg
        mod = importlib.import_module(module)
        smoke(mod)
        return mod, requirement.split("==")[1], None
    except Exception as e:  # noqa: BLE001 (any failure is the reason it cannot run here)
        return None, None, f"{requirement} cannot run here: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"


def load_mlx_vlm_turboquant():
    """(mlx_vlm.turboquant module, version, None) or (None, None, one-line reason it cannot run here).

    Only mlx_vlm/turboquant.py and mlx_vlm/models/cache.py are loaded from the wheel (mlx_vlm/__init__ pulls in
    transformers, Pillow, opencv, fastapi, ...).
    """

    def smoke(mod):
        c = mod.TurboQuantKVCache(bits=4)
        k = mx.random.normal((1, 2, 8, 64))
        ks, vs = c.update_and_fetch(k, k)
        mx.eval(c.dequantize(ks, vs))
        ks, vs = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
        mx.eval(c.decode_attention(mx.random.normal((1, 4, 1, 64)), keys_state=ks, values_state=vs, scale=0.125, mask=None))

    return _load_peer(MLX_VLM, {"mlx_vlm": "mlx_vlm"}, "mlx_vlm.turboquant", smoke)


def load_turboquant_mlx_full():
    """(turboquant_mlx.layers.polar_kv_cache module, version, None) or (None, None, one-line reason it cannot run
    here).

    The sdist's root is the package `turboquant_mlx` (pyproject's package-dir maps it to "."); its __init__s import
    config, the weight layers, kernels, ... (the distribution requires transformers), so only
    layers/polar_kv_cache.py and the three core modules it imports (codebook, rotation, packing: mlx alone) are loaded.
    """

    def smoke(mod):  # at its recommended K8/V3
        c = mod.TurboQuantKVCache(k_bits=8, v_bits=3)
        k = mx.random.normal((1, 2, 8, 64))
        ks, vs = c.update_and_fetch(k, k)
        mx.eval(ks, vs)
        ks, vs = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
        q = mx.random.normal((1, 4, 1, 64))
        out = mx.fast.scaled_dot_product_attention(q, mx.repeat(ks, 2, axis=1).astype(q.dtype),
                                                   mx.repeat(vs, 2, axis=1).astype(q.dtype), scale=0.125)
        mx.eval(out)
        if ks.shape != (1, 2, 9, 64) or not (mx.abs(ks[:, :, :8] - k).max() < 0.1).item():
            raise RuntimeError(f"its K8 keys do not reproduce the keys stored (shape {ks.shape})")

    packages = {"turboquant_mlx": "", "turboquant_mlx.core": "core", "turboquant_mlx.layers": "layers"}
    return _load_peer(TQ_FULL, packages, "turboquant_mlx.layers.polar_kv_cache", smoke)


# --- the attention spy -------------------------------------------------------------------------------------------


def wrap_attention(module, around) -> Callable[[], None]:
    """Route the attention of a model module's layers through `around`: they call the module's by-name
    `scaled_dot_product_attention` (mlx-lm's, or tq_mlx.hook's stand-in once the hook is installed), which
    becomes one calling around(attend, queries, keys, values, cache, scale, mask, sinks), where
    attend(queries, keys, values, cache, scale, mask, sinks) is the function it wrapped. The wrapper keeps `around`
    as its attribute of that name. Returns the undo, which puts the wrapped function back."""
    wrapped = module.scaled_dot_product_attention

    def attend(queries, keys, values, cache, scale, mask, sinks=None):
        return wrapped(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        return around(attend, queries, keys, values, cache, scale, mask, sinks)

    sdpa.around = around
    module.scaled_dot_product_attention = sdpa

    def undo() -> None:
        module.scaled_dot_product_attention = wrapped

    return undo


@contextlib.contextmanager
def attention_spy(model, around):
    """wrap_attention on the module of the model's class (where its attention layers look the function up) while
    the block runs: around(attend, queries, keys, values, cache, scale, mask, sinks) sees every attention call."""
    undo = wrap_attention(sys.modules[type(model).__module__], around)
    try:
        yield
    finally:
        undo()
