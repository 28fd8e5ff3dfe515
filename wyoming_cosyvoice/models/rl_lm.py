"""``server.rl_tuned_lm``: a model's RL-tuned LM in place of its LM (Fun-CosyVoice3-0.5B's
``llm.rl.pt``, :attr:`engine.family.Family.rl_lm_file`).

The file is no part of a model directory the server needs (``Family.model_files``): it is
fetched beside the model's files on the first start that asks for it, as the prompt models are
(resumable, verified), and the engine loads it in place of ``llm.pt``. Offline, or with a
``--model-dir`` that lacks it, the start fails saying where to put it or to turn the setting
off. A model of a family without one runs its own LM, with a WARNING that the setting does
nothing for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.family import Family
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.models.download import (
    DownloadError,
    ModelNotFoundError,
    ensure_extra_files,
)

_LOGGER = logging.getLogger(__name__)


def ensure_rl_lm(config: ServerConfig, model_dir: Path, family: Family) -> None:
    """With ``server.rl_tuned_lm``: the RL-tuned LM of ``model_dir`` (of ``family``) is there,
    downloaded if need be (:class:`ModelNotFoundError` saying what to do if it cannot be)."""
    if not config.rl_tuned_lm:
        return
    name = family.rl_lm_file
    if name is None:
        _LOGGER.warning(
            "server.rl_tuned_lm: %s has no RL-tuned LM; it runs its own", model_dir.name
        )
        return
    if (model_dir / name).is_file():
        return
    repo = family.models[family.base_model]
    turn_off = "or turn server.rl_tuned_lm off (the add-on's rl_tuned_lm option)"
    if config.model_dir is not None:
        raise ModelNotFoundError(
            f"server.rl_tuned_lm is on but --model-dir {model_dir} has no {name}: download it "
            f"from https://huggingface.co/{repo} into {model_dir.absolute()}/, {turn_off}"
        )
    _LOGGER.info("server.rl_tuned_lm: fetching %s for %s", name, model_dir.name)
    try:
        ensure_extra_files(
            model_dir,
            config.model,
            (name,),
            offline=config.offline,
            endpoint=config.hub_endpoint,
        )
    except (ModelNotFoundError, DownloadError) as err:
        raise ModelNotFoundError(f"server.rl_tuned_lm is on, but {err}; {turn_off}") from err
