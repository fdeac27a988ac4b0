"""The M3 model for serving: config, layers, vision tower, checkpoint loading, tiny default."""
