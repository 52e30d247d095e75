"""Answers without a model: the classic calculator, layer specifications, transformer
formulas. Each returns the same ``Estimate`` value the tracer returns."""
