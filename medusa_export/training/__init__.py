"""Medusa heads: training by self-distillation, calibration, draft vocabularies.

Modules: ``distill`` (prompts, self-distillation replies, head training; Medusa paper §2.2.1,
§2.3.2), ``calibrate`` (per-head top-i accuracies, simulated acceptance; §2.3.3),
``draft_vocab`` (the tokens the heads may propose, by frequency).
"""
