"""capture: offline hidden-state capture for training speculative-decoding drafters."""

__version__ = "0.1.0"
