"""Strata: an inference daemon for large language models with conversation checkpoints."""
__version__ = "0.1.0"
