"""Convert a GGUF checkpoint into a Hugging Face-style folder that ``mlx_lm.load`` reads.

mlx-lm 0.32 cannot load GGUF, and ``mx.load`` does not know K-quants, so the weights are
dequantized with the pure-Python ``gguf`` package and the byte-level BPE tokenizer is rebuilt
with ``tokenizers``.  No torch, no transformers model code.

Supported: ``llama`` (e.g. SmolLM2; undoes llama.cpp's rotary row permutation) and ``qwen2``
(q/k/v biases, stored unpermuted).  See shared/docs/real-models.md §2.  Needs the `demo` extra
(``pip install "tq-mlx[demo]"``): gguf and tokenizers are imported in the functions that use them, and
tq_mlx.models.demo imports this module only when it converts, so ``import tq_mlx`` works without them.

Output folder: config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:  # gguf is imported where it is used, so demo.py can read CONVERTER_VERSION without it
    from gguf import GGUFReader

# Bump when the output changes, so cached conversions are redone (see demo.py).
CONVERTER_VERSION = 1

SUPPORTED_ARCHS = ("llama", "qwen2")

_DTYPES: dict[str, mx.Dtype] = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}

# GGUF tensor name (without .weight/.bias) -> HF name; "{n}" is the block index.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Pre-tokenizer split regexes, keyed by ``tokenizer.ggml.pre`` (as in llama.cpp's llama-vocab.cpp).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token_type values (llama.cpp LLAMA_TOKEN_TYPE_*).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{suffix}"
    raise ValueError(f"unknown GGUF tensor name {gguf_name!r}")


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute()``: per head, rows go from interleaved RoPE pairs
    (head_dim/2, 2) back to HF's half-split layout (2, head_dim/2)."""
    head_dim = w.shape[0] // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _config(reader: GGUFReader, arch: str, tied: bool) -> dict[str, Any]:
    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    n_heads = int(a("attention.head_count"))
    vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(a("attention.head_count_kv", n_heads)),
        "head_dim": int(a("attention.key_length", hidden // n_heads)),
        # GGUF stores float32; round so 1e-5 doesn't become 9.999999747378752e-06.
        "rms_norm_eps": float(f'{a("attention.layer_norm_rms_epsilon"):.7g}'),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length")),
        "vocab_size": int(a("vocab_size", vocab)),
        "tie_word_embeddings": tied,
        "rope_scaling": None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def _convert_weights(
    reader: GGUFReader, arch: str, cfg: dict[str, Any], dtype: mx.Dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, mx.array]:
    from gguf.quants import dequantize

    weights: dict[str, mx.array] = {}
    for i, t in enumerate(reader.tensors):
        # dequantize() handles F32/F16/Q*/K-quants; GGUF shapes are listed innermost-first.
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
        name = _hf_name(t.name)
        if arch == "llama":
            if ".self_attn.q_proj." in name:
                w = _unpermute_rotary(w, cfg["num_attention_heads"])
            elif ".self_attn.k_proj." in name:
                w = _unpermute_rotary(w, cfg["num_key_value_heads"])
        weights[name] = mx.array(w).astype(dtype)
        mx.eval(weights[name])  # materialize now so the float32 copy can be freed
        if progress:
            progress(i + 1, len(reader.tensors))
    return weights


def _tokenizer_json(reader: GGUFReader) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt
    from tokenizers import processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE (tokenizer.ggml.model == 'gpt2') is supported, got {kind!r}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        tok.pre_tokenizer = pt.Sequence(
            [pt.Digits(individual_digits=True), pt.Split(Regex(_GPT2_REGEX), "isolated"), byte_level]
        )
    elif pre in ("default", "gpt-2"):
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(_GPT2_REGEX), "isolated"), byte_level])
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(_QWEN2_REGEX), "isolated"), byte_level])
    else:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}")
    tok.decoder = decoders.ByteLevel()

    # Token strings of added tokens are their literal text; they already sit in the vocab,
    # so adding them keeps their ids and only makes them match before BPE.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    )

    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str(pretty=False)


def _tokenizer_config(reader: GGUFReader) -> dict[str, Any]:
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")

    def tok(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    cfg: dict[str, Any] = {
        # Generic fast tokenizer: keeps transformers from rebuilding a model-specific one.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos"),
        "eos_token": tok("eos"),
        "unk_token": tok("unknown"),
        "pad_token": tok("padding"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length")),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "float16",
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write an mlx-lm loadable HF folder for ``gguf_path`` into ``out_dir`` and return it.

    ``dtype`` is the on-disk weight dtype ("float16", "bfloat16" or "float32"); on CPU, cast to
    float32 after loading (fp16 matmuls don't use BLAS there). ``progress(done, total)`` is called
    after each tensor.
    """
    from gguf import GGUFReader

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    cfg = _config(reader, arch, tied)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = _convert_weights(reader, arch, cfg, _DTYPES[dtype], progress)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "tokenizer.json").write_text(_tokenizer_json(reader), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(reader), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return out


if __name__ == "__main__":  # python -m tq_mlx.models.gguf_convert IN.gguf OUT_DIR [dtype]
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m tq_mlx.models.gguf_convert IN.gguf OUT_DIR [float16|bfloat16|float32]")
    print(convert_gguf(sys.argv[1], sys.argv[2], *(sys.argv[3:])))
