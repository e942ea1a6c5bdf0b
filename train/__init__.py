"""Training workbench for learned eviction modules (run from the repository root): config, losses, Trainer, run."""
