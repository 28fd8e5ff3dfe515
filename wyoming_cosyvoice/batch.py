"""``python -m wyoming_cosyvoice synthesize``: text (argument, file or stdin) → a WAV file.

Without ``--batch`` the text is spoken in one engine call, with the server's default profile.
With ``--batch`` (audiobooks, chapters) the text is split into sentence segments, each is
synthesized with the ``batch`` profile (whole-sentence, best quality; no streaming), and all are
written one after another into one WAV file while a progress bar counts segments. Without
``--voice`` each segment gets a voice of its own language, as the server picks one. A segment
the text frontend refuses is skipped with a warning instead of losing a long run.

Runs the engine directly on this thread: no server, no event loop.
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
import time
import wave
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from wyoming_cosyvoice.config import ConfigError, ServerConfig, load_config, parse_override

_LOGGER = logging.getLogger("wyoming_cosyvoice.batch")
WIDTH = 2


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
    add("--config", type=Path, help="settings file (default: the repository's config.yaml)")
    add("--model", help="CosyVoice-300M-SFT (default), CosyVoice-300M or CosyVoice-300M-Instruct")
    add("--model-dir", help="use this model directory instead of searching the data dirs")
    add("--data-dir", action="append", help="directory searched for models (repeatable)")
    add("--offline", action="store_true", help="never download a model")
    add("--threads", type=int, help="CPU threads for the engine")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    add("--force-tokens", type=int, help="fix the speech tokens per segment (tests, benchmarks)")
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
    if name is None:
        return config
    if name not in config.profiles:
        known = ", ".join(config.profiles)
        raise ConfigError("--profile", f"unknown profile {name!r} (known: {known})")
    return replace(config, profile=config.profiles[name])


def segments_of(text: str, batch: bool) -> list[str]:
    from wyoming_cosyvoice.sentences import has_speech, make_splitter, split_all

    if not batch:
        return [text] if has_speech(text) else []
    return [s for s in split_all(text, make_splitter()) if has_speech(s)]


def _open_wav(target: BinaryIO | str | Path, rate: int) -> wave.Wave_write:
    wav = wave.open(target if not isinstance(target, Path) else str(target), "wb")
    wav.setnchannels(1)
    wav.setsampwidth(WIDTH)
    wav.setframerate(rate)
    return wav


def run(args: argparse.Namespace) -> int:
    from wyoming_cosyvoice.__main__ import resolve_model_dir
    from wyoming_cosyvoice.download import ModelNotFoundError
    from wyoming_cosyvoice.http.speech import synthesis_options
    from wyoming_cosyvoice.info import Voice, VoiceCatalog
    from wyoming_cosyvoice.protocol import VoiceNotFoundError
    from wyoming_cosyvoice.server import engine_loader, peek_speakers

    try:
        config = settings(args)
        text = read_text(args)
    except (ConfigError, ValueError, OSError) as err:
        _LOGGER.error("%s", err)
        return 2
    segments = segments_of(text, args.batch)
    if not segments:
        _LOGGER.error("the text has nothing to speak")
        return 2
    try:
        model_dir = resolve_model_dir(config)
    except ModelNotFoundError as err:
        _LOGGER.error("%s", err)
        return 1

    # The voices are checked before the (slow) model load: spk2info.pt names the speakers.
    # Without --voice (or a configured default) each segment gets a voice of its own language,
    # chosen as the server chooses one for a request.
    def pick_voices(speakers: list[str]) -> list[Voice]:
        wanted = {"name": args.voice} if args.voice else {}
        catalog = VoiceCatalog(speakers)
        return [catalog.resolve(wanted, default=config.voice, text=s) for s in segments]

    speakers = peek_speakers(model_dir)
    try:
        voices = pick_voices(speakers) if speakers else None
    except VoiceNotFoundError as err:
        _LOGGER.error("%s", err)
        return 2

    from engine.constants import SAMPLE_RATE
    from engine.types import EngineError

    try:
        # The profile's weight formats, as the server would load them (batch: float32 flow).
        engine = engine_loader(config)(model_dir, config.threads)
        if voices is None:
            voices = pick_voices(engine.speakers)
    except (EngineError, VoiceNotFoundError) as err:
        _LOGGER.error("%s", err)
        return 1 if isinstance(err, EngineError) else 2
    options = [replace(synthesis_options(config.profile, voice.speaker, config.seed),
                       force_tokens=args.force_tokens) for voice in voices]  # fmt: skip
    names = ", ".join(dict.fromkeys(voice.name for voice in voices))
    return write(engine, segments, options, args, SAMPLE_RATE, names, config.profile.name)


def write(engine: Any, segments: list[str], options: list[Any], args: argparse.Namespace,
          rate: int, voices: str, profile: str) -> int:  # fmt: skip
    """Synthesize ``segments`` in order, each with its ``options``, into one WAV (and the
    segment files)."""
    from tqdm import tqdm

    from engine.types import EngineError

    to_stdout = args.output == "-"
    target: BinaryIO | Path = io.BytesIO() if to_stdout else Path(args.output)
    if args.segments_dir is not None:
        args.segments_dir.mkdir(parents=True, exist_ok=True)
    started, frames, skipped, code = time.monotonic(), 0, 0, 0
    bar = tqdm(total=len(segments), unit="seg", desc="Synthesizing", file=sys.stderr,
               disable=args.quiet or not args.batch, dynamic_ncols=True)  # fmt: skip
    wav = _open_wav(target, rate)
    try:
        for index, segment in enumerate(segments):
            try:
                chunks = engine.synthesize(segment, options[index])
                pcm = b"".join(chunk.pcm16 for chunk in chunks)
            except (EngineError, ValueError) as err:  # TextInputError is a ValueError
                if not args.batch:
                    raise
                skipped += 1
                _LOGGER.warning("Segment %d skipped (%s): %r", index + 1, err, segment[:60])
                pcm = b""
            wav.writeframes(pcm)
            frames += len(pcm) // WIDTH
            if args.segments_dir is not None:
                with _open_wav(args.segments_dir / f"{index + 1:04d}.wav", rate) as part:
                    part.writeframes(pcm)
            bar.update(1)
            bar.set_postfix(audio=f"{frames / rate:.1f}s", refresh=False)
    except KeyboardInterrupt:
        _LOGGER.warning("Interrupted: the file holds the segments finished so far")
        code = 130
    except (EngineError, ValueError) as err:
        _LOGGER.error("Synthesis failed: %s", err)
        code = 1
    finally:
        bar.close()
        wav.close()  # writes the final sizes into the header
    if to_stdout:
        assert isinstance(target, io.BytesIO)
        sys.stdout.buffer.write(target.getvalue())
        sys.stdout.buffer.flush()
    elapsed = time.monotonic() - started
    _LOGGER.info(
        "Wrote %s: %d segment(s)%s, %.1f s of audio (%s, %s profile) in %.1f s",
        "stdout" if to_stdout else args.output, len(segments),
        f", {skipped} skipped" if skipped else "", frames / rate, voices, profile, elapsed,
    )  # fmt: skip
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
