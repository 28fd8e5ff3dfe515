"""A profile's weight formats are loaded once; a request only ever runs on them.

The server loads the flow and HiFT in its own profile's formats. An HTTP request may name
another profile: one with the same formats is served, any other is refused with a 400 that says
how to start a server for it (its steps on the loaded weights would be neither profile). A
Wyoming request cannot name a profile: it always runs the server's, on the weights loaded for it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import FakeEngine
from test_http import BackgroundServer


class OptionsEngine(FakeEngine):
    """The fake engine, keeping each sentence's options."""

    def __init__(self, model_dir: Path, threads: int | None = None) -> None:
        super().__init__(model_dir, threads)
        self.options: list[Any] = []

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Any:
        self.options.append(options)
        return super().synthesize(text, options, cancel)


def test_http_refuses_a_profile_whose_weights_are_not_loaded() -> None:
    with BackgroundServer({"server.profile": "realtime"}, engine_factory=OptionsEngine,
                          wyoming=False) as srv, srv.client() as http:  # fmt: skip
        refused = http.post("/tts", json={"text": "Hi there.", "profile": "fastest"})
        error = refused.json()["error"]
        assert refused.status_code == 400, refused.text
        assert (error["code"], error["param"]) == ("profile_not_loaded", "profile")
        assert "needs the LM in int4, the flow in int8 and HiFT in int8" in error["message"]
        assert "start it with --profile fastest" in error["message"]
        openai = http.post("/v1/audio/speech", json={"input": "Hi.", "profile": "fast"})
        assert openai.status_code == 400 and openai.json()["error"]["code"] == "profile_not_loaded"
        served = http.post("/tts", json={"text": "Hi there.", "profile": "batch"})
        assert served.status_code == 200 and served.headers["x-profile"] == "batch"
        # The page offers only what this server can speak.
        assert http.get("/voices").json()["profiles"] == ["realtime", "quality", "batch"]
    engine = srv.engines[0]
    assert len(engine.options) == 1  # the refused requests never reached the engine
    assert (engine.options[0].n_timesteps, engine.options[0].stream) == (10, False)


def test_http_serves_a_profile_with_the_same_weights_on_a_fast_server() -> None:
    with BackgroundServer({"server.profile": "fastest"}, engine_factory=OptionsEngine,
                          wyoming=False) as srv, srv.client() as http:  # fmt: skip
        assert http.post("/tts", json={"text": "Hi.", "profile": "fast"}).status_code == 200
        refused = http.post("/tts", json={"text": "Hi.", "profile": "realtime"})
        assert refused.status_code == 400 and "--profile realtime" in refused.text
        assert http.get("/voices").json()["profiles"] == ["fast", "faster", "fastest"]
    assert [(o.n_timesteps, o.lm_weights) for o in srv.engines[0].options] == [(5, "int4")]


@pytest.mark.parametrize(
    ("profile", "steps", "guidance", "solver"),
    [("realtime", 10, 0.7, "euler"), ("fastest", 1, 0.7, "euler")],
)
def test_wyoming_requests_run_the_profile_the_weights_were_loaded_for(
    wy: SimpleNamespace, profile: str, steps: int, guidance: float, solver: str
) -> None:
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import engine_loader

    async def main() -> list[Any]:
        engine = lambda p, t: OptionsEngine(p, t)  # noqa: E731
        async with wy.fake_server({"server.profile": profile}, engine=engine) as srv:
            await wy.synthesize(srv.port, "One request.")
            await wy.stream(srv.port, "And a stream.")
            return srv.engines[0].options

    options = asyncio.run(main())
    assert [(o.n_timesteps, o.cfg_rate, o.solver) for o in options] == [
        (steps, guidance, solver)
    ] * 2
    loader = engine_loader(load_config(None, [("server.profile", profile)]))
    fast = profile == "fastest"
    assert (loader.keywords["flow_int8"], loader.keywords["hift_int8"]) == (fast, fast)
