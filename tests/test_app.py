"""tq-chat (app/, installed as tq_chat): the Textual app driven headless by its Pilot on a tiny random model folder.

Argument parsing, model resolution and preflight are in tests/test_app_preflight.py; the conversation engine on its
own and one state on every surface in tests/test_app_session.py (both on the same tiny model folder)."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from tq_chat.chat import ChatApp, ChatSettings, Progress, Stats, Streamed
from tq_chat.models import ModelSource
from tq_chat.plan import make_plan
from tq_chat.widgets import ChatMessage
from tests.test_cli import save_tiny_model, tiny_model_dir  # noqa: F401  (session fixture)
from tq_mlx.cache import held_bytes
from tq_mlx.cache import TurboQuantConfig
from tq_mlx.config import KEY_ERROR
from tq_mlx.models.architectures import load_model_config
from tq_mlx.planner.display import bits_summary, format_bytes
from tq_mlx.planner.machine import weight_bytes


TIMEOUT = 60  # seconds any single wait in the app may take


# --- the app, headless ---------------------------------------------------------------------------------------


class RecordingApp(ChatApp):
    """ChatApp that records the messages its workers post (the base handlers still run: Textual walks the MRO)."""

    def __init__(self, settings):
        super().__init__(settings)
        self.events: list = []

    def on_progress(self, m: Progress) -> None:
        self.events.append(("progress", m.label, m.done, m.total))

    def on_streamed(self, m: Streamed) -> None:
        self.events.append(("text", m.text))

    def on_stats(self, m: Stats) -> None:
        self.events.append(("stats", m.stats))


def make_app(path: Path, **kw) -> RecordingApp:
    settings = dict(ctx=1024, config=TurboQuantConfig(window=16, calibration_tokens=None, sinks=2), max_tokens=24)
    settings.update(kw)
    return RecordingApp(ChatSettings(source=ModelSource(str(path), path=path), **settings))


async def wait_for(pilot, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def loaded(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.session is not None, "the model to load")
    await wait_for(pilot, lambda: not pilot.app.query_one("#prompt").disabled, "the input")


async def say(pilot, text: str, keys: bool = False) -> None:
    """Submit `text` in the input box (typed key by key when `keys`) and wait for the answer."""
    app = pilot.app
    prompt = app.query_one("#prompt")
    prompt.focus()
    if keys:
        await pilot.press(*text)
    else:
        prompt.value = text
    await pilot.press("enter")
    await pilot.pause(0.05)
    await wait_for(pilot, lambda: not app.generating, "the answer")
    await pilot.pause(0.1)


def messages(app, role: str | None = None) -> list[ChatMessage]:
    return [m for m in app.query(ChatMessage) if role is None or m.role == role]


def panel_text(panel, stats: dict) -> str:
    """A memory panel's rendering of `stats` as plain text."""
    from rich.console import Console

    console = Console(width=40, record=True, file=open(os.devnull, "w"))
    console.print(panel.render_stats(stats))
    return console.export_text()


def rendered(app) -> str:
    return panel_text(app.panel, app.panel.stats)


def test_typing_streams_an_answer_and_the_panel_reads_the_cache(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir, temp=1.0, max_tokens=60)  # sampled bytes: many streamed segments
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot)
            await say(pilot, "hello there", keys=True)
            session = app.session
            answer = session.messages[-1]
            assert answer["role"] == "assistant" and answer["content"]
            # streamed in pieces, and the transcript shows exactly what the conversation keeps
            pieces = [e[1] for e in app.events if e[0] == "text"]
            assert len(pieces) > 1 and "".join(pieces) == answer["content"]
            assert messages(app, "assistant")[-1].source == answer["content"]
            assert [m.source for m in messages(app, "user")] == ["hello there"]
            # the panel's numbers are the caches' own nbytes, via memory.cache_bytes
            stats = app.panel.stats
            assert stats["kv_bytes"] == held_bytes(session.cache)
            assert stats["context_tokens"] == len(session.tokens) == session.cache[0].offset
            assert stats["weights"] > 0 and stats["peak"] >= stats["active"] > 0 and stats["decode_tps"] > 0
            text = rendered(app)
            for key in ("kv_bytes", "mlx_lm_bytes", "weights"):
                assert format_bytes(stats[key]) in text
            # against what mlx-lm's own float32 KVCache allocates: 256-token steps, 3 layers, 2 kv heads x 64
            n = len(session.tokens)
            assert stats["mlx_lm_bytes"] == 3 * 2 * 256 * -(-n // 256) * 2 * 64 * 4
            assert "mlx-lm float32 cache" in text and f"({stats['mlx_lm_bytes'] / stats['kv_bytes']:.2f}x)" in text
            # the label wraps in the panel
            assert f"{len(session.tokens):,} / 1,024" in text
            # each layer's keys at the width their logit error chose (its first window is the window: the output
            # error has no coded token to measure on there)
            assert bits_summary(session.cache) in " ".join(text.split())
            assert re.search(r"K[4-6]/V4", bits_summary(session.cache))
            assert any(e[0] == "stats" for e in app.events)  # live updates while generating

    asyncio.run(run())


def test_the_panel_never_shows_a_negative_saving_and_says_where_the_float_window_ends():
    from tq_chat.widgets import MemoryPanel

    base = dict(ctx=4096, context_tokens=85, weights=1, active=1, peak=1, prompt_tps=0, decode_tps=0, bits="K4/V3",
                config="TurboQuant K4/V3", other_bytes=0, kv_dtype="float16", sinks=4, window=768)
    early = dict(base, kv_bytes=3_230_000, mlx_lm_bytes=2_080_000, float_tokens=85, compressed_tokens=0)
    text = " ".join(panel_text(MemoryPanel(), early).split())
    assert "saved none yet" in text and "-" + format_bytes(1_150_000) not in text and "x)" not in text
    assert "all 85 tokens in float16 (4 sinks + 768-token window): compression starts at token 773" in text
    assert "mlx-lm float16 cache 2.08 MB" in text and "compressed 0 tokens" in text
    later = dict(base, context_tokens=4000, kv_bytes=10_000_000, mlx_lm_bytes=30_000_000, float_tokens=772,
                 compressed_tokens=3228)
    text = " ".join(panel_text(MemoryPanel(), later).split())
    assert "saved 20.0 MB (3.00x)" in text and "3,228 tokens compressed, 772 in float16" in text
    decayed = dict(later, decayed_tokens=1152, bits="K4→3/V3→2 after 2048 on all 3 attention layers")
    text = " ".join(panel_text(MemoryPanel(), decayed).split())
    assert "3,228 tokens compressed (1,152 decayed), 772 in float16" in text and "K4→3/V3→2 after 2048" in text


def test_the_title_shows_the_dtype_the_model_runs_in(tiny_model_dir, tmp_path):
    named = tmp_path / "tiny-float16"  # a folder named for its weights' dtype, as the demo model's is
    named.symlink_to(tiny_model_dir, target_is_directory=True)

    cfg = load_model_config(tiny_model_dir)

    async def run(dtype, expected):
        plan = make_plan("tiny-float16", cfg, weight_bytes(tiny_model_dir), 1024, TurboQuantConfig(), 10**10,
                         dtype=dtype)
        app = make_app(named, dtype=dtype, kv_dtype="float16", plan=plan)
        async with app.run_test() as pilot:
            await loaded(pilot)
            assert app.sub_title == expected
            # the plan note compares with mlx-lm's cache in the dtype the model runs in
            real = dtype or "float16"
            bytes_ = {"float32": 4, "bfloat16": 2, "float16": 2}[real]
            note = messages(app, "notice")[0].source
            assert note.startswith(f"**tiny** ({real}): weights ") and (
                f"(mlx-lm's {real} cache would be {format_bytes(plan.kv_fp16 * bytes_ // 2)})" in note), note
            # before the first question the panel already names the dtype mlx-lm's cache would hold
            assert f"mlx-lm {app.session.dtype} cache" in rendered(app)
            await say(pilot, "/clear")  # the predicted peak stays next to the measured one
            assert "planned peak" in rendered(app)

    # the default: K4/V4 at every age
    asyncio.run(run("float32", "tiny · float32 · TurboQuant K4/V4 · ctx 1k"))
    asyncio.run(run("bfloat16", "tiny · bfloat16 · TurboQuant K4/V4 · ctx 1k"))
    # the tiny model's weights are float32
    asyncio.run(run(None, "tiny · float32 · TurboQuant K4/V4 · ctx 1k"))


def test_the_title_and_the_panel_show_temporal_decay(tiny_model_dir):
    config = TurboQuantConfig(value_bits=4, window=16, calibration_tokens=None, sinks=2, decay_after=32, decay_key_bits=3,
                              decay_value_bits=2, key_error=None)  # K4/V4, every layer's keys at K4

    async def run():
        app = make_app(tiny_model_dir, config=config)
        async with app.run_test() as pilot:
            await loaded(pilot)
            assert app.sub_title.endswith("TurboQuant K4→3/V4→2 after 32 · ctx 1k")
            await say(pilot, "a question long enough for its oldest tokens to decay " * 2)
            stats = app.panel.stats
            assert stats["decayed_tokens"] == max(max(c.n_decayed) for c in app.session.cache) > 0
            assert stats["kv_bytes"] == held_bytes(app.session.cache)
            text = " ".join(rendered(app).split())
            assert f"({stats['decayed_tokens']:,} decayed)" in text
            assert "K4→3/V4→2 after 32 on all 3 attention layers" in text

    asyncio.run(run())


def test_second_turn_reuses_the_cache(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "first question")
            before = len(app.session.tokens)
            prepare = app.session.prepare
            seen = {}

            def spy(text):
                out = prepare(text)
                seen["reused"], seen["new"] = out[2], len(out[1])
                return out

            app.session.prepare = spy
            await say(pilot, "second")
            # only the last generated token (<eos>, which the template writes as a newline) is re-fed
            assert seen["reused"] >= before - 1
            assert seen["new"] < len("user: second\nassistant: ") + 2
            assert len(messages(app, "assistant")) == 2

    asyncio.run(run())


def test_save_then_load_continues_the_conversation(tiny_model_dir, tmp_path):
    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "remember this")
            saved_tokens, saved_messages = list(app.session.tokens), list(app.session.messages)
            saved_bytes = app.panel.stats["kv_bytes"]
            await say(pilot, f"/save {tmp_path / 'conv'}")
            assert (tmp_path / "conv.safetensors").exists()
            assert messages(app, "notice")[-1].source.endswith(
                f"to `{tmp_path / 'conv.safetensors'}`: `/load {tmp_path / 'conv.safetensors'}` continues this "
                f"conversation.")
            await say(pilot, "/clear")
            assert app.session.tokens == [] and len(messages(app)) == 1
            await say(pilot, f"/load {tmp_path / 'conv.safetensors'}")
            assert app.session.tokens == saved_tokens and app.session.messages == saved_messages
            assert app.panel.stats["kv_bytes"] == saved_bytes
            assert [m.source for m in messages(app, "user")] == ["remember this"]
            prepare = app.session.prepare
            reused = []
            app.session.prepare = lambda t: (out := prepare(t), reused.append(out[2]))[0]
            await say(pilot, "go on")
            assert reused[0] >= len(saved_tokens) - 1  # continued from the loaded cache, not re-prefilled
            assert [m["role"] for m in app.session.messages] == ["user", "assistant"] * 2

    asyncio.run(run())


def in_thread(f):
    """f() in a new thread, as tq-chat runs every load and generation (its result, or the exception it raised)."""
    import threading

    out = []

    def target():
        try:
            out.append(f())
        except Exception as e:  # noqa: BLE001 (handed back to the test)
            out.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    return out[0]


def test_a_conversation_loaded_in_one_thread_continues_in_another(tiny_model_dir, tmp_path):
    """The app loads in the event loop's thread and answers in a worker thread: MLX streams are per thread, so
    a lazily loaded cache failed every later answer ("There is no Stream(cpu, 0) in current thread")."""
    from mlx_lm import load

    from tq_chat.session import ChatSession

    def start():
        model, tokenizer = load(str(tiny_model_dir))
        return ChatSession(model, tokenizer, TurboQuantConfig(window=16, calibration_tokens=None, sinks=2), ctx=1024, max_tokens=8)

    session = in_thread(start)
    assert in_thread(lambda: session.generate("remember this, it is a long enough question").generated) > 0
    saved = list(session.tokens)
    path = in_thread(lambda: session.save(tmp_path / "conv"))
    assert in_thread(lambda: session.load(path)) == [] and session.tokens == saved
    result = in_thread(lambda: session.generate("go on"))
    assert not isinstance(result, Exception), result
    assert result.reused_tokens >= len(saved) - 1 and result.generated > 0


def test_save_to_a_missing_folder_is_one_line_and_the_conversation_stays(tiny_model_dir, tmp_path):
    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "keep me")
            tokens, history = list(app.session.tokens), list(app.session.messages)
            await say(pilot, f"/save {tmp_path / 'no-such-dir' / 'x.safetensors'}")
            error = messages(app, "error")[-1].source
            assert error == (f"Could not save: cannot save to {tmp_path / 'no-such-dir' / 'x.safetensors'}: "
                             f"the folder {tmp_path / 'no-such-dir'} does not exist")
            (tmp_path / "ro").mkdir()
            (tmp_path / "ro").chmod(0o500)  # a folder that exists but cannot be written: MLX's RuntimeError
            try:
                await say(pilot, f"/save {tmp_path / 'ro' / 'x'}")
            finally:
                (tmp_path / "ro").chmod(0o700)
            if os.geteuid() != 0:  # root writes anywhere
                assert messages(app, "error")[-1].source.startswith(f"Could not save: cannot write {tmp_path}")
            assert app.session.tokens == tokens and app.session.messages == history
            await say(pilot, "still here?")  # the conversation goes on
            assert len(messages(app, "assistant")) == 2 and app.is_running

    asyncio.run(run())


def test_ctrl_c_stops_and_keeps_the_partial_answer(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir, max_tokens=3000, ctx=4096)
        async with app.run_test() as pilot:
            await loaded(pilot)
            app.query_one("#prompt").focus()
            await pilot.press(*"talk")
            await pilot.press("enter")
            await wait_for(pilot, lambda: any(e[0] == "text" for e in app.events), "the first token")
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: not app.generating, "the stop")
            await pilot.pause(0.1)
            session = app.session
            partial = session.messages[-1]["content"]
            assert session.messages[-1]["role"] == "assistant" and 0 < len(session.tokens) < 3000
            assert messages(app, "assistant")[-1].source == partial
            assert "Stopped" in messages(app, "notice")[-1].source
            assert len(session.tokens) == session.cache_offset()
            session.max_tokens = 8
            await say(pilot, "again")  # the conversation goes on
            assert session.messages[-2] == {"role": "user", "content": "again"}

    asyncio.run(run())


def test_prefill_progress_is_shown(tiny_model_dir):
    async def run():
        app = make_app(tiny_model_dir, prefill_step_size=16, max_tokens=2)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "a long question " * 6)
            prefill = [e for e in app.events if e[0] == "progress" and e[1] == "Prefill"]
            assert len(prefill) >= 4 and prefill[-1][2] == prefill[-1][3]
            assert any(0 < e[2] < e[3] for e in prefill)
            assert not app.status.display  # hidden again when done

    asyncio.run(run())


def test_commands_and_errors(tiny_model_dir, tmp_path):
    async def run():
        app = make_app(tiny_model_dir, ctx=64)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "/bits")
            bits = messages(app, "notice")[-1].source  # the default's bits: K4/V4 at every age
            # (a first window that is the window: keys by their logit error, the output error having nothing to read)
            assert ("**Cache**: TurboQuant K4/V4, window 16, sinks 2, keys up to K6 where their logit error exceeds "
                    f"{format(KEY_ERROR, 'g')}\n") in bits
            # nothing compressed yet: no layer has chosen its keys' width
            assert "**Bits per layer**: K4/V4 on all 3 attention layers" in bits
            await say(pilot, "/stats")
            assert "KV cache held" in messages(app, "notice")[-1].source
            await say(pilot, "/help")
            assert "/save FILE" in messages(app, "notice")[-1].source
            await say(pilot, "/nonsense")
            assert "Unknown command /nonsense" in messages(app, "error")[-1].source
            await say(pilot, f"/load {tmp_path / 'missing'}")
            assert "Could not load" in messages(app, "error")[-1].source
            (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
            await say(pilot, f"/load {tmp_path / 'junk.safetensors'}")
            assert "Could not load" in messages(app, "error")[-1].source
            await say(pilot, "/save")
            assert "Usage: /save FILE" in messages(app, "error")[-1].source
            # --ctx 64: a long message does not fit; the conversation is unchanged
            await say(pilot, "x" * 80)
            assert "context limit reached" in messages(app, "error")[-1].source
            assert app.session.messages == [] and app.session.tokens == []
            # a short one fits, and generation stops at the limit
            app.session.max_tokens = 1000
            await say(pilot, "hi")
            assert len(app.session.tokens) == 64
            assert "Context limit reached (64 tokens)" in messages(app, "notice")[-1].source
            assert "64 / 64" in rendered(app)

            def boom(*a, **k):
                raise RuntimeError("simulated failure")

            app.session.generate = boom
            await say(pilot, "/clear")
            await say(pilot, "hello")
            assert "generation failed: RuntimeError: simulated failure" in messages(app, "error")[-1].source
            await pilot.press("ctrl+c")  # nothing to stop: a notification, the app stays up
            await say(pilot, "/quit")
        assert app.return_code in (0, None)

    asyncio.run(run())


def test_help_lists_every_command_and_a_bare_screenshot_goes_where_the_app_says(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """Issue 35: /help's table had a blank header cell and left out /help; a bare /screenshot wrote into the
    current folder. Every table the app shows has a header, /help names every command the app knows, and a bare
    /screenshot goes to tq-mlx's cache folder ($TQ_MLX_CACHE), in a new file each time, at the path it prints."""
    import re

    from tq_chat.chat import COMMANDS, HELP, KNOWN, screenshot_dir

    monkeypatch.setenv("TQ_MLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert screenshot_dir() == tmp_path / "cache" / "screenshots"
    assert set(KNOWN) == {c.split()[0] for c in COMMANDS} and "/help" in KNOWN

    def header_cells(table: str) -> list[str]:
        return [c.strip() for c in table.strip().splitlines()[0].strip("|").split("|")]

    async def run():
        app = make_app(tiny_model_dir)
        async with app.run_test() as pilot:
            await loaded(pilot)
            await say(pilot, "/help")
            help_text = messages(app, "notice")[-1].source
            assert help_text == HELP
            table = help_text[help_text.index("| command"):]
            assert all(header_cells(table)), table
            listed = re.findall(r"^\| `(/\w+)", table, re.M)
            assert listed == list(KNOWN), listed
            for cmd in KNOWN:  # every command listed does something other than "Unknown command"
                if cmd in ("/screenshot", "/quit"):
                    continue  # below
                await say(pilot, cmd)
                assert not any(f"Unknown command {cmd}" in m.source for m in messages(app, "error")), cmd
                if cmd == "/stats":
                    assert all(header_cells(messages(app, "notice")[-1].source))
            shots = []
            for _ in range(2):
                await say(pilot, "/screenshot")
                said = messages(app, "notice")[-1].source
                shots.append(Path(re.fullmatch(r"Saved a screenshot to `(.+)`\.", said).group(1)))
            assert shots[0] != shots[1] and all(p.parent == screenshot_dir() and p.is_file() for p in shots)
            assert not list(tmp_path.glob("*.svg"))  # nothing in the current folder
            await say(pilot, "/quit")
        assert app.return_code in (0, None)

    asyncio.run(run())


def test_a_model_that_does_not_load_is_reported(tmp_path):
    bad = save_tiny_model(tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)

    async def run():
        app = make_app(bad)
        async with app.run_test() as pilot:
            # The message widget is mounted before its text is set: wait for the text.
            await wait_for(pilot, lambda: any("could not load" in m.source for m in messages(app, "error")),
                           "the load error")
            assert app.session is None and not app.query_one("#prompt").disabled
            await say(pilot, "hello")  # nothing to talk to, but no crash
            await say(pilot, "/quit")

    asyncio.run(run())


def test_download_progress_goes_to_the_app(tiny_model_dir, monkeypatch):
    calls = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        calls["repo"] = repo_id
        bar = tqdm_class(total=1000, desc="Downloading", unit="B")
        for _ in range(4):
            bar.update(250)
            bar.refresh()
        bar.close()
        return str(tiny_model_dir)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    monkeypatch.setattr("tq_chat.models.check_hub", lambda repo_id: None)

    async def run():
        app = RecordingApp(ChatSettings(source=ModelSource("org/tiny", repo_id="org/tiny"), ctx=256,
                                        config=TurboQuantConfig(window=16, calibration_tokens=None)))
        async with app.run_test() as pilot:
            await loaded(pilot)
            downloads = [e for e in app.events if e[0] == "progress" and "Downloading org/tiny" in e[1]]
            assert downloads and downloads[-1][2:] == (1000, 1000)
            assert app.settings.source.path == tiny_model_dir

    asyncio.run(run())
    assert calls["repo"] == "org/tiny"


def test_download_failure_is_a_message_not_a_crash(monkeypatch):
    def offline(*a, **k):
        raise OSError("network is unreachable")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.setattr("tq_chat.models.check_hub", lambda repo_id: None)

    async def run():
        app = RecordingApp(ChatSettings(source=ModelSource("org/tiny", repo_id="org/tiny"), ctx=256))
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: messages(app, "error"), "the error")
            assert "cannot be fetched from the Hub: network is unreachable" in messages(app, "error")[-1].source

    asyncio.run(run())
