"""The blocked backend: FlashAttention's tiled algorithm in plain PyTorch ops (any device).

``BACKEND.force_tile_sizes(block_m=..., block_n=...)`` (also exported as
`force_tile_sizes`) overrides the tile sizes inside a ``with`` block;
`default_tile_sizes(problem)` shows the defaults.
"""
from .backend import BACKEND, BlockedBackend
from .tiles import TileSizes, default_tile_sizes

force_tile_sizes = BACKEND.force_tile_sizes

__all__ = ["BACKEND", "BlockedBackend", "TileSizes", "default_tile_sizes", "force_tile_sizes"]
