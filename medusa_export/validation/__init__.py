"""Validation: an artifact against the PyTorch reference, its JUnit report, manifest updates.

Modules: ``config`` (the validation's options), ``plan`` (the pre-flight: the checks that fit in memory), ``checks`` (running them),
``validate`` (ONNX Runtime vs PyTorch, token by token), ``junit`` (the CI report),
``manifest_update`` (later stages record their results in an artifact's manifest).
"""
