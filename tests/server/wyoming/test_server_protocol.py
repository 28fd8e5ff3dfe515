"""The Wyoming server as Home Assistant sees it, over real TCP, with the fake engine."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from wyoming.event import Event
from wyoming.info import Describe, Info

TWO_SENTENCES = "This is the first sentence. And here comes the second one!"
FIRST, SECOND = "This is the first sentence.", "And here comes the second one!"


def run(coro):
    return asyncio.run(coro)


async def describe(wy: SimpleNamespace, port: int) -> Info:
    async with wy.connect(port) as client:
        await client.write_event(Describe().event())
        reply = await wy.read_until(client, ("info",))
    return Info.from_event(reply.events[-1])


def test_info_has_every_field_home_assistant_needs(wy: SimpleNamespace) -> None:
    async def main() -> Info:
        async with wy.fake_server() as srv:
            return await describe(wy, srv.port)

    info = run(main())
    assert len(info.tts) == 1
    program = info.tts[0]
    assert program.name == "cosyvoice" and program.installed
    assert (
        program.version
        and program.attribution.name
        and program.attribution.url.startswith("https://")
    )
    assert "CosyVoice" in program.attribution.name
    assert program.supports_synthesize_streaming is True  # realtime profile
    by_name = {v.name: v for v in program.voices}
    assert by_name["zh-female"].languages == ["zh_CN"]
    assert by_name["en-male"].languages == ["en_US"]
    assert by_name["ja-male"].languages == ["ja_JP"]
    assert by_name["ko-female"].languages == ["ko_KR"]
    assert by_name["yue-female"].languages == ["zh_HK"]  # HA matches zh-Hant/zh-HK to it
    assert "中文女" in by_name["zh-female"].description
    for voice in program.voices:
        assert voice.installed and voice.languages and voice.name.isascii()
        assert voice.attribution.name and voice.attribution.url
    assert [v.name for v in program.voices] == sorted(by_name)


def test_no_streaming_profile_is_advertised(wy: SimpleNamespace) -> None:
    async def main() -> Info:
        async with wy.fake_server({"server.profile": "batch"}) as srv:
            return await describe(wy, srv.port)

    assert run(main()).tts[0].supports_synthesize_streaming is False


def test_non_streaming_synthesis_is_one_audio_block(wy: SimpleNamespace) -> None:
    async def main() -> tuple:
        async with wy.fake_server({"server.samples_per_chunk": 1000}) as srv:
            reply = await wy.synthesize(srv.port, TWO_SENTENCES, {"name": "en-female"})
            return reply, srv.engines[0].calls

    reply, calls = run(main())
    assert reply.types[0] == "audio-start" and reply.types[-1] == "audio-stop"
    assert reply.types.count("audio-start") == 1 and reply.types.count("audio-stop") == 1
    start = reply.events[0].data
    assert (start["rate"], start["width"], start["channels"]) == (22050, 2, 1)
    chunks = [e for e in reply.events if e.type == "audio-chunk"]
    assert all(len(c.payload) <= 2000 and c.data["rate"] == 22050 for c in chunks)
    expected = sum(wy.FakeEngine.expected_samples(s) for s in (FIRST, SECOND))
    assert reply.samples == expected
    assert [c.text for c in calls] == [FIRST, SECOND]
    assert {c.speaker for c in calls} == {"英文女"}
    assert all(c.thread.startswith("engine") for c in calls)  # never the event loop


def test_voice_by_original_name_language_and_speaker(wy: SimpleNamespace) -> None:
    async def main() -> list[str]:
        async with wy.fake_server() as srv:
            await wy.synthesize(srv.port, "你好。", {"name": "中文男"})
            await wy.synthesize(srv.port, "Hi.", {"language": "ja_JP"})
            await wy.synthesize(srv.port, "Hi.", {"name": "zh_CN"})  # wyoming <= 1.9 quirk
            await wy.synthesize(srv.port, "Hi.", {"name": "zh-female", "speaker": "en-male"})
            await wy.synthesize(srv.port, "Hello there.")  # no voice: by the text's language
            await wy.synthesize(srv.port, "你好，世界。")
            return [c.speaker for c in srv.engines[0].calls]

    assert run(main()) == ["中文男", "日语男", "中文女", "英文男", "英文女", "中文女"]


def test_default_voice_from_config(wy: SimpleNamespace) -> None:
    async def main() -> list[str]:
        async with wy.fake_server({"server.voice": "ko-female"}) as srv:
            await wy.synthesize(srv.port, "Hello there.")
            return [c.speaker for c in srv.engines[0].calls]

    assert run(main()) == ["韩语女"]


def test_streaming_in_home_assistants_order(wy: SimpleNamespace) -> None:
    async def main() -> tuple:
        async with wy.fake_server() as srv:
            reply = await wy.stream(srv.port, TWO_SENTENCES + " 这是第三句。", fragment=3)
            return reply, [c.text for c in srv.engines[0].calls]

    reply, texts = run(main())
    assert reply.types[-1] == "synthesize-stopped"
    assert "error" not in reply.types
    assert texts == [FIRST, SECOND, "这是第三句。"]  # the compat synthesize was ignored
    blocks = reply.blocks()
    assert len(blocks) == 3 == reply.types.count("audio-stop")
    for block, sentence in zip(blocks, texts, strict=True):
        assert len(block) // 2 == wy.FakeEngine.expected_samples(sentence)
    # every audio-chunk sits inside an audio-start … audio-stop block
    depth = 0
    for kind in reply.types:
        depth += (kind == "audio-start") - (kind == "audio-stop")
        assert depth in (0, 1)
        assert kind != "audio-chunk" or depth == 1


def test_streaming_audio_starts_before_the_stream_ends(wy: SimpleNamespace) -> None:
    async def main() -> float:
        async with wy.fake_server() as srv, wy.connect(srv.port) as client:
            await client.write_event(Event("synthesize-start"))
            for piece in ("This is the fir", "st sentence. And ", "more text"):
                await client.write_event(Event("synthesize-chunk", {"text": piece}))
            first = await wy.read_until(client, ("audio-chunk",), timeout=5)
            assert first.types == ["audio-start", "audio-chunk"]
            await client.write_event(Event("synthesize-stop"))
            rest = await wy.read_until(client, ("synthesize-stopped",))
            return rest.types.count("audio-start")

    assert run(main()) == 1  # "And more text" after the first block


def test_empty_stream_is_an_empty_audio_block_then_synthesize_stopped(
    wy: SimpleNamespace,
) -> None:
    async def main() -> list[str]:
        async with wy.fake_server() as srv:
            empty = await wy.stream(srv.port, "")
            punct = await wy.stream(srv.port, " ... ")
            return empty.types + ["|"] + punct.types

    block = ["audio-start", "audio-stop", "synthesize-stopped"]
    assert run(main()) == [*block, "|", *block]


def test_two_requests_on_one_connection(wy: SimpleNamespace) -> None:
    async def main() -> tuple:
        async with wy.fake_server() as srv, wy.connect(srv.port) as client:
            await client.write_event(Event("synthesize-start"))
            await client.write_event(Event("synthesize-chunk", {"text": "One. "}))
            await client.write_event(Event("synthesize-stop"))
            streamed = await wy.read_until(client, ("synthesize-stopped",))
            await client.write_event(Event("synthesize", {"text": "Two."}))
            plain = await wy.read_until(client, ("audio-stop",))
            return streamed.types, plain.types

    streamed, plain = run(main())
    assert streamed[-1] == "synthesize-stopped" and plain[-1] == "audio-stop"


def test_describe_is_answered_while_another_client_synthesizes(wy: SimpleNamespace) -> None:
    """The engine is held in the middle of a sentence: every describe is answered meanwhile,
    so none waits for the synthesis."""
    hold = threading.Event()

    async def main() -> tuple[list[Info], bool, SimpleNamespace]:
        engine = lambda p, t: wy.FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:
            speaking = asyncio.create_task(wy.synthesize(srv.port, TWO_SENTENCES))
            calls = lambda: srv.engines[0].calls  # noqa: E731
            await wy.until(lambda: calls() and calls()[0].chunks == 1, "the engine speaks")
            answers = [await describe(wy, srv.port) for _ in range(10)]
            held = not speaking.done() and not calls()[0].ended.is_set()
            hold.set()
            return answers, held, await speaking

    answers, held, reply = run(main())
    assert held and all(info.tts for info in answers)
    assert reply.types[-1] == "audio-stop"


def test_describe_during_model_load_lists_the_models_voices(wy: SimpleNamespace) -> None:
    loaded = threading.Event()

    def held_load(path, threads):
        assert loaded.wait(60), "the test never let the load finish"
        return wy.FakeEngine(path, threads)

    async def main() -> tuple:
        async with wy.fake_server(engine=held_load, wait_ready=False) as srv:
            async with wy.connect(srv.port) as client:
                # Events are read in order: the info answer means the request was read too.
                await client.write_event(Event("synthesize", {"text": "Waits for the model."}))
                await client.write_event(Describe().event())
                answered = await wy.read_until(client, ("info",))
                loading = not srv.running.load_task.done()
                loaded.set()
                reply = await wy.read_until(client, ("audio-stop", "error"))
            return Info.from_event(answered.events[-1]), answered.types, loading, reply

    info, answered, loading, reply = run(main())
    assert loading and answered == ["info"]  # answered at once; the request waits for the model
    # read from the tiny model's spk2info.pt before the engine has loaded
    assert [v.name for v in info.tts[0].voices] == ["en-male", "zh-female"]
    assert reply.types[-1] == "audio-stop"


def test_four_clients_at_once_all_get_complete_audio(wy: SimpleNamespace) -> None:
    texts = [f"Client {i} says hello. And client {i} says goodbye." for i in range(4)]

    async def main() -> list:
        async with wy.fake_server() as srv:
            return await asyncio.gather(*(wy.synthesize(srv.port, t) for t in texts))

    for text, reply in zip(texts, run(main()), strict=True):
        assert reply.types[-1] == "audio-stop"
        sentences = text.split(". ")
        expected = wy.FakeEngine.expected_samples(
            sentences[0] + "."
        ) + wy.FakeEngine.expected_samples(sentences[1])
        assert reply.samples == expected


def test_a_short_request_is_not_starved_by_a_long_one(wy: SimpleNamespace) -> None:
    long_text = " ".join(f"Long sentence number {i} goes on." for i in range(12))
    hold = threading.Event()

    async def main() -> list[str]:
        done: list[str] = []
        engine = lambda p, t: wy.FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:

            async def client(name: str, text: str) -> None:
                await wy.synthesize(srv.port, text)
                done.append(name)

            # The short request arrives while the long one's first sentence holds the engine.
            long = asyncio.create_task(client("long", long_text))
            await wy.until(lambda: srv.engines[0].calls, "the long request speaks")
            short = asyncio.create_task(client("short", "Short."))
            await wy.until(lambda: srv.running.scheduler.waiting == 1, "the short one waits")
            hold.set()
            await asyncio.gather(long, short)
        return done

    assert run(main()) == ["short", "long"]  # sentences interleave FIFO across connections


def test_disconnect_mid_stream_cancels_within_one_chunk(wy: SimpleNamespace) -> None:
    long_sentence = "This sentence is very long " * 20 + "."
    hold = threading.Event()  # never set while the client is there: the sentence cannot end

    async def main() -> tuple:
        engine = lambda p, t: wy.FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:
            async with wy.connect(srv.port) as client:
                await client.write_event(Event("synthesize-start"))
                await client.write_event(Event("synthesize-chunk", {"text": long_sentence + " "}))
                await wy.read_until(client, ("audio-chunk",))
            call = srv.engines[0].calls[0]
            await wy.until(call.ended.is_set, "the engine stops the sentence")
            hold.set()
            other = await wy.synthesize(srv.port, "Still serving.")
            return call, other

    call, other = run(main())
    assert not call.finished  # the engine saw the cancel event, or its generator was closed
    assert call.chunks == 1  # stopped right after the client left, not after ~120 chunks
    assert other.types[-1] == "audio-stop"


def test_engine_failure_is_an_error_event_and_the_server_keeps_serving(wy: SimpleNamespace) -> None:
    async def main() -> tuple:
        async with wy.fake_server() as srv:
            failed = await wy.synthesize(srv.port, "This will FAIL here.")
            crashed = await wy.synthesize(srv.port, "CRASH now.")
            ok = await wy.synthesize(srv.port, "Fine again.")
            return failed, crashed, ok

    failed, crashed, ok = run(main())
    assert failed.error().code == "SynthesisError" and "failed on purpose" in failed.error().text
    assert crashed.error().code == "SynthesisError"
    assert ok.types[-1] == "audio-stop"


def test_unix_socket_uri(wy: SimpleNamespace, tmp_path) -> None:
    from wyoming.client import AsyncUnixClient

    path = tmp_path / "cosyvoice.sock"

    async def main() -> list[str]:
        async with wy.fake_server({"server.uri": f"unix://{path}"}):
            async with AsyncUnixClient(str(path)) as client:
                await client.write_event(Event("synthesize", {"text": "Over a socket file."}))
                return (await wy.read_until(client, ("audio-stop",))).types

    types = run(main())
    assert types[0] == "audio-start" and types[-1] == "audio-stop"
