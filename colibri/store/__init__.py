"""The weight store: hands models their weights, wherever the placement put them."""

from .cache import CachedExperts, ExpertCache
from .placement import Placement, from_flags, parse_size
from .reader import RecordReader
from .sizes import ModelSizes, default_placement, model_sizes
from .tiered import TieredStore
from .weights import ResidentExperts, WeightStore

__all__ = ["CachedExperts", "ExpertCache", "ModelSizes", "Placement", "RecordReader", "ResidentExperts",
           "TieredStore", "WeightStore", "default_placement", "from_flags", "model_sizes", "parse_size"]
