"""Voices from recordings: the voices folder and its scans, and what the web page's voice maker
needs (the recording's check, its transcript, the new voice's files)."""
