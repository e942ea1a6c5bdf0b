"""The shared cache runtime: ``BudgetCache``/``BudgetLayer`` and the ``"kvgates"`` attention function."""
