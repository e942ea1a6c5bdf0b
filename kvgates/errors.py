"""Exceptions kvgates raises for inputs it cannot handle."""


class UnsupportedModelError(ValueError):
    """A model kvgates cannot load or budget: not a model, unreachable, or an architecture whose attention and
    caching do not go the way kvgates needs."""


class AdapterError(ValueError):
    """A gate adapter is corrupt, incomplete, or was trained for another model."""


class ConfigError(ValueError):
    """A run config (training or evaluation YAML, with its overrides) that cannot run; the message is one sentence
    saying what is wrong."""


class HubPushError(ConnectionError):
    """A gate adapter could not be pushed to the Hub (no network, ``HF_HUB_OFFLINE``, a refused token, an HTTP error):
    ``repo_id`` says where to and ``reason`` (the Hub client's error, one line) why."""

    def __init__(self, repo_id: str, reason: str):
        self.repo_id, self.reason = repo_id, reason
        super().__init__(
            f"could not push the adapter to the Hub repository {repo_id} ({reason}); check the network, HF_HUB_OFFLINE and "
            "your token, or save it with save_pretrained and upload it later"
        )
