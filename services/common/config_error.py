"""The error every configuration check raises, below both the config models and the chat templates
(the model section validates its template through them)."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the offending key."""
