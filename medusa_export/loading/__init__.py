"""Loading: backbone architectures and checkpoints, Medusa head files, the model registry.

Modules: ``backbone`` (HF directories, the HF cache, GGUF, installed packages -> the
reference backbone), ``heads_formats`` (the Medusa head file formats), ``registry``
(``models/registry.json`` and loading a Medusa model by name).
"""
