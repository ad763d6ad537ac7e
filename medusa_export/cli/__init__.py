"""The ``medusa-export`` command line (entry point :func:`medusa_export.cli.main.main`).

Modules: ``main`` (the parser and the model, build, verify and triton commands), ``heads``
(``train-heads``, ``calibrate``), ``trt`` (``engine`` and ``build --engine trt``), ``doctor``.
"""
