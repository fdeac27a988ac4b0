"""Which engine serves a request: least in-flight, or prefix-aware over an approximate radix tree."""
