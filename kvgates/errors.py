"""Exceptions kvgates raises for inputs it cannot handle."""


class UnsupportedModelError(ValueError):
    """The model's architecture does not route attention and caching the way kvgates needs."""


class AdapterError(ValueError):
    """A gate adapter is corrupt, incomplete, or was trained for another model."""
