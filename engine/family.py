"""Model families: which engine runs a model directory, told by the config file it holds.

=================  ===============================================  =========================
config file        models                                           engine
=================  ===============================================  =========================
cosyvoice.yaml     CosyVoice-300M, -300M-SFT, -300M-Instruct (v1)   engine.cosyvoice1.engine
cosyvoice2.yaml    CosyVoice2-0.5B                                   engine.cosyvoice2.engine
=================  ===============================================  =========================

A family names its engine class and the :class:`~engine.core.prepared.ModelParts` that prepare and
load its weights; both are imported only when used. It also holds what a caller needs to know
before the engine has loaded, read without torch: its official models and the files each needs,
the rate it speaks at, its prompt voices' cache files, whether and how it takes instructions.
Another family (e.g. Fun-CosyVoice3's ``cosyvoice3.yaml``) is one more entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.core.types import ModelLoadError

if TYPE_CHECKING:
    from engine.core.prepared import ModelParts

# Config files of families the engine knows but cannot run (a clearer error than "no config").
_UNSUPPORTED = {"cosyvoice3.yaml": "Fun-CosyVoice3"}


# How a model reads a style instruction (SynthesisOptions.instruct; engine.api.Engine's
# instruction_form): v1's -Instruct model a description of the speaker in place of the speaker ...
DESCRIBED_SPEAKER = "described-speaker"
# ... CosyVoice2 (instruct2) an instruction to any voice, in Chinese for emotions and dialects.
INSTRUCT2 = "instruct2"
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


FAMILIES = (
    Family(
        "cosyvoice",
        "CosyVoice v1",
        "cosyvoice.yaml",
        "engine.cosyvoice1.engine:CosyVoiceEngine",
        "engine.core.prepared:V1_PARTS",
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


def instruct_models() -> list[str]:
    """The official models that take an instruction."""
    return [
        model
        for family in FAMILIES
        for model in family.models
        if family.instruction_form_of(family.kind_of(model)) is not None
    ]


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)


def model_family(model_dir: Path | str) -> Family:
    """The family of an official model directory (ModelLoadError if it is none we know)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    found = [family for family in FAMILIES if (model_dir / family.config_file).is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        names = ", ".join(family.config_file for family in found)
        raise ModelLoadError(f"model directory {model_dir} holds several model configs: {names}")
    for config, name in _UNSUPPORTED.items():
        if (model_dir / config).is_file():
            raise ModelLoadError(f"{model_dir}: {name} models ({config}) are not supported yet")
    expected = " or ".join(f"{family.config_file} ({family.label})" for family in FAMILIES)
    raise ModelLoadError(f"model directory {model_dir} is incomplete: missing {expected}")


def load_engine(model_dir: Path | str, **options: Any) -> Any:
    """The engine of ``model_dir``'s family, loaded (``options``: its ``load`` keywords:
    threads, lm_int8, flow_int8, hift_bf16, cache_dir, ...): an ``engine.api.Engine``."""
    return model_family(model_dir).engine_class().load(model_dir, **options)
