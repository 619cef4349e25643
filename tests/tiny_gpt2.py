"""A tiny GPT-2 configuration for tests that need transformers' GPT-2 (Conv1D layers)."""

from typing import Any


def tiny_gpt2_config(transformers: Any, **overrides: Any) -> Any:
    """`GPT2Config` with 32-wide embeddings, 2 layers of 4 heads, 64 tokens and 16 positions."""
    sizes = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 16}
    return transformers.GPT2Config(**{**sizes, "bos_token_id": 0, "eos_token_id": 0, **overrides})
