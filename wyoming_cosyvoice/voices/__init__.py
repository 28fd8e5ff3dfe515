"""What a voice is to the server: the catalogue of names and speakers, what a name may be,
the preset speakers (speeds, styles) and every voice's loudness."""
