"""The ``medusa-export`` command line (entry point :func:`medusa_export.cli.main.main`).

Modules: ``main`` (the parser and the model, build, verify and triton commands), ``args``
(flags several commands share: ``--artifact``, ``--prompt-file``, hidden aliases of old spellings),
``heads`` (``train-heads``, ``calibrate``), ``trt`` (``engine`` and ``build --engine trt``), ``doctor``.
Exit codes: :mod:`medusa_runtime.errors` (``EXIT_*``).
"""
