"""One compressed stream per side (keys or values): its calibration on the first window (or the calibration tokens),
its state (codec), the views attention reads and their reference encode and decode, the values' widths by their
error, and the stream."""

from .compressed import CompressedStream
from .view import StreamView

__all__ = ["CompressedStream", "StreamView"]
