"""omnistage: a fast, PyTorch-native serving engine for Qwen3-Omni."""

__version__ = "0.1.0"
