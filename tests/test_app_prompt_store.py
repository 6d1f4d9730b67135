"""tq-chat with the prompt cache on disk (tq_mlx.prompt_cache.store, the store tq-server uses): a second launch with the
same model, config and system prompt starts from the system prompt's cache without prefilling it and says so in one
line; a conversation's cache is found again; a store that cannot be read is a line in the transcript and the chat
goes on. On the tiny random model folder (tests/test_cli.py) and its byte-level chat template."""

from __future__ import annotations

import asyncio

from tests.test_app import loaded, make_app, messages, say
from tests.test_cli import tiny_model_dir  # noqa: F401  (session fixture)
from tq_mlx.cache import TurboQuantConfig
from tq_mlx.prompt_cache.store import PromptStore, model_id
from tq_mlx.prompt_cache.resume import cache_counts

CFG = TurboQuantConfig(window=16, calibration_tokens=None, sinks=2, compress_block=8, decay_after=64)
SYSTEM = "You are a terse assistant for the river archive. " * 6  # ~300 byte tokens: compressed and decayed


def session_for(path, folder, system=SYSTEM, store=True):
    from mlx_lm import load
    from mlx_lm.sample_utils import make_sampler

    from tq_chat.session import ChatSession

    model, tokenizer = load(str(path))
    s = PromptStore(folder, 10**9, model_id=model_id(model), config=CFG, model_name="tiny") if store else None
    return ChatSession(model, tokenizer, CFG, ctx=2048, system=system, max_tokens=12, sampler=make_sampler(0.0),
                       store=s)


def test_a_second_launch_loads_the_system_prompt_from_disk_and_answers_as_a_fresh_one(tiny_model_dir, tmp_path):
    first = session_for(tiny_model_dir, tmp_path)
    note = first.warm_start()
    prefix = first.system_prefix()
    assert len(prefix) > CFG.sinks + CFG.window + 2 * CFG.compress_block  # long enough to compress and decay
    assert note.startswith(f"System prompt: {len(prefix):,} tokens prefilled in ") and "kept on disk" in note
    assert first.tokens == prefix and first.store.flush(30)
    second = session_for(tiny_model_dir, tmp_path)  # a new launch: a new store over the same folder
    fed = []
    note = second.warm_start(lambda done, total: fed.append((done, total)))
    assert note == (f"System prompt: {len(prefix):,} tokens loaded from the prompt cache on disk ({tmp_path}), "
                    f"no prefill.")
    assert "\n" not in note and fed == [] and second.tokens == prefix
    assert cache_counts(second.cache) == cache_counts(first.cache)
    fresh = session_for(tiny_model_dir, tmp_path, store=False)  # no store: the first message prefills everything
    want = fresh.generate("What is kept in the archive?")
    got = second.generate("What is kept in the archive?")
    assert got.reused_tokens == len(prefix) and got.new_tokens == want.new_tokens - len(prefix)
    assert got.text == want.text and second.tokens == fresh.tokens
    assert cache_counts(second.cache) == cache_counts(fresh.cache)


def test_a_conversation_is_found_again_on_disk_after_a_restart(tiny_model_dir, tmp_path):
    first = session_for(tiny_model_dir, tmp_path, system=None)
    question = "Tell me what the river archive keeps, and where it keeps it, in a few words. " * 3
    a = first.generate(question)
    assert a.stored_tokens == 0 and first.store.flush(30)
    second = session_for(tiny_model_dir, tmp_path, system=None)
    assert second.warm_start() is None  # no system prompt: nothing to warm
    b = second.generate(question)
    prompt = len(second.render([{"role": "user", "content": question}]))
    assert 0 < b.stored_tokens == b.reused_tokens < prompt and b.new_tokens == prompt - b.reused_tokens
    assert b.text == a.text


def test_the_app_says_in_one_line_that_the_second_launch_needs_no_prefill(tiny_model_dir, tmp_path):
    async def launch():
        app = make_app(tiny_model_dir, config=CFG, system=SYSTEM, store_folder=tmp_path, store_bytes=10**9)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot)
            await say(pilot, "hello")
            notes = [m.source for m in messages(app, "notice")]
            app.session.store.flush(30)
            await say(pilot, "/stats")
            stats_rows = messages(app, "notice")[-1].source
        return notes, stats_rows

    first, _ = asyncio.run(launch())
    second, stats = asyncio.run(launch())
    assert any(n.startswith("System prompt: ") and "prefilled" in n for n in first)
    loaded_lines = [n for n in second if "no prefill" in n]
    assert len(loaded_lines) == 1 and loaded_lines[0].startswith("System prompt: ")
    assert "prompt cache on disk" in stats and str(tmp_path) in stats


def test_a_store_file_that_fails_to_load_is_a_line_in_the_transcript_and_the_chat_goes_on(tiny_model_dir, tmp_path):
    first = session_for(tiny_model_dir, tmp_path)
    first.warm_start()
    first.store.flush(30)
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[-64] ^= 0xFF
    path.write_bytes(bytes(data))

    async def launch():
        app = make_app(tiny_model_dir, config=CFG, system=SYSTEM, store_folder=tmp_path, store_bytes=10**9)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot)
            await say(pilot, "hello")
            return [m.source for m in messages(app, "error")], [m.source for m in messages(app, "notice")], app

    errors, notes, app = asyncio.run(launch())
    assert len(errors) == 1 and "checksum" in errors[0] and str(path) in errors[0]
    assert any("prefilled" in n for n in notes) and app.session.messages[-1]["role"] == "assistant"
    assert path.exists()


def test_no_store_when_the_disk_tier_is_off(tiny_model_dir, tmp_path):
    async def launch():
        app = make_app(tiny_model_dir, config=CFG, system=SYSTEM, store_folder=tmp_path, store_bytes=0)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot)
            return app.session.store, [m.source for m in messages(app, "notice")]

    store, notes = asyncio.run(launch())
    assert store is None and not any(n.startswith("System prompt") for n in notes)
    assert list(tmp_path.iterdir()) == []
