"""Helpers shared by several test folders (import as ``tests.helpers.<module>``)."""
