"""A tiny Llama (built with transformers) whose adjacent layers truly share a KV subspace: the
model shared-layer KV is tested on where SmolLM2's layers share too little.

Layers come in groups of `group`. The hidden space has one `rank`-dimensional subspace per group
(orthonormal, disjoint); every layer of a group reads its keys and values from its group's
subspace only (k_proj, v_proj = U_g M_l), and no layer writes into any of those subspaces
(o_proj and down_proj project them out), so each token's coordinates there are the embedding's
in every layer: a group's pre-RoPE keys and values are one [T, rank] matrix of coefficients
times a basis per layer. The RMS norm still scales a token differently in each layer; the
embedding's component in the subspaces is made large (`boost`) so that scale varies by a few
percent only, and the LM head reads only the rest of the hidden space, where the layers write,
so the KV decides the next token. The tokenizer is the embedded model's (SmolLM2's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def build(path: Path, layers: int = 6, group: int = 3, rank: int = 4, hidden: int = 64,
          heads: int = 4, kv_heads: int = 2, boost: float = 3.0, seed: int = 0) -> Path:
    """Write the model (safetensors, config, tokenizer) to `path`; returns it."""
    import torch
    import transformers

    from jkv.models.loaders import default_model_path

    src = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    rng = np.random.default_rng(seed)
    groups = -(-layers // group)
    q, _ = np.linalg.qr(rng.standard_normal((hidden, hidden)))
    shared = q[:, :groups * rank]  # every group's subspace, side by side
    rest = np.eye(hidden) - shared @ shared.T  # projects them out

    def t(x):
        return torch.tensor(np.asarray(x, np.float32))

    def dense(out_dim, in_dim):
        return rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)

    kv = kv_heads * (hidden // heads)
    with torch.no_grad():
        e = rng.standard_normal((len(tok), hidden))
        model.model.embed_tokens.weight.copy_(t(e @ rest + boost * (e @ shared @ shared.T)))
        for i, layer in enumerate(model.model.layers):
            u = shared[:, (i // group) * rank:(i // group + 1) * rank]  # [hidden, rank]
            a = layer.self_attn
            a.q_proj.weight.copy_(t(dense(hidden, hidden)))
            a.k_proj.weight.copy_(t((u @ dense(kv, rank).T).T))
            a.v_proj.weight.copy_(t((u @ dense(kv, rank).T).T))
            a.o_proj.weight.copy_(t(rest @ dense(hidden, hidden)))
            m = layer.mlp
            m.gate_proj.weight.copy_(t(dense(2 * hidden, hidden)))
            m.up_proj.weight.copy_(t(dense(2 * hidden, hidden)))
            m.down_proj.weight.copy_(t(rest @ dense(hidden, 2 * hidden)))
        model.lm_head.weight.copy_(t(dense(len(tok), hidden) @ rest))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)
