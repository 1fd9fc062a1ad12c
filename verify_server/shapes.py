"""Model shapes by name: the decoder configs of real targets, and what they weigh.

`sled bench engine --shape NAME` builds a model of the shape with random weights; a step-cost
profile measured on a shape knows from it the target's weight bytes and KV bytes per token
(verify_server.step_costs: what a GPU's memory holds). Nothing here loads torch.
"""
from __future__ import annotations

# name -> (transformers model_type, config fields): Llama 3.1 8B's and 70B's and Gemma 3 4B's
# text configs, and two tiny shapes for dry runs
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=8192, rope_theta=500000.0)),
    "llama-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=8192, rope_theta=500000.0)),
    "gemma3-4b": ("gemma3_text", dict(hidden_size=2560, intermediate_size=10240,
                                      num_hidden_layers=34, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=256, vocab_size=262208,
                                      sliding_window=1024, query_pre_attn_scalar=256,
                                      max_position_embeddings=32768)),
    "tiny-llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                                 max_position_embeddings=4096)),
    "tiny-gemma3": ("gemma3_text", dict(hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=64, vocab_size=1024,
                                        sliding_window=24, query_pre_attn_scalar=64,
                                        layer_types=["sliding_attention", "sliding_attention",
                                                     "full_attention"],
                                        max_position_embeddings=4096)),
}
# shapes only described, never built: too big for one GPU in bf16 (DERIVED profiles and the GPU
# memory they need know them; `sled bench engine --shape` builds the others)
DESCRIBED_ONLY = {"llama-70b"}
# model types whose output embedding is the input one (one table, counted once)
TIED = {"gemma3_text"}
# per layer, beside the linears: RMSNorm weights of hidden_size (gemma3: four, and q/k norms of
# head_dim), llama: two
NORMS = {"llama": (2, 0), "gemma3_text": (4, 2)}


SLIDING_PER_GLOBAL = 5      # Gemma 3: five sliding-window layers, then one global layer


def layer_types(layers: int) -> list[str]:
    """Gemma 3's pattern: layer_types(6) == 5 x "sliding_attention" + ["full_attention"]."""
    period = SLIDING_PER_GLOBAL + 1
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def windows(name: str) -> tuple[int | None, ...]:
    """Each layer's sliding window in the shape (None: full attention); () for a shape without
    windows. What a windowed KV pool keeps of each layer (verify_server.engines.blocks)."""
    _, f = SHAPES[name]
    window = f.get("sliding_window")
    if not window:
        return ()
    types = f.get("layer_types") or layer_types(f["num_hidden_layers"])
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def shape_of(model: str) -> str | None:
    """The shape a profile's model names ("llama-8b (the shape of ...)" -> "llama-8b"), if any."""
    name = model.split(" ", 1)[0] if model else ""
    return name if name in SHAPES else None


def parameters(name: str) -> int:
    """The shape's parameter count: embeddings, each layer's attention, MLP and norms, the final
    norm (tests hold it to transformers' own count)."""
    kind, f = SHAPES[name]
    hidden, layers, vocab = f["hidden_size"], f["num_hidden_layers"], f["vocab_size"]
    head_dim = f.get("head_dim") or hidden // f["num_attention_heads"]
    q = f["num_attention_heads"] * head_dim
    kv = f["num_key_value_heads"] * head_dim
    hidden_norms, head_norms = NORMS[kind]
    layer = (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * f["intermediate_size"]
             + hidden_norms * hidden + head_norms * head_dim)
    embeddings = vocab * hidden * (1 if kind in TIED else 2)
    return embeddings + layers * layer + hidden


def kv_bytes_per_token(name: str, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer, as sled's block pool keeps them."""
    _, f = SHAPES[name]
    head_dim = f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"]
    return 2 * f["num_hidden_layers"] * f["num_key_value_heads"] * head_dim * dtype_bytes


def streamed_parameters(name: str) -> int:
    """Parameters a step reads in full: all but the input embedding table, of which a step
    reads only its tokens' rows (a tied table is read whole as the output head)."""
    kind, f = SHAPES[name]
    embedding = 0 if kind in TIED else f["vocab_size"] * f["hidden_size"]
    return parameters(name) - embedding
