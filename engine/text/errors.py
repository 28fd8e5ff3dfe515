"""Errors raised by the text frontend."""


class TextInputError(ValueError):
    """The input text cannot be turned into speech (wrong type, too long, ...).

    Raised instead of letting an exception from wetext/tiktoken escape, so callers
    (the Wyoming handler, the CLI) can report a clear message to the user.
    """
