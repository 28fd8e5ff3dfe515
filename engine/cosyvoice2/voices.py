"""CosyVoice2's voices: the built-in ones an engine offers (none ship with the model; the
server makes them from v1's speakers) and those of a voices folder, and which one a request
names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from engine.core.types import UnknownSpeakerError
from engine.cosyvoice2.prompt import COSYVOICE2

if TYPE_CHECKING:
    from engine.api import Engine
    from engine.core.types import SynthesisOptions
    from engine.prompt.recipe import PromptRecipe
    from engine.prompt.voices import CustomVoice, ScanResult, VoiceLibrary

KIND = "cosyvoice2"


class VoicesMixin:
    """The engine's voices by name: built-in ones (:meth:`add_voice`) and a voices folder's."""

    # How the family's voices are made from a recording (and which voices it takes).
    recipe: ClassVar[PromptRecipe] = COSYVOICE2
    model_dir: Path
    # Voices offered without a voices folder, and their names in the order added.
    voices: dict[str, CustomVoice]
    speakers: list[str]
    custom_voices: VoiceLibrary | None

    def add_voice(self, voice: CustomVoice) -> None:
        """Offer ``voice`` (prompt features of the family's recipe) as a built-in speaker, by
        its name."""
        family = self.recipe.family
        if voice.family != family:
            raise ValueError(f"voice {voice.name!r} was prepared for {voice.family}, not {family}")
        if voice.name not in self.voices:
            self.speakers.append(voice.name)
        self.voices[voice.name] = voice

    @classmethod
    def make_voices(
        cls,
        source: Engine,
        model_dir: Path,
        folder: Path,
        options: SynthesisOptions,
        on_speaker: Callable[[int, int, str], None] = lambda number, count, speaker: None,
    ) -> None:
        """Make v2 prompt voices in ``folder`` from the v1 engine ``source``'s speakers, one
        at a time (:func:`engine.cosyvoice2.builtin_voices.make_builtin_voices`)."""
        from engine.cosyvoice2.builtin_voices import make_builtin_voices
        from engine.cosyvoice2.prompt import prompt_models

        models = prompt_models(model_dir, recipe=cls.recipe)
        try:
            speakers = list(source.speakers)
            for number, speaker in enumerate(speakers, 1):
                on_speaker(number, len(speakers), speaker)
                make_builtin_voices(
                    source,
                    folder,
                    models,
                    speakers=[speaker],
                    options=options,
                    recipe=cls.recipe,
                )
        finally:
            models.close()

    def add_voices_from(self, folder: Path) -> ScanResult:
        """Offer the voices of ``folder`` (the family's prompts, made once) as built-in
        speakers."""
        from engine.cosyvoice2.prompt import prompt_models, voice_library

        models = prompt_models(self.model_dir, recipe=self.recipe)
        result = voice_library(folder, models, recipe=self.recipe).scan()
        for voice in result.voices.values():
            self.add_voice(voice)
        return result

    def enable_custom_voices(self, voices_dir: Path | str) -> ScanResult:
        """Use NAME.wav + NAME.txt voices from ``voices_dir`` (call again to re-scan)."""
        from engine.cosyvoice2.prompt import prompt_models, voice_library

        if self.custom_voices is None or self.custom_voices.voices_dir != Path(voices_dir):
            self.custom_voices = voice_library(
                voices_dir,
                prompt_models(self.model_dir, recipe=self.recipe),
                reserved=self.speakers,
                recipe=self.recipe,
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
