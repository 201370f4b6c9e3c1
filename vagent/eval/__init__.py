"""Evaluation: benchmark loaders (published formats, read from local files), metrics, and one runner.

Each benchmark module does load -> prompt -> score: ``load(path, image_root)`` turns the published file
into canonical rows (the prompt is the rollout engine's for that row) plus a list of the records it
could not read, each named by id and field; ``score(row, trajectory)`` gives the per-sample metric
values. ``BENCHMARKS`` is the one explicit registry.
"""

from vagent.eval.benchmarks import BENCHMARKS, Benchmark, BenchmarkError

__all__ = ["BENCHMARKS", "Benchmark", "BenchmarkError"]
