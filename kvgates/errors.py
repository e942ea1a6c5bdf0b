"""Exceptions kvgates raises for inputs it cannot handle."""


class UnsupportedModelError(ValueError):
    """A model kvgates cannot load or budget: not a model, unreachable, or an architecture whose attention and
    caching do not go the way kvgates needs."""


class AdapterError(ValueError):
    """A gate adapter is corrupt, incomplete, or was trained for another model."""


class ConfigError(ValueError):
    """A run config (training or evaluation YAML, with its overrides) that cannot run; the message is one sentence
    saying what is wrong."""
