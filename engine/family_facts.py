"""What is known of each model family before one of its models loads, read without torch and
without importing any engine: its official models and the files each needs, the rate it speaks
at, its prompt voices' cache files, whether and how it takes instructions, and the names of its
engine class and model parts (imported only when asked, by :mod:`engine.family`).

The families' own packages and the prompt package read these facts too, so this module sits
below them (``[tool.importlinter]``); :mod:`engine.family` finds a directory's family and loads
its engine.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from engine.core.prepared import ModelParts

# How a model reads a style instruction (SynthesisOptions.instruct; engine.api.Engine's
# instruction_form): v1's -Instruct model a description of the speaker in place of the speaker ...
DESCRIBED_SPEAKER = "described-speaker"
# ... CosyVoice2 (instruct2) an instruction to any voice, in Chinese for emotions and dialects ...
INSTRUCT2 = "instruct2"
# ... CosyVoice3 an instruction to any voice inside its system prompt, trained on a fixed set
# (the official ``instruct_list``: dialects, loud or soft, slow or fast, happy, sad, angry, ...).
INSTRUCT3 = "instruct3"
# Every voice cache a prompt recipe writes beside a voice ends with this (engine.prompt.recipe).
PROMPT_CACHE_ENDING = ".prompt.pt"


@dataclass(frozen=True)
class Family:
    """One model family: its config file, engine class and model parts ("module:name"), and
    what is known of its models before one loads."""

    name: str
    label: str  # for people
    config_file: str
    engine: str
    parts: str
    # Official model name -> its Hugging Face repository.
    models: Mapping[str, str]
    # The model whose repository completes a directory of this family (e.g. its prompt models).
    base_model: str
    model_files: tuple[str, ...]  # what a model directory of this family needs
    prompt_model_files: tuple[str, ...]  # the ONNX models its prompt voices are extracted with
    prompt_cache_suffix: str  # NAME + this: a prompt voice's cache file (its PromptRecipe's)
    sample_rate: int  # of its audio
    token_rate: int  # speech tokens per second of audio
    # How its instruct models read an instruction (engine.api), and which kinds those are.
    instruction_form: str
    instruct_kinds: tuple[str, ...]
    # The kind of its every model; None: told by the directory's name (v1's -SFT, -Instruct).
    kind: str | None = None
    # Its models ship no speakers: their built-in voices are made from this model's.
    voices_from: str | None = None
    # Its RL-tuned LM's checkpoint, an optional file of its models (downloaded when chosen);
    # None: it has none.
    rl_lm_file: str | None = None

    def engine_class(self) -> Any:
        return _resolve(self.engine)

    def model_parts(self) -> ModelParts:
        parts: ModelParts = _resolve(self.parts)
        return parts

    def kind_of(self, model_dir: Path | str) -> str:
        """The kind of this family's model in ``model_dir``."""
        return self.kind or detect_model_kind(Path(model_dir))

    def instruction_form_of(self, kind: str) -> str | None:
        """How a model of ``kind`` reads an instruction; None: it takes none."""
        return self.instruction_form if kind in self.instruct_kinds else None


class OfFamily:
    """What an engine class knows of its family: the family's entry, and the instruction form
    of its model's kind. Each family's engine class inherits it and names its ``family``."""

    family: ClassVar[Family]
    kind: str  # the loaded model's kind

    @property
    def instruction_form(self) -> str | None:
        """How this model reads an instruction (engine.api); None: it takes none."""
        return self.family.instruction_form_of(self.kind)


def detect_model_kind(model_dir: Path) -> str:
    """A v1 model's kind, from the official directory names: 'instruct', 'base' or 'sft'."""
    name = model_dir.name.lower()
    if "instruct" in name:
        return "instruct"
    if name.endswith("300m") or name.endswith("300m-base"):
        return "base"
    return "sft"


COSYVOICE3 = Family(
    "cosyvoice3",
    "Fun-CosyVoice3",
    "cosyvoice3.yaml",
    "engine.cosyvoice3.engine:CosyVoice3Engine",
    "engine.cosyvoice3.model_dir:PARTS",
    models={"Fun-CosyVoice3-0.5B": "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"},
    base_model="Fun-CosyVoice3-0.5B",
    # As CosyVoice2's; the RL-tuned LM (rl_lm_file) is an optional extra.
    model_files=(
        "cosyvoice3.yaml",
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "CosyVoice-BlankEN/config.json",
        "CosyVoice-BlankEN/vocab.json",
        "CosyVoice-BlankEN/merges.txt",
        "CosyVoice-BlankEN/tokenizer_config.json",
    ),
    prompt_model_files=("campplus.onnx", "speech_tokenizer_v3.onnx"),
    prompt_cache_suffix=".cosyvoice3" + PROMPT_CACHE_ENDING,
    sample_rate=24000,
    token_rate=25,
    # An instruction to any voice, as CosyVoice2's, in the system prompt (its frontend puts it
    # there); its own form: it was trained on other phrasings than CosyVoice2.
    instruction_form=INSTRUCT3,
    instruct_kinds=("cosyvoice3",),
    kind="cosyvoice3",
    voices_from="CosyVoice-300M-SFT",
    rl_lm_file="llm.rl.pt",
)


FAMILIES = (
    Family(
        "cosyvoice",
        "CosyVoice v1",
        "cosyvoice.yaml",
        "engine.cosyvoice1.engine:CosyVoiceEngine",
        "engine.cosyvoice1.model_dir:PARTS",
        models={
            "CosyVoice-300M-SFT": "FunAudioLLM/CosyVoice-300M-SFT",
            "CosyVoice-300M-Instruct": "FunAudioLLM/CosyVoice-300M-Instruct",
            "CosyVoice-300M": "FunAudioLLM/CosyVoice-300M",
        },
        base_model="CosyVoice-300M",
        model_files=("cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt", "spk2info.pt"),
        prompt_model_files=("campplus.onnx", "speech_tokenizer_v1.onnx"),
        prompt_cache_suffix=PROMPT_CACHE_ENDING,
        sample_rate=22050,
        token_rate=50,
        instruction_form=DESCRIBED_SPEAKER,
        instruct_kinds=("instruct",),
    ),
    Family(
        "cosyvoice2",
        "CosyVoice2",
        "cosyvoice2.yaml",
        "engine.cosyvoice2.engine:CosyVoice2Engine",
        "engine.cosyvoice2.model_dir:PARTS",
        models={"CosyVoice2-0.5B": "FunAudioLLM/CosyVoice2-0.5B"},
        base_model="CosyVoice2-0.5B",
        # The Qwen2 backbone's config and tokenizer, not its weights (they are in llm.pt).
        model_files=(
            "cosyvoice2.yaml",
            "llm.pt",
            "flow.pt",
            "hift.pt",
            "CosyVoice-BlankEN/config.json",
            "CosyVoice-BlankEN/vocab.json",
            "CosyVoice-BlankEN/merges.txt",
            "CosyVoice-BlankEN/tokenizer_config.json",
        ),
        prompt_model_files=("campplus.onnx", "speech_tokenizer_v2.onnx"),
        prompt_cache_suffix=".cosyvoice2" + PROMPT_CACHE_ENDING,
        sample_rate=24000,
        token_rate=25,
        instruction_form=INSTRUCT2,
        instruct_kinds=("cosyvoice2",),
        kind="cosyvoice2",
        voices_from="CosyVoice-300M-SFT",
    ),
    COSYVOICE3,
)


def family_named(name: str) -> Family:
    """The family called ``name`` (KeyError if none is)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(name)


def family_of_model(model: str) -> Family | None:
    """The family of an official model name; None if it is none we know."""
    return next((family for family in FAMILIES if model in family.models), None)


def instruct_models(forms: Collection[str] | None = None) -> list[str]:
    """The official models that take an instruction (``forms``: in one of these forms)."""
    return [
        model
        for family in FAMILIES
        for model in family.models
        if (form := family.instruction_form_of(family.kind_of(model))) is not None
        and (forms is None or form in forms)
    ]


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)
