"""hetero: distributed multimodal training where every module carries its own parallel layout."""

__version__ = "0.1.0"
