"""Every figure in benchmarks/DEFAULTS.md, from the results file it names.

DEFAULTS.md writes each figure as its value followed by an HTML comment that says where it comes from (GitHub
shows the value alone):

    0.0079<!-- lc qwen05 default britannica 16k kl -->

and --check recomputes each from that results file, names a figure typed differently (or a reference that finds
nothing), and names every number of the text that is neither a referenced figure nor one of a few ALLOWED labels (a
figure typed by hand); --write puts each figure's value in. A heading's "field = value" is checked against
TurboQuantConfig(). tests/test_defaults_doc.py runs --check.

References (words split as a shell would, so a quoted name holds spaces):

    lc[:FILE] MODEL SETTING TEXT CTX FIELD    a long_context.py row: FILE long_context (default), value_error,
                                               chunk2048 or prefill2048; SETTING a long_context.py --settings key or spec
                                               ("default", "k4v4w768b128d6144k3v3n8rqe0.1"), "+field=value" after
                                               it for fields a spec cannot spell ("k4v3+center_values=True"); the
                                               row is the one whose config is that setting's; TEXT - is every
                                               text, CTX - is 32k (bits only). FIELD:
                                                 kl, kl_se, kl_max, ppl   that cell's
                                                 dppl                     ppl_delta_pct, signed, with %
                                                 dppl_se                  its standard error, with %
                                                 bits                     bits/value at CTX, float parts in float16,
                                                                          every layer at the configured bits
                                                 bitsw                    the same with the widths the row's layers
                                                                          took on TEXT (protected and widened keys,
                                                                          values by their error), as the README's †
                                                 bits_real                bits/value the run held at CTX, float
                                                                          parts in the run's float32
                                                 K5, K4.5, V2, ...        how many layers took that width on TEXT
                                                 protected                the layers whose keys protected themselves
    needle MODEL SETTING LENGTH                the needles that setting found in a LENGTH haystack: "2/3"
    q MODEL NAME FIELD                         a quality.py row (the 1k-token study) by its setting's name; FIELD
                                               ppl, dppl, top1, bits_32k, ...
    json FILE STEP... [count=X | avg] [fmt=SPEC]
                                               a value in FILE.json (benchmarks/results, then experiments/results):
                                               each STEP a key, a list index, or the list item with key=value (&
                                               for several); count=X counts the items equal to X, avg averages them
    config NAME                                TurboQuantConfig()'s field NAME, PRESET.NAME a preset's (quality,
                                               compact), or a constant of tq_mlx.config (DECAY_AFTER)

    python tools/docs/defaults_figures.py            # print each figure and its reference
    python tools/docs/defaults_figures.py --check    # exit 1 if a figure differs from its results file
    python tools/docs/defaults_figures.py --write    # put each figure's value in
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(REPO)]  # the benchmarks' modules, and the tq_mlx of this checkout

DOC = BENCHMARKS / "DEFAULTS.md"
RESULT_DIRS = (BENCHMARKS / "results", REPO / "experiments" / "results")

# A figure: its value, then the comment naming its source. group 1: the value as written.
FIGURE = re.compile(r"([-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?%?|none)"
                    r"<!-- ((?:lc|needle|q|json|config)\b(?:(?!-->).)*?) -->")
# Numbers that are labels, not results (keep this short: a measured figure takes a reference).
ALLOWED = [
    (r"\b(?:SmolLM2-135M|Qwen2\.5-Coder-[\d.]+B|Llama-3\.1-8B)(?:-Instruct)?", "a model's name"),
    (r"\b20\d\d-\d\d-\d\d\b", "a date"),
    (r"\bissues? \d+(?:(?:, | and )\d+)*", "an issue's number"),
    (r"(?<![\w.])[KV]\d+(?:\.\d+)?(?:\+qjl)?(?:→\d+(?:\.\d+)?)?(?:/V\d+(?:\.\d+)?(?:→\d+)?)?(?![\d.])",
     "a bit width: K4/V4, K6→5"),
    (r"(?<![\w.])\d+k(?!\w)", "a context length: 16k"),
    (r"\bhead_dim \d+", "a model's head size"),
    (r"\b[1-9]\d*-bit\b", "a code's width in words"),
    (r"\b\d+-token (?:window|block)", "a setting's window or block"),
    (r"\bwindows \d+(?: / \d+)+", "the windows a sweep measured"),
    (r"`(?:key|key_output|value|value_output)_error` 0\.\d+", "a setting's target"),
    (r"the 1911 article", "the text's edition"),
    (r"\b(?:past|after) \d{4}\b", "a setting's decay age"),
    (r"\btop-1\b", "the top-1 agreement's name"),
    (r"depths 0\.1, 0\.5 and 0\.9", "the needle depths"),
    (r"KL(?: ≤)? 0\.0[13]\b|\|ΔPPL\|(?: ≤| misses)? 1%", "the targets of issues 14, 23 and 34"),
    (r"3\.2 bits/value on Qwen2\.5-Coder-1\.5B, 4\.0 on", "the bit goals of issue 34"),
    (r"4\.0 at 8k and 3\.5 at 32k on Qwen2\.5-Coder-1\.5B, 4\.0 at 32k on", "the bit goals of issue 53"),
]
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
FENCED = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
INLINE = re.compile(r"`[^`]+`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")


class Problem(Exception):
    """A reference that names nothing in its results file, or a figure the file does not hold."""


@functools.cache
def load(stem: str) -> dict:
    for folder in RESULT_DIRS:
        path = folder / f"{stem}.json"
        if path.exists():
            return json.loads(path.read_text())
    raise Problem(f"no results file {stem}.json in " + " or ".join(str(d.relative_to(REPO)) for d in RESULT_DIRS))


def ctx_tokens(word: str) -> int:
    return int(word[:-1]) * 1024 if word.endswith("k") else int(word)


def kl_format(x: float) -> str:
    x = max(x, 0.0)  # float rounding can make an exact match a hair negative
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}" if x < 1 else f"{x:.2f}"


def pct_format(x: float) -> str:
    return f"{x:+.2f}%"


# --- long_context.py rows -----------------------------------------------------------------------------------------


def wanted_setting(word: str):
    """The Setting a SETTING word names, its config with the +field=value overrides."""
    import dataclasses

    import long_context_settings as lc

    key, *over = word.split("+")
    s = lc.parse_setting(key) if (key in lc.BY_KEY or lc.SPEC.match(key) or key.startswith(("rot", "peer"))) else None
    if s is None:
        raise Problem(f"unknown setting {key!r}")
    if over:
        if s.kind != "tq":
            raise Problem(f"{word!r}: only TurboQuant settings take +field=value")
        fields = {}
        for item in over:
            name, _, value = item.partition("=")
            fields[name] = json.loads(value.replace("True", "true").replace("False", "false").replace("None", "null"))
        s = dataclasses.replace(s, config=dataclasses.replace(s.config, **fields))
    return s


def lc_row(stem: str, model: str, setting: str) -> tuple[dict, dict]:
    """(the model's results, the one row of `setting`) in <stem>.json."""
    import long_context_settings as lc

    res = load(stem)
    if model not in res["models"]:
        raise Problem(f"{stem}.json has no model {model!r}")
    m = res["models"][model]
    s = wanted_setting(setting)
    if s.kind == "tq":
        want = s.config.to_dict()
        rows = [r for r in m["rows"]
                if r.get("kind") == "tq" and r.get("config") and lc._same_config(r["config"], want)]
    else:
        rows = [r for r in m["rows"] if lc.canonical_name(r) == s.name]
    if len(rows) != 1:
        raise Problem(f"{stem}.json has {len(rows)} rows of {setting!r} for {model}, not one")
    return m, rows[0]


def lc_value(stem: str, model: str, setting: str, text: str, ctx: str, field: str) -> str:
    import long_context_settings as lc

    m, row = lc_row(stem, model, setting)
    cells = row["texts"].get(text) if text != "-" else None
    if text != "-" and cells is None:
        raise Problem(f"{stem}.json: {model} {setting} has no {text!r} cells")
    if field in ("bits", "bitsw"):
        c = lc.LONG if ctx == "-" else ctx_tokens(ctx)
        bits = row["bits"].get(str(c), row.get("bits_32k") if c == lc.LONG else None)
        if bits is None:
            raise Problem(f"{stem}.json: {model} {setting} has no bits at {c}")
        if field == "bitsw":
            one = dict(row, texts={text: cells}) if cells is not None else row
            bits += lc.protection_bits(one, m["geometry"], c)
        return f"{bits:.2f}"
    if field == "protected":
        return ", ".join(map(str, cells.get("protected_layers", []))) or "none"
    width = re.fullmatch(r"([KV])(\d+(?:\.5)?)", field)
    if width:
        part = "key_widths" if width[1] == "K" else "value_widths"
        return str(sum(b == float(width[2]) for _, b in cells.get(part, [])))
    cell = cells.get(str(ctx_tokens(ctx))) if cells is not None else None
    if not isinstance(cell, dict):
        raise Problem(f"{stem}.json: {model} {setting} has no {text} cell at {ctx}")
    key = {"dppl": "ppl_delta_pct", "dppl_se": "ppl_delta_pct_se"}.get(field, field)
    if key not in cell:
        raise Problem(f"{stem}.json: {model} {setting} {text} {ctx} has no {key!r}")
    x = cell[key]
    if field == "dppl":
        return pct_format(x)
    if field == "dppl_se":
        return f"{x:.2f}%"
    if field.startswith("kl"):
        return kl_format(x)
    return f"{x:.2f}"


# --- quality.py rows, any JSON value, the config --------------------------------------------------------------------


def needle_value(model: str, setting: str, length: str) -> str:
    """How many of the depths probed in a `length` haystack the setting found, as "hits/probes"."""
    import long_context_settings as lc

    m = load("long_context")["models"][model]
    if setting == "float":
        names = {lc.FLOAT.name}
    else:
        _, row = lc_row("long_context", model, setting)
        names = {row["setting"], lc.canonical_name(row)}
    probes = [p for p in m.get("needles", []) if p["setting"] in names and p["length"] == ctx_tokens(length)
              and "hit" in p]
    if not probes:
        raise Problem(f"long_context.json: no {setting} needles for {model} at {length}")
    return f"{sum(p['hit'] for p in probes)}/{len(probes)}"


def q_value(model: str, name: str, field: str) -> str:
    rows = [r for r in load("quality")["models"][model]["rows"] if r["setting"] == name]
    if len(rows) != 1:
        raise Problem(f"quality.json has {len(rows)} rows named {name!r} for {model}")
    x = rows[0].get({"dppl": "ppl_delta_pct"}.get(field, field))
    if x is None:
        raise Problem(f"quality.json: {model} {name!r} has no {field!r}")
    if field == "dppl":
        return f"{x:+.1f}%" if abs(x) < 1000 else f"{x:+,.0f}%"
    if field in ("top1", "top5", "attn_cos"):
        return f"{x:.3f}"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


def _item(x, step: str):
    if isinstance(x, list):
        if "=" in step:
            conds = [c.split("=", 1) for c in step.split("&")]
            found = [v for v in x if all(str(v.get(k)) == want for k, want in conds)]
            if len(found) != 1:
                raise Problem(f"{len(found)} items match {step!r}, not one")
            return found[0]
        return x[int(step)]
    if step not in x:
        raise Problem(f"no key {step!r} (there are {sorted(x)[:8]})")
    return x[step]


def json_value(stem: str, *words: str) -> str:
    x, spec = load(stem), None
    for word in words:
        name, _, arg = word.partition("=")
        if name == "count":
            x = sum(v == json.loads(arg) for v in x)
        elif word == "avg":
            x = sum(x) / len(x)
        elif name == "fmt":
            spec = arg
        else:
            x = _item(x, word)
    if isinstance(x, (list, dict)) or x is None:
        raise Problem(f"{stem}.json {' '.join(words)} is not a number")
    if spec:
        return format(x, spec)
    return str(x) if isinstance(x, int) else f"{x:.3f}"


def config_value(name: str) -> str:
    from tq_mlx import TurboQuantConfig, config
    from tq_mlx.quant.quantizer import format_bits

    preset, _, field = name.rpartition(".")
    if not preset and hasattr(config, name) and name.isupper():
        x = getattr(config, name)
    else:
        c = TurboQuantConfig.preset(preset) if preset else TurboQuantConfig()
        x = getattr(c, field)
    if isinstance(x, float):
        return format_bits(x) if x == int(x) else f"{x:g}"
    return str(x)


def value(ref: str) -> str:
    """The figure a reference names, as DEFAULTS.md writes it."""
    words = shlex.split(ref)
    kind, args = words[0], words[1:]
    try:
        if kind.startswith("lc"):
            stem = kind.partition(":")[2] or "long_context"
            if len(args) != 5:
                raise Problem("lc takes MODEL SETTING TEXT CTX FIELD")
            return lc_value(stem, *args)
        if kind == "needle":
            return needle_value(*args)
        if kind == "q":
            return q_value(*args)
        if kind == "json":
            return json_value(*args)
        if kind == "config":
            return config_value(*args)
    except (KeyError, IndexError, TypeError, ValueError, SystemExit) as e:
        raise Problem(f"{type(e).__name__}: {e}") from None
    raise Problem(f"unknown source {kind!r}")


# --- the check ------------------------------------------------------------------------------------------------------


class Check(NamedTuple):
    problems: list[str]
    text: str  # the text with every figure as its results file gives it
    figures: int


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def indented_code(text: str) -> list[tuple[int, int]]:
    """The spans of markdown's indented code blocks: lines of 4 spaces after a blank line, and the lines on."""
    spans = []
    pos, prev_blank, in_code = 0, True, False
    for line in text.splitlines(keepends=True):
        in_code = line.startswith("    ") and (prev_blank or in_code)
        if in_code:
            spans.append((pos, pos + len(line)))
        prev_blank, pos = not line.strip(), pos + len(line)
    return spans


def covered(text: str) -> list[tuple[int, int]]:
    """Where a number needs no reference: code (fenced, indented, inline), comments, link targets, ALLOWED."""
    spans = indented_code(text)
    allowed = (re.compile(p.replace(" ", r"\s+")) for p, _ in ALLOWED)  # a space: any line break too
    for pattern in (FENCED, INLINE, COMMENT, LINK_TARGET, *allowed):
        spans += [m.span() for m in pattern.finditer(text)]
    return spans


# In a heading, "field = value" names a default: checked against TurboQuantConfig() (config_value).
HEADING = re.compile(r"^#+ .*$", re.M)
HEADING_FIELD = re.compile(r"\b([a-z_]+) = (\"[^\"]*\"|[\d.]+|None|True|False)")


def check(text: str) -> Check:
    problems, edits, figure_spans = [], [], []
    for h in HEADING.finditer(text):
        for m in HEADING_FIELD.finditer(h.group(0)):
            figure_spans.append((h.start() + m.start(2), h.start() + m.end(2)))
            try:
                want = config_value(m.group(1))
            except (AttributeError, ValueError) as e:
                problems.append(f"line {line_of(text, h.start())}: heading names {m.group(1)!r}, no default: {e}")
                continue
            if m.group(2).strip('"') != want:
                problems.append(f"line {line_of(text, h.start())}: the heading says {m.group(1)} = {m.group(2)} where "
                                f"TurboQuantConfig() has {want!r}")
    found = list(FIGURE.finditer(text))
    for m in found:
        figure_spans.append(m.span(1))
        try:
            want = value(m.group(2))
        except Problem as e:
            problems.append(f"line {line_of(text, m.start())}: <!-- {m.group(2)} -->: {e}")
            continue
        if m.group(1) != want:
            problems.append(f"line {line_of(text, m.start())}: the figure is {m.group(1)!r} where its results file "
                            f"gives {want!r} (<!-- {m.group(2)} -->)")
            edits.append((m.span(1), want))
    spans = covered(text) + figure_spans
    for m in NUMBER.finditer(text):
        if not any(a <= m.start() and m.end() <= b for a, b in spans):
            around = " ".join(text[max(0, m.start() - 40):m.end() + 40].split())
            problems.append(f"line {line_of(text, m.start())}: {m.group(0)!r} has no reference: a figure typed by "
                            f"hand? (in '...{around}...'; give it <!-- ref -->, see tools/docs/defaults_figures.py)")
    for (a, b), new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    return Check(problems, text, len(found))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doc", default=str(DOC), help="the file (default benchmarks/DEFAULTS.md)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 if a figure differs from its results file")
    g.add_argument("--write", action="store_true", help="put each figure's value in")
    args = ap.parse_args()
    path = Path(args.doc)
    text = path.read_text()
    result = check(text)
    if not (args.check or args.write):
        for m in FIGURE.finditer(text):
            try:
                print(f"{m.group(1):>10} {value(m.group(2)):>10}  {m.group(2)}")
            except Problem as e:
                print(f"{m.group(1):>10} {'?':>10}  {m.group(2)}: {e}")
    if args.write and result.text != text:
        path.write_text(result.text)
        print(f"updated the figures in {path}")
        result = check(result.text)
    for p in result.problems:
        print(f"{path}: {p}", file=sys.stderr)
    if result.problems and (args.check or args.write):
        sys.exit(1)
    if args.check:
        print(f"{path}: its {result.figures} figures are its results files'")


if __name__ == "__main__":
    main()
