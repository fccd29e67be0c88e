"""Model math: the Llama family as pure functions, RoPE, loaders, tokenizer glue."""

from jkv.models.llama import forward, lm_head
from jkv.models.loaders import load_gguf, load_hf_dir, load_model, random_params
from jkv.models.params_cache import load_params

__all__ = ["forward", "lm_head", "load_gguf", "load_hf_dir", "load_model", "load_params",
           "random_params"]
