"""Data shipped with medusa-export: the model registry, chat templates, trained heads."""
