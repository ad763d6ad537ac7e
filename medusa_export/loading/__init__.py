"""Loading: backbone architectures and checkpoints, Medusa head files, the model registry.

Modules: ``backbone`` (HF directories, the HF cache, GGUF, installed packages -> the
reference backbone), ``heads_formats`` (the Medusa head file formats), ``accuracies`` and
``draft_vocab`` (the calibrated head accuracies and the draft vocabulary saved beside the
heads), ``registry`` (``models/registry.json`` and loading a Medusa model by name).
"""
