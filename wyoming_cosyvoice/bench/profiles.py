"""The server's profiles (config.yaml) as the engine benchmark's profiles."""

from __future__ import annotations

from pathlib import Path

from engine.bench.profiles import BenchProfile
from wyoming_cosyvoice.config import load_config


def server_profiles(config: Path | None = None) -> dict[str, BenchProfile]:
    """Every profile of ``config`` (default: the server's config.yaml), by name."""
    settings = load_config(config)
    source = str(config) if config else "config.yaml"
    return {
        name: BenchProfile(
            name,
            profile.schedule,
            profile.n_timesteps,
            profile.cfg_rate,
            source,
            profile.flow_weights,
            profile.hift_weights,
        )
        for name, profile in settings.profiles.items()
    }
