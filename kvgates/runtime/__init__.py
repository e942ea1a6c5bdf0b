"""The shared cache runtime: ``BudgetCache``/``BudgetLayer`` and the ``"kvgates"`` attention function.

Importing any part of the runtime checks the transformers version (``check_transformers``) and registers the
``"kvgates"`` attention with transformers (``attention.register``).
"""

import transformers
from packaging.version import Version

#: The oldest transformers release the runtime works with (pyproject.toml's lower bound). Older ones import, but
#: their Cache layer types differ: transformers 5.17 (a GPU machine's own install) made ``BudgetCache`` of a plain
#: Llama config fail with "no full-attention layer".
MIN_TRANSFORMERS = "5.23"


def check_transformers(version: str = transformers.__version__) -> None:
    """Raise ``ImportError`` in one sentence when ``version`` of transformers is older than ``MIN_TRANSFORMERS``."""
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"kvgates needs transformers {MIN_TRANSFORMERS} or newer (its cache runtime hooks into that release's "
            f"Cache layers and attention interface), but this Python imports transformers {version} from "
            f"{transformers.__path__[0]}: pip install 'transformers>={MIN_TRANSFORMERS},<5.24'"
        )


check_transformers()

from kvgates.runtime import attention as _attention  # noqa: E402  (after the version check)

_attention.register()
