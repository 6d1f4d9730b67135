"""Every generated table, picture and example in README.md and docs/, made by one command and checked by a test.

    python tools/docs/docs_assets.py                  # make them all again from the code and benchmarks/results/
    python tools/docs/docs_assets.py --check          # exit 1 if a committed one differs from what this would make
    python tools/docs/docs_assets.py --only examples  # one part: tables, pictures, examples, screenshot

tables      README's headline tables, docs/benchmarks.md's tables: tools/docs/readme_tables.py (--write / --check)
pictures    docs/kl_vs_bits.png, docs/peers_vs_bits[_16k].png, docs/memory_vs_context.png and their JSON sidecars: tools/docs/plots.py; --check
            compares the data drawn (points, curves, labels) and the PNG's sha256 with the sidecar, never pixels
examples    the command outputs shown in docs/, between `<!-- generated-example:NAME:start/end -->` markers: the
            commands run again (tq-chat --plan, tq-generate on the demo model, the distortion table from its JSON);
            --check compares their exact text
screenshot  docs/tq-chat.png: tq-chat itself (the README's command), driven headless by Textual's run_test, its SVG
            made a PNG with cairosvg (`pip install cairosvg`) or rsvg-convert. Its sidecar docs/tq-chat.json holds
            what the picture shows (the memory panel's text and the snapshot it is drawn from, the header, the plan
            note, the config): --check draws the panel again from that snapshot with today's code, derives the
            figures again from tq_mlx.planner.memory, the config from today's flags and the plan from today's planner,
            without the model, the converter or matplotlib

The demo model (`smollm2-135m`) is fetched and converted on first use. Machine-dependent figures are pinned: the
plan assumes this machine's memory as it was when the pictures were made (MACHINE), speeds are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

# the docs scripts beside this one, then the benchmarks' modules they render
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)

REPO = common.REPO
DOCS = REPO / "docs"
PARTS = ("tables", "pictures", "examples", "screenshot")

# The machine the examples and the screenshot describe (pinned, so that they do not depend on where they are
# made or checked): the Linux x86_64 machine of benchmarks/results.
MACHINE = dict(available=25_276_510_208, source="physical memory")


@contextlib.contextmanager
def pinned_machine():
    """tq-chat's plan as on MACHINE: available_memory() and memory_source() pinned."""
    import tq_chat.main
    import tq_mlx.planner.machine

    with mock.patch.object(tq_mlx.planner.machine, "available_memory", lambda: MACHINE["available"]), \
            mock.patch.object(tq_chat.main, "memory_source", lambda: MACHINE["source"]):
        yield


# --- examples: command outputs in docs/ ----------------------------------------------------------------------

PLAN_ARGV = ["smollm2-135m", "--dtype", "float32", "--plan"]
GENERATE_ARGV = ["--model", "smollm2-135m", "--prompt", "Write a story about a cat who learns to sail.",
                 "--max-tokens", "24", "--tq-window", "32"]


def _indented(lines: list[str]) -> str:
    return "\n".join(("    " + line).rstrip() for line in lines)


def _shell(prog: str, argv: list[str]) -> str:
    import shlex

    return "$ " + " ".join([prog, *(shlex.quote(a) for a in argv)])


def plan_example() -> str:
    """`tq-chat smollm2-135m --dtype float32 --plan` as it prints on MACHINE."""
    from tq_chat import main as chat

    out = io.StringIO()
    with pinned_machine(), contextlib.redirect_stdout(out):
        rc = chat.main(list(PLAN_ARGV))
    if rc != 0:
        raise SystemExit(f"tq-chat {' '.join(PLAN_ARGV)} exited with {rc}")
    return _indented([_shell("tq-chat", PLAN_ARGV), *local_paths(out.getvalue()).rstrip("\n").splitlines()])


def local_paths(text: str) -> str:
    """This machine's folders as every machine has them: tq-mlx's cache as ~/.cache/tq-mlx, the home folder as ~."""
    from tq_mlx.models.demo import cache_dir

    return text.replace(str(cache_dir()), "~/.cache/tq-mlx").replace(str(Path.home()), "~")


def generate_example() -> str:
    """tq-generate on the demo model: the command and its closing line (the answer and mlx-lm's speed lines,
    which differ from machine to machine, are left out). 24 tokens of a story: no end of turn comes first."""
    from tq_mlx.cli.generate import generate_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = generate_main(list(GENERATE_ARGV))
    lines = (out.getvalue() + err.getvalue()).splitlines()
    summary = [line for line in lines if line.startswith("KV cache:")]
    if rc != 0 or len(summary) != 1:
        raise SystemExit(f"tq-generate {' '.join(GENERATE_ARGV)}: exit {rc}\n{out.getvalue()}{err.getvalue()}")
    return _indented([_shell("tq-generate", GENERATE_ARGV), "…  (the answer, then mlx-lm's speed and memory lines)",
                      *summary])


def distortion_example() -> str:
    """benchmarks/distortion.py's table, from benchmarks/results_distortion.json (what its last run wrote)."""
    import distortion

    rows = json.loads((common.BENCH_DIR / "results_distortion.json").read_text())["rows"]
    return "```\n" + "\n".join([distortion.HEADER, "-" * len(distortion.HEADER),
                                *(distortion.row_text(r) for r in rows)]) + "\n```"


EXAMPLES = {  # name: (the doc it is in, what makes it)
    "tq-chat-plan": (DOCS / "commands.md", plan_example),
    "tq-generate": (DOCS / "commands.md", generate_example),
    "distortion": (DOCS / "benchmarks.md", distortion_example),
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- generated-example:{name}:start -->", f"<!-- generated-example:{name}:end -->"


def example_in(doc: Path, name: str) -> str | None:
    """The text between NAME's markers in doc (None: no markers)."""
    start, end = markers(name)
    text = doc.read_text()
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def examples(write: bool) -> list[str]:
    problems = []
    for name, (doc, make) in EXAMPLES.items():
        shown = example_in(doc, name)
        if shown is None:
            problems.append(f"{doc.relative_to(REPO)}: no {markers(name)[0]} ... {markers(name)[1]}")
            continue
        now = make()
        if now == shown:
            continue
        if write:
            start, end = markers(name)
            text = doc.read_text()
            head, rest = text.split(start, 1)
            doc.write_text(f"{head}{start}\n\n{now}\n\n{end}{rest.split(end, 1)[1]}")
            print(f"wrote the example {name} in {doc.relative_to(REPO)}")
        else:
            problems.append(f"{doc.relative_to(REPO)}: the example {name} differs from what it prints now:\n"
                            f"--- shown\n{shown}\n--- now\n{now}")
    return problems


# --- the app screenshot --------------------------------------------------------------------------------------

SCREEN_ARGV = ["smollm2-135m", "--dtype", "float32"]  # the README's main command
SCREEN_SIZE = (140, 44)
SHOT = DOCS / "tq-chat.png"
# What a measured figure of the panel's snapshot is (kept as measured: speeds and MLX's allocator)
MEASURED = ("active", "peak", "prompt_tps", "decode_tps", "prefill", "weights")


def questions() -> list[str]:
    """The screenshot's conversation: a short question, then a passage long enough to fill the float window and
    compress (the start of the 1911 Britannica article on Shakespeare, 3,600 characters) with a question on it
    (one SmolLM2-135M answers in a sentence, greedy; others sent it into a loop)."""
    from tests.support.texts import britannica_text

    text = britannica_text()[:3600]
    text = text[:text.rindex(". ") + 1]
    return ["What is the capital of France?", f"{text} Question: where was Shakespeare baptized?"]


def panel_lines(stats: dict, plan=None) -> list[str]:
    """The memory panel's text for `stats` (with `plan` under "plan" if the app put its plan there), drawn by the
    app's own MemoryPanel at its fallback width."""
    from rich.console import Console

    from tq_chat.widgets import MemoryPanel

    if plan is not None:
        stats = {**stats, "plan": plan}
    with open(os.devnull, "w") as null:
        console = Console(width=40, record=True, file=null, color_system=None)
        console.print(MemoryPanel().render_stats(stats))
    return [line.rstrip() for line in console.export_text().splitlines()]


def stored_stats(stats: dict) -> dict:
    """The panel's snapshot as JSON: the plan object left out (the check makes it again from the facts)."""
    return json.loads(json.dumps({k: v for k, v in stats.items() if k != "plan"}))


async def _drive(app, asks: list[str]) -> dict:
    """Run `app` headless: wait for the model, ask each question and wait for its answer (the app's state,
    not text), then return what the screen shows."""
    async with app.run_test(size=SCREEN_SIZE) as pilot:
        deadline = time.monotonic() + 1800

        async def until(condition, what: str) -> None:
            while not condition():
                if time.monotonic() > deadline:
                    raise SystemExit(f"the screenshot's app: timed out waiting for {what}")
                await pilot.pause(0.2)

        await until(lambda: app.session is not None, "the model")
        for i, text in enumerate(asks, 1):
            prompt = app.query_one("#prompt")
            prompt.value = text
            prompt.focus()
            await pilot.press("enter")
            await until(lambda: not app.generating and sum(m["role"] == "assistant" for m in app.session.messages)
                        == i, f"answer {i}")
        await pilot.pause(1.0)
        return {"svg": app.export_screenshot(), "stats": dict(app.panel.stats), "subtitle": app.sub_title,
                "notes": [m.source for m in app.query("ChatMessage") if m.role == "notice"],
                "messages": app.session.messages, "tokens": len(app.session.tokens)}


MONO_FONT = "DejaVu Sans Mono"  # a monospace font the converters find (the SVG asks for Fira Code, from the web)


def svg_to_png(svg: str, png: Path) -> None:
    svg = re.sub(r'font-family: (?:"Fira Code"|Fira Code, monospace)', f'font-family: "{MONO_FONT}", monospace', svg)
    try:
        import cairosvg
    except ImportError:
        cairosvg = None
    if cairosvg is not None:
        cairosvg.svg2png(bytestring=svg.encode(), write_to=str(png), output_width=SCREEN_SIZE[0] * 13)
        return
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-w", str(SCREEN_SIZE[0] * 13), "-o", str(png)], input=svg.encode(),
                       check=True)
        return
    raise SystemExit("the screenshot needs cairosvg (pip install cairosvg) or rsvg-convert (apt librsvg2-bin)")


def screenshot_facts(app_settings, model_config: dict) -> dict:
    """What the screenshot's check derives again without the model: the config today's flags give for
    SCREEN_ARGV, the context, and the plan's inputs."""
    return {"config": app_settings.config.to_dict() if app_settings.config else None, "ctx": app_settings.ctx,
            "dtype": app_settings.dtype, "kv_dtype": app_settings.kv_dtype, "model": app_settings.source.name,
            "weights": app_settings.plan.weights, "prefill_step": app_settings.prefill_step_size,
            "model_config": model_config}


def make_screenshot() -> None:
    """Run tq-chat SCREEN_ARGV headless (main() builds it exactly as the command does), ask questions(), write
    docs/tq-chat.png and docs/tq-chat.json."""
    from tq_chat import main as chat
    from tq_chat.chat import ChatApp
    from tq_mlx.models.architectures import load_model_config

    from tq_mlx.prompt_cache.store import FOLDER_ENV

    made = []
    # a fresh prompt-cache folder: the picture shows a first launch, not what an earlier run left on disk
    with (pinned_machine(), mock.patch.object(ChatApp, "run", lambda self, *a, **k: made.append(self)),
          tempfile.TemporaryDirectory() as fresh, mock.patch.dict(os.environ, {FOLDER_ENV: fresh})):
        rc = chat.main(list(SCREEN_ARGV))
        if rc != 0 or not made:
            raise SystemExit(f"tq-chat {' '.join(SCREEN_ARGV)} did not start (exit {rc})")
        app = made[0]
        screen = asyncio.run(_drive(app, questions()))
    svg = screen["svg"]
    svg_to_png(svg, SHOT)
    stats = stored_stats(screen["stats"])
    plan = screen["stats"].get("plan")
    side = {
        "png_sha256": hashlib.sha256(SHOT.read_bytes()).hexdigest(),
        "command": ["tq-chat", *SCREEN_ARGV],
        "size": list(SCREEN_SIZE),
        "facts": screenshot_facts(app.settings, load_model_config(app.settings.source.path)),
        "header": screen["subtitle"],
        "notes": screen["notes"],
        "panel": panel_lines(stats, plan),
        "stats": stats,
        "stats_have_plan": plan is not None,
        "conversation": [m["content"] for m in screen["messages"] if m["role"] == "user"],
        "answers": [m["content"] for m in screen["messages"] if m["role"] == "assistant"],
    }
    SHOT.with_suffix(".json").write_text(json.dumps(side, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {SHOT.relative_to(REPO)} and its .json ({screen['tokens']:,} tokens in the conversation)")


def protected_layers(bits: str) -> int:
    """How many layers a bits summary names with protected (K8) keys: "L0 K8/V4→2 after 6144 · L1-29 K4→3/..."."""
    return sum(len(layer_indices(layers)) for layers, label in re.findall(r"L([\d,-]+) (\S+)", bits)
               if label.startswith("K8"))


def shown_key_widths(bits: str, n_layers: int, config) -> list[int | None]:
    """Each attention layer's key width as a bits summary names it ("L0 K4→3/V4 after 6144 · L1-4 K5→4/..."):
    estimate_kv_bytes's key_widths. A protected (K8) layer is priced at the most the keys take where they widen,
    as protect_layer_bytes counts beyond it; a layer at the configured bits keeps None."""
    from tq_mlx.plan import layer_plan

    widen = layer_plan(config).keys.widen
    widths: list[int | None] = [None] * n_layers
    for layers, label in re.findall(r"L([\d,-]+) (\S+)", bits):
        w = int(re.match(r"K(\d+)", label).group(1))
        if w == config.key_bits:
            continue
        if label.startswith("K8"):
            w = widen.max_bits if widen is not None else None
        for i in layer_indices(layers):
            widths[i] = w
    return widths


def layer_indices(spec: str) -> list[int]:
    """The layers a bits summary's "L0-2,5" names: [0, 1, 2, 5]."""
    out = []
    for span in spec.split(","):
        first, _, last = span.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def expected_stats(facts: dict, stats: dict) -> dict:
    """The panel's KV figures for the screenshot's context, from tq_mlx.planner.memory's and tq_mlx.layout's formulas:
    what the live snapshot (the caches' own nbytes) must have shown."""
    from tq_mlx import TurboQuantConfig
    from tq_mlx.models.architectures import attention_layout
    from tq_mlx.layout import token_layout
    from tq_mlx.planner.memory import FLOAT_BYTES, estimate_kv_bytes, mlx_lm_kv_bytes, protect_layer_bytes

    config = TurboQuantConfig(**facts["config"])
    mc, tokens, dtype = facts["model_config"], stats["context_tokens"], stats["kv_dtype"]
    lay = attention_layout(mc)
    parts = token_layout(config, tokens)
    return {
        "kv_bytes": estimate_kv_bytes(mc, tokens, config, dtype=dtype,
                                      key_widths=shown_key_widths(stats["bits"], len(lay.full_layers), config))
        + protected_layers(stats["bits"]) * protect_layer_bytes(mc, tokens, config, dtype=dtype),
        "mlx_lm_bytes": len(lay.full_layers) * mlx_lm_kv_bytes(tokens, lay.n_kv_heads, lay.head_dim, lay.v_head_dim,
                                                               FLOAT_BYTES[dtype]),
        "compressed_tokens": parts.compressed,
        "float_tokens": parts.sinks + parts.window,
        "sinks": config.sinks,
        "window": config.window,
        "ctx": facts["ctx"],
    }


def check_screenshot() -> list[str]:
    """docs/tq-chat.png against what the app would show now, from its sidecar, without running the model."""
    from tq_chat import main as chat
    from tq_chat.plan import make_plan
    from tq_mlx import TurboQuantConfig
    from tq_mlx.models.architectures import attention_layout
    from tq_mlx.cli.flags import config_from_args

    side_path = SHOT.with_suffix(".json")
    if not SHOT.exists() or not side_path.exists():
        return [f"{SHOT.relative_to(REPO)} or its .json is missing"]
    side = json.loads(side_path.read_text())
    facts, stats = side["facts"], side["stats"]
    problems = []

    def differs(what: str, shown, now) -> None:
        if shown != now:
            problems.append(f"docs/tq-chat.png: {what} differs from now:\n  shown {shown!r}\n  now   {now!r}")

    differs("the PNG's sha256 (docs/tq-chat.json describes another picture)", side["png_sha256"],
            hashlib.sha256(SHOT.read_bytes()).hexdigest())
    differs("the command", side["command"], ["tq-chat", *SCREEN_ARGV])
    # the settings today's command line gives
    args = chat.build_parser().parse_args(list(SCREEN_ARGV))
    config = config_from_args(args)
    # a field the sidecar predates had its default then (TurboQuantConfig.from_dict): the same config
    try:
        shown = facts["config"] and TurboQuantConfig.from_dict(facts["config"])
    except ValueError as e:  # a config today's rules refuse cannot be the command's
        shown = f"refused: {e}"
    differs("the cache config of the command", shown, config)
    trained = attention_layout(facts["model_config"]).max_context
    differs("the context", facts["ctx"], args.ctx or chat.default_ctx(trained))
    # the panel, drawn again from the snapshot (and today's plan) by today's code; its KV figures derived again
    from tq_chat import chat as app_chat

    settings = screenshot_settings(facts, config, make_plan)
    differs("the memory panel's text", side["panel"],
            panel_lines(stats, settings.plan if side.get("stats_have_plan") else None))
    if "planned_peak" in stats:
        differs("the panel's planned peak", stats["planned_peak"], settings.plan.needed)
    try:
        expected = expected_stats(facts, stats)
    except Exception as e:  # noqa: BLE001 (a snapshot that no longer has what the figures need is stale too)
        problems.append(f"docs/tq-chat.png: cannot derive its panel's figures again: {type(e).__name__}: {e}")
    else:
        for key, value in expected.items():
            differs(f"the panel's {key}", stats.get(key), value)
    # the header and the plan note, made again from the settings and today's planner
    if hasattr(app_chat, "subtitle"):
        differs("the header", side["header"], app_chat.subtitle(settings, stats.get("kv_dtype")))
    if hasattr(app_chat, "plan_note"):
        differs("the plan note", side["notes"][0], app_chat.plan_note(settings))
    return problems


def screenshot_settings(facts: dict, config, make_plan):
    """The ChatSettings tq-chat built for the screenshot, its plan made again by today's planner on MACHINE."""
    from tq_chat.chat import ChatSettings
    from tq_chat.models import ModelSource

    plan = make_plan(facts["model"], facts["model_config"], facts["weights"], facts["ctx"], config,
                     MACHINE["available"], MACHINE["source"], dtype=facts["dtype"], prefill_step=facts["prefill_step"])
    return ChatSettings(source=ModelSource(facts["model"], path=Path(facts["model"])), ctx=facts["ctx"],
                        config=config, dtype=facts["dtype"], kv_dtype=facts["kv_dtype"],
                        prefill_step_size=facts["prefill_step"], plan=plan)


# --- all of it -----------------------------------------------------------------------------------------------


def tables(write: bool) -> list[str]:
    script = Path(__file__).resolve().parent / "readme_tables.py"
    proc = subprocess.run([sys.executable, str(script), "--write" if write else "--check"], cwd=REPO,
                          capture_output=True, text=True)
    print(proc.stdout, end="")
    return [] if proc.returncode == 0 else [f"tables: {proc.stdout}{proc.stderr}".strip()]


def pictures(write: bool) -> list[str]:
    import plots

    inputs = plots.load_inputs()
    if write:
        for name in plots.FIGURES:
            print(f"wrote {plots.draw(name, inputs, DOCS).relative_to(REPO)} and its .json")
        return []
    return [p for name in plots.FIGURES for p in plots.check(name, inputs)]


def run(parts: list[str], write: bool) -> list[str]:
    problems = []
    for part in parts:
        if part == "tables":
            problems += tables(write)
        elif part == "pictures":
            problems += pictures(write)
        elif part == "examples":
            problems += examples(write)
        elif write:
            make_screenshot()
        else:
            problems += check_screenshot()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything committed is stale")
    ap.add_argument("--only", choices=PARTS, action="append", help="one part (repeatable; default: all)")
    args = ap.parse_args(argv)
    if argv is None:
        from tq_mlx.blas import use_openblas

        use_openblas("docs_assets.py")  # the examples and the screenshot run the demo model
    problems = run(args.only or list(PARTS), write=not args.check)
    for p in problems:
        print(p)
    if problems:
        print("stale: python tools/docs/docs_assets.py makes them again")
        return 1
    print("up to date" if args.check else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
