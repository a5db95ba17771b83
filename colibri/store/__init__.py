"""The weight store: hands models their weights, wherever the placement put them."""

from .weights import ResidentExperts, WeightStore

__all__ = ["ResidentExperts", "WeightStore"]
