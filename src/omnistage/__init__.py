"""omnistage: a fast, PyTorch-native serving engine for Qwen3-Omni."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Omni":
        from omnistage.entrypoints.omni import Omni

        return Omni
    raise AttributeError(name)
