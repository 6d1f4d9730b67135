"""tq-mlx: TurboQuant KV-cache compression for MLX and mlx-lm.

Importing the package, or constructing a cache, changes nothing in mlx-lm: the attention hook (tq_mlx.hook) is
installed by make_prompt_cache, patch_model and load_prompt_cache, and by a hand-built cache's first
update_and_fetch.
"""

from .attention.reference import turboquant_attention
from .batch import BatchTurboQuantKVCache
from .cache import TurboQuantKVCache
from .quant.codebook import lloyd_max
from .config import TurboQuantConfig
from .integration import load_prompt_cache, make_prompt_cache, patch_model, unpatch_model, validate_prompt_cache
from .planner.memory import cache_bytes, estimate_kv_bytes
from .quant.quantizer import MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd
from .quant.rotation import Rotation
from .stream.compressed import CompressedStream
from .stream.view import StreamView

__version__ = "0.1.0"

__all__ = [
    "TurboQuantMSE",
    "TurboQuantProd",
    "MSECodes",
    "ProdCodes",
    "Rotation",
    "lloyd_max",
    "TurboQuantConfig",
    "TurboQuantKVCache",
    "BatchTurboQuantKVCache",
    "CompressedStream",
    "StreamView",
    "turboquant_attention",
    "make_prompt_cache",
    "patch_model",
    "unpatch_model",
    "load_prompt_cache",
    "validate_prompt_cache",
    "cache_bytes",
    "estimate_kv_bytes",
]
