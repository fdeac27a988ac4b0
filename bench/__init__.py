"""Benchmarks: each module is ``python -m bench.<name>`` and writes ``bench/results/<name>.json``."""
