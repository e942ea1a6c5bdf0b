"""Evaluation workbench: tasks x policies x budgets on the shared runtime, with reports (run from the repo root)."""
