"""Corpora and synthetic long-context tasks for training and evaluating kvgates (workbench, run from the repo root)."""
