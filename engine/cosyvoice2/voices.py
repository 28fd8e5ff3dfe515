"""CosyVoice2's voices: the built-in ones an engine offers (none ship with the model; the
server makes them from v1's speakers) and those of a voices folder, and which one a request
names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.types import UnknownSpeakerError
from engine.cosyvoice2.prompt import COSYVOICE2

if TYPE_CHECKING:
    from engine.prompt.voices import CustomVoice, ScanResult, VoiceLibrary

KIND = "cosyvoice2"


class VoicesMixin:
    """The engine's voices by name: built-in ones (:meth:`add_voice`) and a voices folder's."""

    model_dir: Path
    # Voices offered without a voices folder, and their names in the order added.
    voices: dict[str, CustomVoice]
    speakers: list[str]
    custom_voices: VoiceLibrary | None

    def add_voice(self, voice: CustomVoice) -> None:
        """Offer ``voice`` (v2 prompt features) as a built-in speaker, by its name."""
        if voice.family != COSYVOICE2.family:
            raise ValueError(f"voice {voice.name!r} was prepared for {voice.family}, not {KIND}")
        if voice.name not in self.voices:
            self.speakers.append(voice.name)
        self.voices[voice.name] = voice

    def enable_custom_voices(self, voices_dir: Path | str) -> ScanResult:
        """Use NAME.wav + NAME.txt voices from ``voices_dir`` (call again to re-scan)."""
        from engine.cosyvoice2.prompt import prompt_models, voice_library

        if self.custom_voices is None or self.custom_voices.voices_dir != Path(voices_dir):
            self.custom_voices = voice_library(
                voices_dir, prompt_models(self.model_dir), reserved=self.speakers
            )
        return self.custom_voices.scan()

    def _voice(self, name: str | None) -> CustomVoice:
        """The voice a request names (None: the first built-in one, else the first custom)."""
        custom = self.custom_voices
        if name:
            found = custom.get(name) if custom is not None else None
            found = found or self.voices.get(name)
            if found is not None:
                return found
            names = [*self.speakers, *(custom.names() if custom is not None else [])]
            available = ", ".join(names) or "none"
            raise UnknownSpeakerError(f"unknown voice {name!r}; available: {available}")
        if self.speakers:
            return self.voices[self.speakers[0]]
        first = custom.names()[:1] if custom is not None else []
        if first and custom is not None and (voice := custom.get(first[0])) is not None:
            return voice
        raise UnknownSpeakerError(
            f"model {self.model_dir.name} has no built-in speakers and no voice was given: "
            "it speaks in the voice of a prompt recording (a voices folder with NAME.wav + "
            "NAME.txt)"
        )
