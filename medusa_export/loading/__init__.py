"""Loading: backbone architectures and checkpoints, Medusa head files, the model registry.

Modules: ``architectures`` (config.json of each family <-> the backbone's feature switches),
``backbone`` (HF directories, the HF cache, GGUF, installed packages -> the reference backbone),
``hf_folder`` (the weight files of an HF folder), ``fp8`` (modelopt FP8 detection and
dequantization, for the loaded reference and the tensor sources alike), ``checkpoint`` (tensor
sources: a checkpoint read tensor by tensor from its headers, for ``build``), ``sources`` (a model
opened as tensor sources, :func:`~.sources.open_model`; the reference built from them), ``gguf_meta`` (what a GGUF header declares), ``heads_formats`` (the Medusa head
file formats), ``accuracies`` and ``draft_vocab`` (the calibrated head accuracies and the draft
vocabulary saved beside the heads), ``registry`` (``models/registry.json`` and loading a Medusa
model by name), ``transformers_twin`` (a transformers model sharing the reference's weights).
"""
