"""End to end: the real server process with the real engine on tests/data/tiny_model.

One server process serves the whole module (loading torch and the model takes seconds).
The tiny model has random weights, so its audio is noise of a length set by the text; these
tests check the protocol, timing and robustness, not the sound.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from conftest import ROOT, wait_for_port
from wyoming.event import Event
from wyoming.info import Describe, Info

TINY = ROOT / "tests" / "data" / "tiny_model"


def run(coro):
    return asyncio.run(coro)


async def describe(port: int) -> Info:
    from wyoming.client import AsyncTcpClient

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        while not Info.is_type((event := await asyncio.wait_for(client.read_event(), 5)).type):
            pass
    return Info.from_event(event)


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    process = subprocess.Popen(
        [sys.executable, "-m", "wyoming_cosyvoice", "--uri", f"tcp://127.0.0.1:{port}",
         "--model-dir", str(TINY), "--threads", "1", "--seed", "0", "--debug"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_port(port, process, timeout=60)
        # Listening comes before loading: describe is answered at once, likely during the load
        # (that it never waits for the load: test_server_protocol, with a load held).
        info = run(describe(port))
        yield SimpleNamespace(port=port, process=process, load_info=info)
    finally:
        process.terminate()  # SIGTERM: must exit cleanly (a bounded wait, not a duration)
        try:
            _, log = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, log = process.communicate()
        sys.stderr.write(log[-4000:])
        assert process.returncode == 0, process.returncode
        assert "Traceback" not in log


def test_describe_during_load_and_after(server: SimpleNamespace) -> None:
    assert [v.name for v in server.load_info.tts[0].voices] == ["en-male", "zh-female"]
    program = run(describe(server.port)).tts[0]
    assert program.installed and program.supports_synthesize_streaming
    assert {v.name: v.languages for v in program.voices} == {
        "en-male": ["en_US"],
        "zh-female": ["zh_CN"],
    }


def test_non_streaming_synthesis(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    reply = run(wy.synthesize(server.port, "Hello there. 你好。", {"name": "en-male"}))
    assert reply.types[0] == "audio-start" and reply.types[-1] == "audio-stop"
    assert reply.types.count("audio-start") == 1
    assert reply.events[0].data["rate"] == 22050 and reply.samples > 22050 // 10


def test_streaming_in_home_assistants_order(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    text = "The first sentence is here. The second one follows! 第三句。"
    reply = run(wy.stream(server.port, text, fragment=4, voice={"name": "zh-female"}))
    assert reply.types[-1] == "synthesize-stopped" and "error" not in reply.types
    assert len(reply.blocks()) == 3 and all(len(b) > 0 for b in reply.blocks())


def test_errors_come_from_the_real_server(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    bad = run(wy.synthesize(server.port, "Hi.", {"name": "ja-male"}))  # not in the tiny model
    assert bad.error().code == "VoiceNotFoundError" and "en-male" in bad.error().text
    empty = run(wy.synthesize(server.port, ""))
    assert empty.types == ["audio-start", "audio-stop"]  # nothing to say: an empty WAV


@pytest.mark.long
def test_describe_answered_while_synthesizing_a_long_text(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    """Describes asked after the long text's first audio are all answered before its end.
    (That a describe never waits for the engine: test_server_protocol, with a held engine.)"""
    long_text = " ".join(f"This is sentence number {i} of a long text." for i in range(12))

    async def main() -> list[str]:
        arrived: list[str] = []  # the long reply's events and the describe answers, in order
        async with wy.connect(server.port) as client:
            await client.write_event(Event("synthesize", {"text": long_text}))

            async def read_reply() -> None:
                while (event := await asyncio.wait_for(client.read_event(), 60)) is not None:
                    arrived.append(event.type)
                    if event.type in ("audio-stop", "error"):
                        return

            reading = asyncio.create_task(read_reply())
            await wy.until(lambda: "audio-chunk" in arrived, "the first audio")
            for _ in range(5):
                await describe(server.port)
                arrived.append("answered")
            await reading
        return arrived

    arrived = run(main())
    # Every answer came after the first audio (waited for) and before the reply's end.
    assert arrived.count("answered") == 5 and arrived[-1] == "audio-stop", arrived[-8:]


@pytest.mark.long
def test_client_leaving_mid_stream_and_four_clients_at_once(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    async def leave() -> None:
        async with wy.connect(server.port) as client:
            await client.write_event(Event("synthesize-start"))
            text = "A long sentence that the client will not wait for, it leaves early. "
            await client.write_event(Event("synthesize-chunk", {"text": text * 3}))
            await wy.read_until(client, ("audio-chunk",), timeout=60)

    async def main() -> list:
        await leave()
        texts = [f"Client number {i} says hello. Then goodbye." for i in range(4)]
        return await asyncio.gather(*(wy.synthesize(server.port, t) for t in texts))

    for reply in run(main()):
        assert reply.types[-1] == "audio-stop" and reply.samples > 0
