"""The experiment harness, on top of the core and the transformers integration: generation helpers
(:mod:`~vase.harness.generation`), accuracy sweeps (:mod:`~vase.harness.evaluate`), fidelity to the full cache
(:mod:`~vase.harness.fidelity`), benchmarks (:mod:`~vase.harness.bench`), reports, grading, loop detection, data,
planted value outliers and magnitude inspection."""
