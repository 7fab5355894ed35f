"""Benchmarks: our Engine against mlx-lm's BatchGenerator on the same model, plus BLAS detection.

Not part of the installed distribution and not collected by the main test suite (`pytest` runs `tests/`).
Entry point: `python -m bench.run --help` (or `bench.run.main(argv)`).
"""
