"""Wyoming protocol server for CosyVoice-300M text to speech (Home Assistant)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("wyoming-cosyvoice")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
