"""Logging setup shared by every m3stack process."""

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | None = None) -> None:
    """Configure the root logger once; ``M3STACK_LOG_LEVEL`` overrides the default INFO."""
    chosen = (level or os.environ.get("M3STACK_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=chosen, format=LOG_FORMAT)
