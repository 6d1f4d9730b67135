"""What tq_mlx knows of a model: its config read and the fetch each mlx-lm model_type takes (architectures), a
layer's RoPE (rope), and the demo model fetched from PyPI and converted from its GGUF (demo, gguf_convert)."""
