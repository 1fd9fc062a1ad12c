"""sled's own decoder forward for the Llama and Gemma 3 families, the gpt-fast way.

transformers still loads the weights, the config and the tokenizer, and keeps its forward for
`generate()`, for other architectures and for passes with SAT LoRA deltas. A step's forward is
sled's:

- a layer's q, k and v are one GEMM and its gate and up another: their weights are concatenated
  once (`_fuse`), and transformers' q/k/v/gate/up modules are left holding views of them, so no
  weight is stored twice and transformers' own forward reads the very same numbers;
- around attention a layer is two functions of tensors alone (`before_attention`: the input norm,
  QKV, Gemma 3's q/k norms, rotary; `after_attention`: o_proj, the norms and residuals, gate-up,
  the activation, down). On CUDA each goes through `torch.compile` once with the token count
  dynamic: one compile serves every layer and every bucket, inductor fuses the norms, rotary and
  activation into a few kernels, and the engine's CUDA graph per bucket captures them;
- attention is the engine's registered function, called as transformers calls it (the layer's
  attention module, q/k/v as [1, heads, tokens, head_dim], the step's keyword arguments); or,
  when the step is an `AroundAttention` (the flex and the paged engine's), the layer functions
  themselves write the new keys and values into the pool at their slots and gather the queries
  into the step's groups (`before_grouped`) and scatter the groups' outputs back
  (`after_grouped`), so that on CUDA these are fused into the compiled layer's kernels rather
  than run as copies around attention, and the step attends over the pool alone (`attend`);
- logits only at the positions the caller keeps;
- a model split over ranks (sled serve --tp N: transformers' tensor-parallel plan, its weights
  DTensors) runs on each rank's shards: the fused weights are the local shards' (transformers'
  modules keep DTensors over views of them), a layer's heads are its local ones, and the outputs
  of o_proj and down (row shards) are summed over the ranks by an all-reduce inside
  `after_attention`, compiled with it; the embedding and lm_head keep transformers' own split
  forward (its all-reduce, its all-gather of the logits).

The numbers are transformers' own, operation for operation (norms in float32 as each family
computes them, rotary as `apply_rotary_pos_emb` does): the engines' tests hold fp32 logits within
1e-5 of transformers' forward and the argmax identical.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from verify_server.engines.blocks import BlockPool, write_kv

# The model classes whose forward is replaced, by the text config's model_type
FAMILIES = ("llama", "gemma3_text")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def supports(model: torch.nn.Module) -> bool:
    """Whether sled's forward covers this model: a Llama or Gemma 3 causal LM (text), with an
    activation it knows, whole or split over ranks (sled serve --tp N) without biases on the
    row-split projections."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in FAMILIES:
        return False
    inner = getattr(model, "model", None)
    if not (hasattr(inner, "layers") and hasattr(model, "lm_head")
            and _activation_name(config) in ACTIVATIONS):
        return False
    # split: the row shards' bias would be added on every rank (none of these families has one)
    return _ranks(model) == 1 or all(layer.self_attn.o_proj.bias is None
                                     and layer.mlp.down_proj.bias is None for layer in inner.layers)


def _ranks(model: torch.nn.Module) -> int:
    """The ranks the model is split over (transformers' tp_size; 1: whole)."""
    return getattr(model, "tp_size", None) or 1


def _group_name(weight: torch.Tensor, ranks: int) -> str | None:
    """The process group a split weight's shards are summed over (its mesh's); None: whole."""
    if ranks == 1:
        return None
    return (weight.device_mesh.get_group() if isinstance(weight, DTensor)
            else dist.group.WORLD).group_name


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a split weight (a DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _activation_name(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def llama_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalised in float32, back to the input's dtype, then scaled."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm: normalised and scaled by (1 + weight) in float32, then the input's dtype."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] with cos/sin [T, 1, D] (rotate_half's convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


@dataclass(frozen=True, slots=True)
class Dims:
    """What the layer functions are specialised on (constants, the same for every layer)."""
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    gemma: bool           # Gemma 3: q/k norms, norms after attention and the MLP, (1 + w) norms
    activation: str
    group: str | None = None   # split over ranks: the process group summing the row shards


def _summed(x: torch.Tensor, dims: Dims) -> torch.Tensor:
    """A row shard's partial output summed over the ranks (as it is, on a whole model)."""
    return x if dims.group is None else funcol.all_reduce(x, "sum", dims.group)


def before_attention(hidden, norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, sin, dims: Dims):
    """hidden [T, hidden] -> q [T, H, D], k and v [T, KVH, D], rotary applied."""
    norm = gemma_norm if dims.gemma else llama_norm
    x = norm(hidden, norm_w, dims.eps)
    qkv = F.linear(x, qkv_w, qkv_b)
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    q = qkv[:, :q_size].view(-1, dims.heads, dims.head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(-1, dims.kv_heads, dims.head_dim)
    v = qkv[:, q_size + kv_size:].view(-1, dims.kv_heads, dims.head_dim)
    if dims.gemma:
        q, k = gemma_norm(q, q_norm_w, dims.eps), gemma_norm(k, k_norm_w, dims.eps)
    cos, sin = cos[:, None], sin[:, None]
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def after_attention(attn, residual, o_w, o_b, post_attn_w, pre_ff_w, post_ff_w, gate_up_w,
                    gate_up_b, down_w, down_b, dims: Dims):
    """attn [T, H * D] and the layer's input [T, hidden] -> the layer's output [T, hidden]."""
    norm = gemma_norm if dims.gemma else llama_norm
    x = _summed(F.linear(attn, o_w, o_b), dims)
    if dims.gemma:
        hidden = residual + norm(x, post_attn_w, dims.eps)
        x = norm(hidden, pre_ff_w, dims.eps)
    else:
        hidden = residual + x
        x = norm(hidden, post_attn_w, dims.eps)
    gate, up = F.linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
    x = _summed(F.linear(ACTIVATIONS[dims.activation](gate) * up, down_w, down_b), dims)
    if dims.gemma:
        x = norm(x, post_ff_w, dims.eps)
    return hidden + x


class AroundAttention:
    """A step whose attention reads the pool in place, by groups of rows (the flex and the paged
    engine's): sled's forward writes the new tokens' keys and values into `pool` at
    `write_slots`, gathers the queries of each group at its `q_index`, and scatters the groups'
    outputs back, all inside the layer functions; `attend` is the attention between."""

    pool: BlockPool
    write_slots: tuple[torch.Tensor, ...]   # per layer group of the pool [T]: the slot of each
                                            # new token's keys and values
    q_index: tuple[torch.Tensor, ...]       # per group [B, W]: each query's packed index, T: padding

    def slots_of(self, layer: int) -> torch.Tensor:
        """Where `layer` writes the new tokens' keys and values: its layer group's slots."""
        return self.write_slots[self.pool.group_of[layer]]

    def attend(self, layer: int, queries: tuple[torch.Tensor, ...], window: int | None,
               scaling: float | None, softcap: float | None = None) -> list[torch.Tensor]:
        """The groups' queries [B, H, W, D] over the pool's keys and values of `layer` (the
        step's new ones written) -> their outputs [B, H, W, D]."""
        raise NotImplementedError


def gather_queries(q: torch.Tensor, q_index: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """q [T, H, D] -> each group's queries [B, H, W, D]: the query at each packed index, zero at
    the padding index T."""
    padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])                  # [T + 1, H, D]
    return tuple(padded[index.long()].transpose(1, 2) for index in q_index)


def scatter_outputs(outputs, q_index: tuple[torch.Tensor, ...], tokens: int) -> torch.Tensor:
    """Each group's outputs [B, H, W, D] back to the packed tokens [T, H, D] (padding dropped)."""
    heads, dim = outputs[0].shape[1], outputs[0].shape[3]
    out = outputs[0].new_zeros(tokens + 1, heads, dim)
    for attn, index in zip(outputs, q_index):
        out.index_copy_(0, index.reshape(-1).long(), attn.transpose(1, 2).reshape(-1, heads, dim))
    return out[:tokens]


def before_grouped(hidden, norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, sin, keys, values,
                   write_slots, q_index, dims: Dims):
    """`before_attention`, then the new k and v written into the pool's layer (`keys`, `values`
    [slots, KVH, D]) at `write_slots` [T] -> each group's queries [B, H, W, D]."""
    q, k, v = before_attention(hidden, norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, sin, dims)
    write_kv(keys, values, write_slots.long(), k, v)
    return gather_queries(q, q_index)


def after_grouped(outputs, q_index, residual, o_w, o_b, post_attn_w, pre_ff_w, post_ff_w,
                  gate_up_w, gate_up_b, down_w, down_b, dims: Dims):
    """The groups' outputs [B, H, W, D] scattered back to the packed tokens, then
    `after_attention`."""
    attn = scatter_outputs(outputs, q_index, residual.shape[0]).flatten(1)
    return after_attention(attn, residual, o_w, o_b, post_attn_w, pre_ff_w, post_ff_w,
                           gate_up_w, gate_up_b, down_w, down_b, dims)


class Layer:
    """One decoder layer's fused weights, and the modules transformers keeps for it."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention = attn                         # what the attention function is given
        qkv, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
        self.qkv_w, self.qkv_b = _fuse(qkv), _fuse(qkv, "bias")
        self.gate_up_w, self.gate_up_b = _fuse(gate_up), _fuse(gate_up, "bias")
        self.o_w, self.o_b = _local(attn.o_proj.weight), _local(attn.o_proj.bias)
        self.down_w, self.down_b = _local(mlp.down_proj.weight), _local(mlp.down_proj.bias)
        self.norm_w = _local(layer.input_layernorm.weight)
        self.post_attn_w = _local(layer.post_attention_layernorm.weight)
        self.pre_ff_w = _weight(getattr(layer, "pre_feedforward_layernorm", None))
        self.post_ff_w = _weight(getattr(layer, "post_feedforward_layernorm", None))
        self.q_norm_w = _weight(getattr(attn, "q_norm", None))
        self.k_norm_w = _weight(getattr(attn, "k_norm", None))
        self.scaling = attn.scaling
        self.window = getattr(attn, "sliding_window", None)
        self.sliding = bool(getattr(attn, "is_sliding", False))

    def fresh(self) -> bool:
        """Whether transformers' q_proj still holds a view of the fused weight (a model moved or
        cast since replaced its parameters, or their data)."""
        return _local(self.attention.q_proj.weight).data_ptr() == self.qkv_w.data_ptr()


def _weight(module) -> torch.Tensor | None:
    return None if module is None else _local(module.weight)


@torch.no_grad()
def _fuse(linears, attr: str = "weight") -> torch.Tensor | None:
    """The linears' weights (or biases: zeros for a linear without one; None where none has one)
    stacked into one tensor along the output rows; each linear's own becomes a view of its rows."""
    parts = [getattr(m, attr) for m in linears]
    if all(p is None for p in parts):
        return None
    fused = torch.cat([_local(p).detach() if p is not None
                       else _local(m.weight).new_zeros(_local(m.weight).shape[0])
                       for m, p in zip(linears, parts)])
    start = 0
    for m, p in zip(linears, parts):
        rows = _local(m.weight).shape[0]
        if p is not None:
            setattr(m, attr, torch.nn.Parameter(_like(p, fused[start:start + rows]),
                                                requires_grad=False))
        start += rows
    return fused


def _like(weight: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in the place of `weight`: as it is, or, for a split weight, a DTensor of the
    same split over it."""
    if not isinstance(weight, DTensor):
        return local
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                              shape=weight.shape, stride=weight.stride())


class Decoder:
    """sled's forward of one Llama or Gemma 3 model: `decoder(input_ids=..., position_ids=...,
    attention_mask=..., logits_to_keep=..., **step)` -> logits [1, kept, vocab], as
    `model(...).logits` would be. `compiled`: the layer functions through torch.compile (what
    an engine on CUDA runs; a whole step compiled by the engine itself takes them eager)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.inner = model.model
        self.layers = [Layer(layer) for layer in self.inner.layers[:config.num_hidden_layers]]
        norm = self.inner.layers[0].input_layernorm
        eps = getattr(norm, "variance_epsilon", None) or norm.eps      # Llama's name, Gemma's
        ranks = _ranks(model)
        self.dims = Dims(config.num_attention_heads // ranks, config.num_key_value_heads // ranks,
                         self.layers[0].attention.head_dim, float(eps),
                         config.model_type == "gemma3_text", _activation_name(config),
                         _group_name(self.inner.layers[0].self_attn.o_proj.weight, ranks))
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.rotary = _rotary(self.inner)
        self.functions = {(False, False): (before_attention, after_attention),
                          (False, True): (before_grouped, after_grouped)}

    def _functions(self, compiled: bool, grouped: bool):
        """(before, after), around the attention function or around a grouped step's, each
        compiled once per decoder: the token count and the groups' rows and width are marked
        dynamic at each call (`_dynamic_tokens`), the rest static."""
        if (compiled, grouped) not in self.functions:
            self.functions[compiled, grouped] = tuple(
                torch.compile(f) for f in self.functions[False, grouped])
        return self.functions[compiled, grouped]

    def fresh(self) -> bool:
        return all(layer.fresh() for layer in self.layers)

    def __call__(self, input_ids=None, inputs_embeds=None, position_ids=None,
                 attention_mask=None, logits_to_keep=0, use_cache=False, compiled=False,
                 **step) -> torch.Tensor:
        hidden = (self.inner.embed_tokens(input_ids) if inputs_embeds is None
                  else inputs_embeds)[0]                                   # [T, hidden]
        positions = self.rotary(hidden, position_ids)                     # (sliding?) -> cos, sin
        grouped = grouped_step(step)
        for layer in self.layers:
            cos, sin = (t[0] for t in positions[layer.sliding])
            if compiled:
                _dynamic_tokens(hidden, cos, sin)
            if grouped is None:
                hidden = self._layer(layer, hidden, cos, sin, attention_mask, compiled, step)
            else:
                hidden = self._grouped_layer(layer, hidden, cos, sin, grouped, compiled)
        hidden = self.inner.norm(hidden)
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[-logits_to_keep:]
        logits = self.model.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits[None]


    def _layer(self, layer: Layer, hidden, cos, sin, attention_mask, compiled: bool,
               step: dict) -> torch.Tensor:
        """One layer around the engine's registered attention function."""
        before, after = self._functions(compiled, False)
        attend = ALL_ATTENTION_FUNCTIONS[self.model.config._attn_implementation]
        q, k, v = before(hidden, layer.norm_w, layer.qkv_w, layer.qkv_b, layer.q_norm_w,
                         layer.k_norm_w, cos, sin, self.dims)
        attn, _ = attend(layer.attention, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                         v.transpose(0, 1)[None], attention_mask, dropout=0.0,
                         scaling=layer.scaling, sliding_window=layer.window, **step)
        attn = attn.reshape(hidden.shape[0], -1)
        if compiled:
            _dynamic_tokens(attn)
        return after(attn, hidden, layer.o_w, layer.o_b, layer.post_attn_w, layer.pre_ff_w,
                     layer.post_ff_w, layer.gate_up_w, layer.gate_up_b, layer.down_w,
                     layer.down_b, self.dims)

    def _grouped_layer(self, layer: Layer, hidden, cos, sin, step: AroundAttention,
                       compiled: bool) -> torch.Tensor:
        """One layer of a grouped step: the KV write, the query gather and the output scatter
        inside the layer functions, the step's attention over the pool between them."""
        before, after = self._functions(compiled, True)
        index = layer.attention.layer_idx
        pool = step.pool
        write_slots = step.slots_of(index)
        if compiled:
            _dynamic_tokens(write_slots)
            _dynamic_groups(*step.q_index)
        queries = before(hidden, layer.norm_w, layer.qkv_w, layer.qkv_b, layer.q_norm_w,
                         layer.k_norm_w, cos, sin, pool.keys[index], pool.values[index],
                         write_slots, step.q_index, self.dims)
        pool.count_written(hidden.shape[0])
        outputs = step.attend(index, queries, layer.window, layer.scaling)
        if compiled:
            _dynamic_groups(*outputs)
        return after(outputs, step.q_index, hidden, layer.o_w, layer.o_b, layer.post_attn_w,
                     layer.pre_ff_w, layer.post_ff_w, layer.gate_up_w, layer.gate_up_b,
                     layer.down_w, layer.down_b, self.dims)


def grouped_step(step: dict) -> AroundAttention | None:
    """The step among the forward's keyword arguments whose layers write, gather and scatter
    around attention themselves, if there is one."""
    return next((value for value in step.values() if isinstance(value, AroundAttention)), None)


def _dynamic_tokens(*tensors: torch.Tensor) -> None:
    """One compile for every token count: dim 0 of the layer functions' inputs is dynamic."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


def _dynamic_groups(*tensors: torch.Tensor) -> None:
    """One compile for groups of any rows and width: dims 0 (rows) and -2 (width) of a group's
    query index [B, W] or outputs [B, H, W, D] are dynamic."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 2 if tensor.dim() > 2 else 1)


def _rotary(inner: torch.nn.Module):
    """hidden, position_ids -> {sliding: (cos, sin)} from the model's own rotary modules
    (transformers' versions name Gemma 3's local one differently)."""
    rotary = inner.rotary_emb
    local = getattr(inner, "rotary_emb_local", None)
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters

    def positions(hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
        x = hidden[None]
        if takes_type:
            types = set(inner.config.layer_types)
            return {kind == "sliding_attention": rotary(x, position_ids, kind) for kind in types}
        full = rotary(x, position_ids)
        return {False: full, True: local(x, position_ids) if local is not None else full}
    return positions


_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, Decoder]" = weakref.WeakKeyDictionary()


def decoder_for(model: torch.nn.Module) -> Decoder:
    """The model's Decoder, fused once and again only when the model's weights were replaced
    (moved or cast); engines sharing a model share it."""
    decoder = _DECODERS.get(model)
    if decoder is None or not decoder.fresh():
        decoder = _DECODERS[model] = Decoder(model)
    return decoder
