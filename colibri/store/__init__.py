"""The weight store: hands models their weights, wherever the placement put them."""

from .cache import ExpertCache
from .experts import Experts
from .placement import Placement, from_flags, parse_size
from .reader import RecordReader
from .sizes import ModelSizes, model_sizes
from .tiered import TieredStore
from .weights import WeightStore

__all__ = ["ExpertCache", "Experts", "ModelSizes", "Placement", "RecordReader", "TieredStore", "WeightStore",
           "from_flags", "model_sizes", "parse_size"]
