"""tq-mlx: TurboQuant KV-cache compression for MLX and mlx-lm."""

from .codebook import lloyd_max
from .quantizer import MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd
from .rotation import Rotation

__version__ = "0.1.0"

__all__ = ["TurboQuantMSE", "TurboQuantProd", "MSECodes", "ProdCodes", "Rotation", "lloyd_max"]
