"""Attention on the codes: the pure-MLX reference (the specification) and the Metal kernels for TurboQuant's hot
paths, each `.metal` beside its launcher and each launcher beside its reference twin (docs/kernels.md).

    reference  turboquant_attention: softmax(scale·q·Kᵀ + mask)·V read from views on the codes
    launch     the Metal sources, the compiled-kernel cache, and the code, threadgroup and mask layouts
    support    why a kernel cannot take an input (the `*_unsupported` checks)
    codes      rotate, encode, recode, dequantize and the trellis search (viterbi), and their references
    attend     decode_attention and prefill_attention, and their references
    selfcheck  each kernel variant checked against its reference on first use
    dispatch   the backend (set_backend, TQ_MLX_KERNELS) and the dispatch_* functions that pick kernel or reference

Module state lives in one module each (SOURCES in launch, the self-check results in selfcheck, the backend and
kernel factory in dispatch); this package only re-exports.
"""

from .reference import turboquant_attention
from .attend import decode_attention, decode_attention_reference, prefill_attention, prefill_attention_reference
from .codes import (dequantize, dequantize_reference, encode, encode_reference, recode, recode_reference, rotate,
                    rotate_reference, viterbi, viterbi_reference)
from .dispatch import (BACKENDS, ENV_VAR, AttentionVariant, dispatch_attention, dispatch_dequantize, dispatch_encode,
                       dispatch_recode, dispatch_rotate, float_tokens, get_backend, kernels_enabled, metal_available,
                       set_backend, set_kernel_factory)
from .launch import (KERNEL_BITS, KERNEL_NAMES, MAX_DIM, MAX_QUERY_TOKENS, MIN_DIM, SOURCES, SPARSE_V_EPSILON,
                     SUPPORTED_DIMS, THREADGROUP_MEMORY)
from .launch import _span_codes  # noqa: F401  (tests and benchmarks read these private helpers here)
from .selfcheck import SELF_CHECK_POSITION, reset_self_checks, self_check_status
from .selfcheck import _codes_mismatch, _mismatch, _random_views  # noqa: F401
from .support import (decode_unsupported, dequantize_unsupported, encode_unsupported, prefill_unsupported,
                      recode_unsupported, rotation_unsupported)

__all__ = [
    "AttentionVariant", "BACKENDS", "ENV_VAR", "KERNEL_BITS", "KERNEL_NAMES", "MAX_DIM", "MAX_QUERY_TOKENS", "MIN_DIM",
    "SELF_CHECK_POSITION", "SOURCES", "SPARSE_V_EPSILON", "SUPPORTED_DIMS", "THREADGROUP_MEMORY",
    "decode_attention", "decode_attention_reference", "decode_unsupported", "dequantize", "dequantize_reference",
    "dequantize_unsupported", "dispatch_attention", "dispatch_dequantize", "dispatch_encode", "dispatch_recode", "dispatch_rotate",
    "encode", "encode_reference", "encode_unsupported", "float_tokens", "get_backend", "kernels_enabled", "metal_available",
    "prefill_attention", "prefill_attention_reference", "prefill_unsupported", "recode", "recode_reference",
    "recode_unsupported", "reset_self_checks", "rotate",
    "rotate_reference", "rotation_unsupported", "self_check_status", "set_backend", "set_kernel_factory",
    "turboquant_attention", "viterbi", "viterbi_reference",
]
