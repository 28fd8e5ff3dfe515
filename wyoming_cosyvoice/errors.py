"""The errors the server reports to clients, the same over Wyoming, HTTP and the CLI.

Each front end turns a :class:`ClientError` into its own answer: a Wyoming ``error{text, code}``,
an HTTP 4xx/503 with a message, a command line's message and exit status.
"""

from __future__ import annotations


class ClientError(Exception):
    """A request the server refuses; sent to the client as ``error{text, code}``.

    ``code`` is the class name, as wyoming-piper does, so clients can match on it.
    """

    @property
    def code(self) -> str:
        return type(self).__name__


class ProtocolError(ClientError):
    """The bytes on the wire are not a well-formed Wyoming event."""


class LimitExceededError(ClientError):
    """A configured limit (header size, text length, events per connection...) was exceeded."""


class VoiceNotFoundError(ClientError):
    """The requested voice or speaker does not exist."""


class TextError(ClientError):
    """The text frontend cannot turn this text into speech."""


class StreamStateError(ClientError):
    """A streaming event arrived in the wrong order (chunk without start, ...)."""


class ServerBusyError(ClientError):
    """Too many connections, or the model could not be made ready in time."""


class SynthesisError(ClientError):
    """The engine failed on this request."""
