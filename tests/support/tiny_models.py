"""Tiny random-weight models built from mlx-lm's own model classes, for fast tests and benchmarks.

Every builder returns ``(model, args)``: an mlx-lm ``Model`` with seeded random float32 weights (cast with
``dtype=``) and the ``ModelArgs`` it was built from. All share ``VOCAB`` so any two can serve as a model and
its speculative-decoding draft, and ``tiny_tokenizer()`` gives a matching byte-level tokenizer for
``mlx_lm.generate``.

| builder | mlx-lm class | layers (attention) | q / kv heads | head_dim |
|---|---|---|---|---|
| tiny_llama | llama (q/k/v bias, GQA) | 3 (3) | 4 / 2 | 64 |
| tiny_qwen3 | qwen3 (q/k RMSNorm) | 2 (2) | 4 / 2 | 128 |
| tiny_hybrid | qwen3_5_moe (GatedDeltaNet + attention, MoE, partial RoPE, output gate) | 4 (1) | 2 / 1 | 256 |
| tiny_llama_hd80 | llama | 2 (2) | 4 / 2 | 80 |
| tiny_llama_hd96 | llama | 2 (2) | 4 / 2 | 96 |
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

VOCAB = 257  # 256 byte tokens + <eos>
EOS = 256


def _randomize(model: nn.Module, seed: int, dtype: mx.Dtype) -> nn.Module:
    # Every weight comes from numpy's PCG64 seeded per parameter, so models are the same on every platform and
    # whatever MLX's global random state (A_log's own init draws from it: a model that changed with the tests run
    # before it made results order-dependent). Norm weights keep their initial ones; A_log is log U(1, 16) as
    # in the models' own init; embeddings have std 1 (a residual stream of unit scale, as in trained models),
    # other matrices std 1/sqrt(fan_in), biases std 0.5 so that keys get a per-channel mean (what key
    # centering removes).
    params = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        rng = np.random.default_rng([seed, i])
        parts = name.split(".")
        if any("norm" in part for part in parts[-2:]) or p.ndim == 0:  # the norm module's own weights only
            params.append((name, p))
            continue
        if name.endswith("A_log"):
            params.append((name, mx.array(np.log(rng.uniform(1, 16, p.shape)).astype(np.float32))))
            continue
        if name.endswith("bias"):
            std = 0.5
        elif "embed_tokens" in name:
            std = 1.0
        else:
            std = 1.0 / p.shape[-1] ** 0.5 if p.ndim >= 2 else 0.1
        params.append((name, mx.array((std * rng.standard_normal(p.shape)).astype(np.float32))))
    model.update(tree_unflatten(params))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _llama(head_dim: int, layers: int, seed: int, dtype: mx.Dtype, bias: bool = True):
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=layers,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        attention_bias=bias,
        tie_word_embeddings=True,
    )
    return _randomize(llama.Model(args), seed, dtype), args


def tiny_llama(seed: int = 0, dtype: mx.Dtype = mx.float32, layers: int = 3):
    """llama, head_dim 64, GQA 4/2, q/k/v biases."""
    return _llama(64, layers, seed, dtype)


def prefilled(model, tokens: list[int], config=None, cache=None, chunk: int = 64) -> list:
    """`cache` (else a new TurboQuant prompt cache of `config`) after `model` read `tokens`, `chunk` at a time."""
    from tq_mlx import make_prompt_cache

    cache = make_prompt_cache(model, config) if cache is None else cache
    for i in range(0, len(tokens), chunk):
        model(mx.array(tokens[i:i + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    """n token ids drawn from the tiny models' vocabulary."""
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def tiny_llama_hd80(seed: int = 0, dtype: mx.Dtype = mx.float32):
    """llama, head_dim 80 (Hadamard base 20: orthonormal but not self-inverse)."""
    return _llama(80, 2, seed, dtype)


def tiny_llama_hd96(seed: int = 0, dtype: mx.Dtype = mx.float32):
    """llama, head_dim 96 (Hadamard base 12)."""
    return _llama(96, 2, seed, dtype)


def tiny_qwen3(seed: int = 0, dtype: mx.Dtype = mx.float32):
    """qwen3, head_dim 128, GQA 4/2, per-head q/k RMSNorm."""
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    return _randomize(qwen3.Model(args), seed, dtype), args


def tiny_hybrid(seed: int = 0, dtype: mx.Dtype = mx.float32):
    """qwen3_5_moe: layers 0-2 GatedDeltaNet (ArraysCache), layer 3 full attention with head_dim 256,
    2 q / 1 kv heads, partial RoPE and an output gate, like Qwen3.5-35B-A3B in miniature."""
    from mlx_lm.models import qwen3_5_moe

    text = dict(
        model_type="qwen3_5_moe_text",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=128,
        moe_intermediate_size=128,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=32768,
        full_attention_interval=4,
        tie_word_embeddings=False,
        rope_parameters={"type": "default", "rope_theta": 1e5, "partial_rotary_factor": 0.25},
    )
    args = qwen3_5_moe.ModelArgs(model_type="qwen3_5_moe", text_config=text)
    return _randomize(qwen3_5_moe.Model(args), seed, dtype), args


TINY_MODELS: dict[str, Callable] = {
    "llama": tiny_llama,
    "qwen3": tiny_qwen3,
    "hybrid": tiny_hybrid,
    "llama_hd80": tiny_llama_hd80,
    "llama_hd96": tiny_llama_hd96,
}


@lru_cache(maxsize=None)
def tiny_tokenizer():
    """A byte-level tokenizer over ``VOCAB`` (ids 0-255 = bytes, 256 = <eos>), wrapped for mlx_lm.generate."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: _BYTE_OF[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    hf.add_special_tokens({"eos_token": "<eos>"})
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return TokenizerWrapper(hf)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable-character table, which tokenizers' ByteLevel uses.
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF = {ch: b for b, ch in _bytes_to_unicode().items()}
