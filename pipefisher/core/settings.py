"""The error of a bad run setting. Pure Python."""


class ConfigError(ValueError):
    """A bad run file or override; the message names the key and what is allowed."""
