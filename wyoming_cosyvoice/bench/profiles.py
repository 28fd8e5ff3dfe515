"""The server's profiles (config.yaml) as the engine benchmark's profiles, each with the weight
formats a server started with that profile loads (``ServerConfig.load``): its LM's (its own
``lm_weights``, or ``server.lm_weights`` where that names one for every profile), its flow's
and its HiFT's."""

from __future__ import annotations

from pathlib import Path

from engine.bench.profiles import BenchProfile
from wyoming_cosyvoice.config import load_config


def server_profiles(config: Path | None = None) -> dict[str, BenchProfile]:
    """Every profile of ``config`` (default: the server's config.yaml), by name."""
    settings = load_config(config)
    source = str(config) if config else "config.yaml"
    profiles = {}
    for name, profile in settings.profiles.items():
        weights = load_config(config, [("server.profile", name)]).load.weights
        profiles[name] = BenchProfile(
            name,
            profile.schedule,
            profile.n_timesteps,
            profile.cfg_rate,
            source,
            flow_weights=weights.flow,
            hift_weights=weights.hift,
            lm_weights=weights.lm,
            solver=profile.solver,
        )
    return profiles
