class EngineInputError(ValueError):
    """Bad input to the engine: the message says what to change. Never fatal to the step loop."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can complete."""
