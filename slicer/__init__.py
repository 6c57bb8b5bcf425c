"""slicerd: per-node GPU time-slicing daemon (exclusive, connection-bound GPU turns)."""

__version__ = "0.1.0"
