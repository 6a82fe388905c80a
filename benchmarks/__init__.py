"""tfmp's benchmark suite: float32, plain Keras mixed precision and tfmp, side by side.

Run it with ``python benchmarks/run.py`` (see ``benchmarks/README.md``).
"""
