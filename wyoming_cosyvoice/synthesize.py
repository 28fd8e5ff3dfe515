"""``python -m wyoming_cosyvoice synthesize``: text (argument, file or stdin) → a WAV file.

The same speech pipeline as the server (:mod:`.pipeline.speech`), with a file as its client: the
text is split into sentence segments, each is synthesized and all are written one after another into
one WAV file. Without ``--batch``: the server's default profile and one voice for the text, as
a request to the server gets. With ``--batch`` (audiobooks, chapters): the ``batch`` profile
(whole-sentence, best quality; no streaming), a progress bar counting segments, and without
``--voice`` each segment gets a voice of its own language; a segment the text frontend refuses
is skipped with a warning instead of losing a long run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import sys
import time
import wave
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

from wyoming_cosyvoice.config import (
    AUTO_PROFILE,
    ConfigError,
    ServerConfig,
    load_config,
    parse_override,
)
from wyoming_cosyvoice.pipeline.sentences import Sentence, split_text, text_language
from wyoming_cosyvoice.pipeline.speech import (
    WIDTH,
    Audio,
    SentenceEnd,
    SentenceStart,
    Speech,
    SpeechEvent,
    SpeechSettings,
    VoiceChoice,
)
from wyoming_cosyvoice.voices.catalog import VoiceCatalog

_LOGGER = logging.getLogger("wyoming_cosyvoice.synthesize")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wyoming-cosyvoice synthesize",
        description="Speak a text into a WAV file with CosyVoice (no server needed).",
    )
    add = p.add_argument
    add("text", nargs="?", help="the text; '-' or nothing (with no --file) reads stdin")
    add("-f", "--file", "--input", type=Path, help="read the text from this UTF-8 file")
    add("-o", "--output", default="out.wav", help="WAV file to write, '-' for stdout")
    add("--batch", action="store_true",
        help="long text: split into segments, batch profile, progress bar")  # fmt: skip
    add("--segments-dir", type=Path, help="with --batch: also write each segment as NNNN.wav")
    add(
        "--voice",
        help="voice name (e.g. en-female) or speaker; default: by the language "
        "of the text (with --batch: of each segment)",
    )
    add("--profile", help="settings profile (default: batch with --batch, else the server's)")
    add("--seed", type=int, help="fixed sampling seed (reproducible audio)")
    add("--config", type=Path, help="settings file read over the defaults (config.yaml)")
    add("--model", help="CosyVoice-300M-SFT (default), CosyVoice-300M or CosyVoice-300M-Instruct")
    add("--model-dir", help="use this model directory instead of searching the data dirs")
    add("--data-dir", action="append", help="directory searched for models (repeatable)")
    add("--offline", action="store_true", help="never download a model")
    add("--threads", type=int, help="CPU threads for the engine")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    add("--quiet", action="store_true", help="no progress bar")
    add("--debug", action="store_true", help="log DEBUG messages")
    return p


def read_text(args: argparse.Namespace) -> str:
    if args.file is not None:
        if args.text not in (None, "-"):
            raise ValueError("give the text either as an argument or with --file, not both")
        return args.file.read_text(encoding="utf-8")
    if args.text is None or args.text == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("no text: give it as an argument, with --file, or on stdin")
        return sys.stdin.read()
    return str(args.text)


def settings(args: argparse.Namespace) -> ServerConfig:
    overrides: list[tuple[str, Any]] = [parse_override(item) for item in args.set]
    for flag, key in (("model", "server.model"), ("model_dir", "server.model_dir"),
                      ("threads", "server.threads"), ("seed", "server.seed")):  # fmt: skip
        if getattr(args, flag) is not None:
            overrides.append((key, getattr(args, flag)))
    if args.data_dir:
        overrides.append(("server.data_dirs", list(args.data_dir)))
    if args.offline:
        overrides.append(("server.offline", True))
    config = load_config(args.config, overrides)
    name = args.profile or ("batch" if args.batch and "batch" in config.profiles else None)
    if name is None and config.profile.name != AUTO_PROFILE:
        return config
    if name in (None, AUTO_PROFILE) and config.auto is not None:
        # A file has no first audio to wait for: auto's most exact profile, nothing more loaded.
        name = config.auto.profiles[0]
    if name not in config.profiles:
        known = ", ".join(config.profiles)
        raise ConfigError("--profile", f"unknown profile {name!r} (known: {known})")
    return replace(config, profile=config.profiles[name])


def _open_wav(target: BinaryIO | str | Path, rate: int) -> wave.Wave_write:
    wav = wave.open(target if not isinstance(target, Path) else str(target), "wb")
    wav.setnchannels(1)
    wav.setsampwidth(WIDTH)
    wav.setframerate(rate)
    return wav


def voice_choice(args: argparse.Namespace, config: ServerConfig, segments: list[Sentence],
                 catalog: VoiceCatalog | None) -> VoiceChoice:  # fmt: skip
    """--voice for every segment; else with --batch a voice of each segment's language, without
    it one of the whole text's (as the server picks one for a request). From ``catalog`` (the
    speakers spk2info.pt names) if given, else from the loaded model's."""
    wanted = {"name": args.voice} if args.voice else None
    return VoiceChoice(wanted, config.voice, text_language=text_language(segments),
                       per_sentence=args.batch, catalog=catalog)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from wyoming_cosyvoice.errors import VoiceNotFoundError
    from wyoming_cosyvoice.models.download import ModelNotFoundError
    from wyoming_cosyvoice.models.model import resolve_model_dir, speakers_before_load

    try:
        config = settings(args)
        text = read_text(args)
    except (ConfigError, ValueError, OSError) as err:
        _LOGGER.error("%s", err)
        return 2
    segments = split_text(text)
    if not segments:
        _LOGGER.error("the text has nothing to speak")
        return 2
    try:
        model_dir = resolve_model_dir(config)
    except ModelNotFoundError as err:
        _LOGGER.error("%s", err)
        return 1
    # The voices are checked before the (slow) model load: spk2info.pt names the speakers
    # (CosyVoice2: the built-in voices already made).
    speakers = speakers_before_load(config, model_dir)
    catalog = VoiceCatalog(speakers) if speakers else None
    voices = voice_choice(args, config, segments, catalog)
    if catalog is not None:
        try:
            for segment in segments:
                voices.resolve(catalog, None, segment)
        except VoiceNotFoundError as err:
            _LOGGER.error("%s", err)
            return 2
    output = FileOutput(args, config.profile.name)
    try:
        return asyncio.run(speak(config, model_dir, segments, voices, args, output))
    except KeyboardInterrupt:
        _LOGGER.warning("Interrupted: the file holds the segments finished so far")
        return 130


async def speak(config: ServerConfig, model_dir: Path, segments: list[Sentence],
                voices: VoiceChoice, args: argparse.Namespace,
                output: FileOutput) -> int:  # fmt: skip
    """Load the model, then speak ``segments`` into ``output`` through the speech pipeline."""
    from engine.core.types import EngineError
    from wyoming_cosyvoice.errors import ClientError
    from wyoming_cosyvoice.models.model import scheduler_for_config

    # The profile's weight formats, as the server would load them; one synthesis, no warm-up.
    scheduler = scheduler_for_config(replace(config, warmup=False), model_dir)
    try:
        try:
            await scheduler.load()
        except EngineError as err:
            _LOGGER.error("%s", err)
            return 1
        settings = SpeechSettings(config.profile, config.seed, config.force_tokens)
        speech = Speech(scheduler, settings, voices, config.limits, client=output.name,
                        skip_failed=args.batch)  # fmt: skip
        for segment in segments:
            speech.say(segment)
        speech.end()
        try:
            with output.open(len(segments), args.batch and not args.quiet, speech.sample_rate):
                while (event := await speech.next()) is not None:
                    output.add(event)
                    if isinstance(event, Audio):
                        speech.delivered(event.samples)
        except (ClientError, EngineError, ValueError) as err:  # TextInputError: a ValueError
            _LOGGER.error("Synthesis failed: %s", err)
            return 2 if isinstance(err, ClientError) else 1
        finally:
            speech.cancel()
        return 0
    finally:
        scheduler.shutdown()


@dataclass
class FileOutput:
    """The pipeline's events → one WAV file (``-``: stdout), the segment files, a progress bar."""

    args: argparse.Namespace
    profile: str
    frames: int = 0
    skipped: int = 0
    _segment: bytes = b""  # the audio of the segment being spoken
    _text: str = ""  # and its text

    @property
    def name(self) -> str:
        return "stdout" if self.args.output == "-" else str(self.args.output)

    def open(self, segments: int, progress: bool, rate: int) -> FileOutput:
        from tqdm import tqdm

        self.rate, self.total = rate, segments
        self._target: BinaryIO | Path = io.BytesIO() if self.args.output == "-" else Path(
            self.args.output)  # fmt: skip
        if self.args.segments_dir is not None:
            self.args.segments_dir.mkdir(parents=True, exist_ok=True)
        self._wav = _open_wav(self._target, self.rate)
        self._bar = tqdm(total=segments, unit="seg", desc="Synthesizing", file=sys.stderr,
                         disable=not progress, dynamic_ncols=True)  # fmt: skip
        self._voices: dict[str, None] = {}
        self._started = time.monotonic()
        return self

    def add(self, event: SpeechEvent) -> None:
        if isinstance(event, SentenceStart):
            self._voices[event.voice.name] = None
            self._segment, self._text = b"", event.sentence.text
        elif isinstance(event, Audio):
            self._wav.writeframes(event.pcm)
            self._segment += event.pcm
            self.frames += event.samples
        elif isinstance(event, SentenceEnd):
            if event.skipped is not None:
                self.skipped += 1
                _LOGGER.warning("Segment %d skipped (%s): %r", event.index + 1, event.skipped,
                                self._text[:60])  # fmt: skip
            if self.args.segments_dir is not None:
                name = self.args.segments_dir / f"{event.index + 1:04d}.wav"
                with _open_wav(name, self.rate) as part:
                    part.writeframes(self._segment)
            self._bar.update(1)
            self._bar.set_postfix(audio=f"{self.frames / self.rate:.1f}s", refresh=False)

    def __enter__(self) -> FileOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
        self._wav.close()  # writes the final sizes into the header
        if isinstance(self._target, io.BytesIO):
            sys.stdout.buffer.write(self._target.getvalue())
            sys.stdout.buffer.flush()
        _LOGGER.info(
            "Wrote %s: %d segment(s)%s, %.1f s of audio (%s, %s profile) in %.1f s",
            self.name, self.total, f", {self.skipped} skipped" if self.skipped else "",
            self.frames / self.rate, ", ".join(self._voices), self.profile,
            time.monotonic() - self._started,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
