"""How each mlx-lm architecture reads its KV cache, by model_type: which fetch a TurboQuantKVCache gives it.

Every model with a growing KV cache gets compressed storage; what differs is what `update_and_fetch` hands back:

* "codes" (the default): `StreamView`s, which the attention hook (tq_mlx.cache) runs on the codes. Learned sinks
  (gpt-oss) and layers that attend to another layer's fetched view (Gemma 4's KV-shared layers) take this path.
* "latent": multi-head latent attention (DeepSeek-V3 style: the cache holds `kv_latent` and the rope key `k_pe`).
  Decode (one query token) gets the latent as a view, which the model passes as both keys and values with its
  rope scores as an additive mask: attention on the codes. Prefill chunks and the rope key get float tensors
  decoded from the codes, one layer at a time.
* "float" (decode-to-float): models that post-process what they fetch (cast, tile, index, compute attention by
  hand, or call mx.fast.scaled_dot_product_attention directly) get float tensors decoded from the codes on every
  fetch: a transient the size of one layer's float cache, never kept.

Model files are mlx-lm 0.32.2's; tests/test_zoo.py checks every architecture end to end.
"""

from __future__ import annotations

# model_type -> why its fetched keys/values must be float tensors (decode-to-float).
FLOAT_FETCH: dict[str, str] = {
    "gemma2": "computes attention by hand on the fetched keys, with a tanh soft-cap of the scores (gemma2.py:89-92)",
    "olmo": "computes attention by hand on the fetched keys (olmo.py:91)",
    "stablelm": "casts the fetched keys (stablelm.py:119-120)",
    "plamo": "tiles the fetched keys (plamo.py:93)",
    "plamo2": "calls mx.fast.scaled_dot_product_attention directly",
    "phi": "casts the fetched values to its own dtype (phi.py:102)",
    "phixtral": "casts the fetched values to its own dtype (phixtral.py:80)",
    "phi3small": "expands and tiles the fetched keys for block-sparse attention",
    "afm7": "its KV-reuse layers attend to the last layer's fetched keys outside the attention hook (afm7.py:361)",
    "iquestloopcoder": "its second loop attends to the first loop's fetched keys (iquestloopcoder.py:196)",
    "deepseek_v32": "its sparse attention indexes the fetched latent (deepseek_v32.py:214-230)",
    "glm_moe_dsa": "its sparse attention indexes the fetched latent (deepseek_v32.py:214-230)",
    "deepseek_v41": "calls mx.fast.scaled_dot_product_attention directly",
    "muse_spark": "calls mx.fast.scaled_dot_product_attention directly",
    "minimax_m3_vl": "post-processes the fetched keys (minimax_m3_vl.py:268-282)",
}

# model_type of multi-head latent attention whose cache holds (kv_latent, k_pe) and whose decode attends to the
# latent directly (deepseek_v3.py:143-165 and the files built on it; "kimi_k2" configs load as deepseek_v3). deepseek_v2, minicpm3 and youtu_llm cache
# per-head keys and values instead: plain "codes".
LATENT: frozenset[str] = frozenset({
    "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl", "kimi_linear", "kimi_k3", "glm4_moe_lite", "mistral4",
    "longcat_flash", "longcat_flash_ngram", "bailing_moe_v3", "bailing_hybrid",
})

FETCHES = ("codes", "latent", "float")


def fetch_for(model_types: set[str] | frozenset[str]) -> str:
    """The fetch of a model with these model_type names (a VLM has its own and its text model's)."""
    if any(t in FLOAT_FETCH for t in model_types):
        return "float"
    if any(t in LATENT for t in model_types):
        return "latent"
    return "codes"
