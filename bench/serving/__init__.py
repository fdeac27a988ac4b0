"""Agentic serving benchmark, ``python -m bench.serving``: what it measures and its flags are in
``bench.serving.cli``'s docstring."""
