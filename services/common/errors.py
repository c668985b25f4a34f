"""One shape for errors that carry a stable reason: ``code`` for programs (metrics
labels, retries, error replies), ``message`` for people."""


class CodedError(Exception):
    """An error with a stable ``code`` for programs and a ``message`` for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BadTask(ValueError):
    """A task a worker cannot run as placed (wrong node, inconsistent blocks or slots).
    Here, not in services.worker, because the prefill queue (a pure policy) raises it too."""
