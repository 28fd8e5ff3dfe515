"""Home Assistant: the add-on's options, the discovery announcement and the other Supervisor
calls (reloading the Wyoming entry, clearing the TTS cache when the audio would change)."""
