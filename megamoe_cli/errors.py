"""Domain errors: each names what was expected and what came."""


class MegaMoEError(ValueError):
    """Bad input or configuration; the CLI prints it as one line, no traceback."""


class MegaMoETimeout(RuntimeError):
    """A cross-rank wait or a rank ran past its deadline."""
