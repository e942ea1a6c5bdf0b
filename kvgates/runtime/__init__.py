"""The shared cache runtime: ``BudgetCache``/``BudgetLayer`` and the ``"kvgates"`` attention function.

Importing any part of the runtime registers the ``"kvgates"`` attention with transformers (``attention.register``).
"""

from kvgates.runtime import attention as _attention

_attention.register()
