"""Triton Inference Server: a model repository for an artifact, and a local server to run it.

Modules: ``repository`` (``medusa-export triton``: writes the repository), ``local`` (starts the
tritonserver bundled in nvidia-pytriton), ``model`` (the Python-backend model: a template
copied into each repository, never imported by medusa_export).
"""
