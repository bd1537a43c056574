"""gradsum: fast data-parallel PyTorch training when the network is the bottleneck."""

__version__ = "0.1.0"
