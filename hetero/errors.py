"""Errors raised for bad user input: each message names the field, the numbers and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any process group exists."""
