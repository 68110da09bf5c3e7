"""The experiment harness, on top of the core and the transformers integration: generation helpers
(:mod:`~vase.harness.generation`), accuracy sweeps (:mod:`~vase.harness.evaluate`), fidelity to the full cache
(:mod:`~vase.harness.fidelity`), benchmarks (measurements :mod:`~vase.harness.measure`, the sweep's subprocesses
:mod:`~vase.harness.bench`, tables :mod:`~vase.harness.bench_markdown`), reports (:mod:`~vase.harness.report`,
:mod:`~vase.harness.ranking`, :mod:`~vase.harness.plots`), grading, loop detection, data, planted value outliers and
magnitude inspection."""
