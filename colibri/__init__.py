"""colibri: run Mixture-of-Experts language models larger than your RAM."""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Open a .coli container and return a ready `Engine` (see `colibri.api.load`)."""
    from .api import load as _load

    return _load(path, **kwargs)


__all__ = ["__version__", "load"]
