"""Find attention sites in Dynamo's torch-level FX graphs and rewrite them to kv4 ops.

A site is an attention computation whose K and V lead back, through the view chain of
``repeat_kv`` at most, to a cache write. Accepted node shapes (forms in ``ATTENTION_FORMS``):

* ``sdpa``: SDPA with ``dropout_p == 0`` and any ``attn_mask``, ``is_causal``, ``scale``;
* ``eager``: ``scores -> softmax -> [to / type_as / view] -> [dropout(p=0)] -> matmul(., v)``;
* ``bmm``: the same over heads folded into the batch, ``probs [B * H, T, S]`` ->
  ``bmm(., v.reshape(B * H, S, D))`` (XGLM, TrOCR, MVP, BLOOM); the fused op's
  ``[B, H, T, D]`` output is flattened back;
* ``flex``: ``flex_attention`` (transformers' ``attn_implementation="flex_attention"``), found and
  never matched: its traced ``score_mod`` and block mask have no kv4 form, so its cache stays fp16;
* attention sinks (GPT-OSS, MiMo): ``cat([scores, sink], -1) [- its row max] -> softmax ->
  probs[..., :-1]`` with ``sink [B, H, T, 1]`` and a mask present; the sink becomes one more
  new token whose key and value are zero and whose mask column is the sink logit (``kv4_decode``
  takes the sink and builds that token itself, as it stores the new tokens alone). A row-max
  shift alone is dropped too (it changes no softmax);
* an attention sink as a scale of the output (Granite-SWA): ``out * sigmoid(logsumexp(scores, -1)
  - sink)[..., None]``, casts between allowed, ``sink`` broadcasting to ``[B, H, T]``: the same
  softmax with one more logit, which enters as the sink above (``sink[..., None]`` to ``[B, H, T, 1]``);
* scores, read back from the softmax input (past any sink) in this order (each step optional):
  masking (``+ term`` any number of times, ``torch.where(keep, s, -big)``,
  ``s.masked_fill(drop, -big)``, ``torch.max(s, -big)``), then ``cap * tanh(s / cap)``, then
  ``* scale`` or ``/ scale`` by a number, ending at ``matmul(q, k.transpose(-2, -1))``, or at
  ``bmm(q3, k3.transpose(1, 2))`` / ``baddbmm(input, q3, k3^T, beta=, alpha=)`` where
  ``q3``/``k3`` are ``[B, H, S, D] -> [B * H, S, D]`` reshapes (``alpha`` is the scale,
  ``beta * input`` a term unless ``input`` is ``torch.zeros``). Views that keep the key
  dimension and fp32 casts may sit anywhere. Terms are summed into one additive mask
  (a 3-D per-head term is unflattened to ``[B, H, T, S]``), bool masks become ``-inf``
  there; "-big" is a constant <= -1e4 (``finfo.min``), so only rows with every key masked
  differ (kv4 gives zeros);
* cache write: ``torch.cat([past, new], dim=-2 or 2)`` that the graph returns (whole or as
  a window's eviction slice), ``past`` being ``torch.tensor([])`` (the prefill graph of a
  ``DynamicCache``), a PackedKV placeholder (decode graphs) or a plain ``[B, H, S, D]`` float
  tensor (a cache filled elsewhere); or ``buffer.index_copy_(2, positions, new)`` into a
  static buffer: a PackedKV placeholder (``StaticKVCache``), or ``torch.zeros`` / a PackedKV
  allocated in this graph (a static layer's first update, compiled), attention reading the
  buffer or its prefix ``[:, :, :n]`` before or after the view chain; or a DynamicCache write read through
  ``full[:, :, start:]`` whose sizes prove it holds every new token and a stored one (a sliding layer that
  keeps its past for assisted decoding's crops: the past's window ``past[:, :, start + T:]`` is read, the
  appends apart from the attention). K and V may be one write (DeepSeek-V4's shared
  KV) when their specs are equal. ``cat([write, extra], dim=2)`` that is not returned reads
  ``extra`` (DeepSeek-V4's compressed entries, kept elsewhere) as more exact new tokens;
* view chain: nothing (SDPA with or without ``enable_gqa``), an fp32 cast, ``x[:, :, None]`` ->
  ``expand`` -> ``reshape`` (``repeat_kv``), which the GQA-aware kv4 op makes redundant, or
  ``x.repeat(1, n, 1, 1)`` (JetMoE: query head h reads KV head h % H_kv), for which the
  query heads are permuted into grouped order around the op (masks must be shared by all heads);
  for V only, ``torch.chunk(x, m, dim=1)[c].repeat(1, n, 1, 1)`` with as many heads as K
  (DiffLlama), read as a list of stored heads (``kv4_sdpa(v_heads=...)``, which copies them);
* besides attention the written cache may be returned (the cache object keeps it), sliced
  along the sequence and returned (a sliding-window layer's eviction), read by other
  sites (differential attention: packed once, each site reads the packed past), or read
  by any other node that does not write into it (Doge's dynamic mask), which is given
  ``cat([past.dequantize(), new])``: what HF's cache would give it, at the cost of an fp
  copy of the cache per step (noted in the site report).

An attention over K and V caches that the graph takes as packed inputs and does not write (an
encoder-decoder's cross-attention after its first step: the encoder's output, stored once) reads them
as stored, with no new tokens (phase ``read``, ``_read_stored``).

A cache write that no attention reads directly, only projections of it (MLA: DeepSeek-V2/V3
and kin cache a compressed latent and expand it into K and V after the read), is a latent
cache: stored int4 with the V spec (per-token groups, any length), its readers given
``cat([past.dequantize(), new])`` (a static buffer's: ``buffer.dequantize().index_copy(2,
positions, new)``), and its sites are reported with phase ``latent``. A decode site whose K and V
are transformers' MLA expansion of two such latents (``_Expansion``) attends over the int4 latent
itself, the projection absorbed into its query and output (``_absorb``); any other keeps its
attention over the expanded K and V, which dequantizes the latent each step.
A write whose view closure reaches an attention op (matmul, bmm, einsum, SDPA, flex_attention) that
did not match is not a latent cache: that site stays fp16 with its reason.

A decode site whose appends only its attention and the cache object read becomes one
``kv4_decode`` (both appends and ``kv4_sdpa``: all three read only the past, and on CPU each call
costs more than its one token's work); any other keeps the three calls, the reason logged.

The prefill attention keeps its op, over the exact new tokens; only the stored cache
becomes int4. Every candidate that does not match is reported with its reason and left alone.
Before matching, a size read the shapes fix at one number becomes that number (``_fold_known_sizes``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int, is_concrete_int, statically_known_true

from kvpass import graph_ops, reference
from kvpass.cache_argument import cache_name
from kvpass.config import MIN_EXTRAS_HEAD_DIM, KVConfig, QuantSpec
from kvpass.packed import PackedKV

log = logging.getLogger("kvpass")

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# transformers' attn_implementation="flex_attention" reaches the graph as this higher-order op.
FLEX_TARGETS = (torch.ops.higher_order.flex_attention,)

# Every replacement, by kind; tests and the CLI read it like Inductor's counters.
counters: Counter = Counter()


class NoMatch(Exception):
    """A site that stays fp16; the message is the reason shown to the user."""


# The phase of an attention whose K and V no cache holds (:func:`_reads_no_cache`): nothing to store.
NO_CACHE = "no cache"


@dataclasses.dataclass
class SiteReport:
    index: int
    module: str
    form: str  # a key of ATTENTION_FORMS: "sdpa", "eager" (matmul -> softmax -> matmul), "bmm" or "flex"
    # "prefill" (empty past), "decode", "static" (preallocated buffer), "latent" (MLA) or NO_CACHE
    phase: str
    rewritten: bool
    reason: str = ""

    @property
    def reads_cache(self) -> bool:
        """A site to rewrite: an attention over a KV cache, rewritten or not."""
        return self.phase != NO_CACHE

    @property
    def left_fp16(self) -> bool:
        """An attention over a KV cache that stays fp16."""
        return self.reads_cache and not self.rewritten


@dataclasses.dataclass
class _Attention:
    """One attention computation, whatever form it was written in."""

    output: fx.Node  # its result; every use of it moves to the fused op
    nodes: list[fx.Node]  # the computation, erased once the fused op replaces it
    query: fx.Node
    key: fx.Node
    key_reader: fx.Node  # the node that reads `key` (its first use inside attention)
    value: fx.Node
    value_reader: fx.Node
    attn_mask: fx.Node | None
    scale: float | None
    is_causal: bool
    softcap: float | fx.Node = 0.0  # a node: a float Dynamo passes in as a tensor (_is_float_input)
    keep: fx.Node | None = None  # bool mask applied as torch.where(keep, scores, very negative)
    drop: fx.Node | None = None  # bool mask applied as scores.masked_fill(drop, very negative)
    bias: list[_Bias] = dataclasses.field(default_factory=list)  # further terms added to the scores
    folded: bool = False  # the output is [B * H, T, D] (torch.bmm), the fused op's is [B, H, T, D]
    tiles: int = 1  # K/V heads tiled by repeat (head h reads KV head h % H_kv), set with the cache match
    sink: fx.Node | None = None  # [B, H, T, 1]: one more logit per row whose value is zero
    # A sink read as a scale of the output (:func:`_peel_scaled_sink`), broadcasting to [B, H, T]; it
    # becomes `sink` when the site is rewritten, as a match leaves the graph as it was.
    scaled_sink: fx.Node | None = None
    # (operator.mul or truediv, x): scores scaled by x, a float Dynamo passes in as a 0-d tensor
    # (:func:`_is_float_input`); the fused op gets the query scaled by it and ``scale=1.0``
    query_scale: tuple | None = None


@dataclasses.dataclass
class _Bias:
    """A term added to the scores (a mask, ALiBi, a position bias), summed into the op's mask."""

    node: fx.Node
    factor: float = 1.0
    folded: bool = False  # [B * H, T, S]: heads folded into the batch, unflattened for the op


@dataclasses.dataclass
class _CacheWrite:
    node: fx.Node  # the write: torch.cat (DynamicCache) or buffer.index_copy_ (StaticCache)
    past: fx.Node | None  # None: the empty tensor of a fresh DynamicCache layer
    new: fx.Node | None  # None: nothing written, the cache read as stored (_stored_read)
    chain: list[fx.Node]  # view nodes between the cache and attention, nearest to attention first
    # `full[:, :, -(window - 1):]` of a sliding-window layer: what it keeps for later steps
    evictions: list[fx.Node] = dataclasses.field(default_factory=list)
    reader: fx.Node | None = None  # the node of this site that reads the written cache
    # Other readers: other sites' readers, or nodes that get the dequantized cache (fp_readers).
    others: list[fx.Node] = dataclasses.field(default_factory=list)
    fp_readers: list[fx.Node] = dataclasses.field(default_factory=list)
    extra: fx.Node | None = None  # exact entries attention reads after the cache: cat([write, extra])
    heads: list[int] | None = None  # the stored head each head attention reads comes from (DiffLlama's V)
    # Attention reads the new tokens themselves, not the buffer they are copied into (a sliding
    # layer whose first write overflows its window keeps only the newest tokens).
    reads_new: bool = False
    # Attention reads `full[:, :, window_start:]` (< 0, every new token in it): the newest tokens of a
    # sliding layer that keeps its past until generate crops it (assisted decoding, prompt lookup).
    window_start: fx.Node | int | None = None


def _val(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _sdpa_args(node: fx.Node) -> dict:
    bound = dict(zip(SDPA_ARG_NAMES, node.args))
    bound.update(node.kwargs)
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return {**defaults, **bound}


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "?"
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L['args'][0].", "")


def layer_index(module: str) -> int | None:
    """The last number in a module path: 11 for ``model.layers.11.self_attn`` (``KVConfig.k_layers``)."""
    numbers = [part for part in module.split(".") if part.isdigit()]
    return int(numbers[-1]) if numbers else None


def _is_empty_tensor_ctor(node) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is torch.tensor
        and len(node.args) >= 1
        and node.args[0] == []
    )


def _is_repeat_kv_insert(node: fx.Node) -> bool:
    """``x[:, :, None, :, :]`` (or ``x[:, :, None]``) on a 4-D tensor."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) < 3 or index[2] is not None:
        return False
    full = slice(None, None, None)
    return all(i == full for i in index[:2]) and all(i == full or i is Ellipsis for i in index[3:])


def _method_or_function(node: fx.Node, name: str) -> bool:
    return (node.op == "call_method" and node.target == name) or (
        node.op == "call_function" and getattr(node.target, "__name__", None) == name
    )


def _walk_view_chain(arg: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """From an SDPA K/V argument back to the tensor the views start from."""
    if not isinstance(arg, fx.Node):
        raise NoMatch(f"K/V argument is a constant ({arg!r}), not a graph value")
    if _is_fp32_cast(arg):
        # An fp32 upcast before attention (GPT-Neo, Flint): kv4 attention computes in fp32 anyway.
        root, chain = _walk_view_chain(arg.args[0])
        return root, [arg, *chain]
    if _is_head_tiling(arg) and _is_head_chunk(arg.args[0]):
        # DiffLlama: one chunk of the KV heads tiled back to as many heads as K has
        part = arg.args[0]
        return part.args[0].args[0], [arg, part, part.args[0]]
    if _is_head_tiling(arg):
        return arg.args[0], [arg]
    if _method_or_function(arg, "reshape"):
        expand = arg.args[0]
        if isinstance(expand, fx.Node) and _method_or_function(expand, "expand"):
            insert = expand.args[0]
            if isinstance(insert, fx.Node) and _is_repeat_kv_insert(insert):
                root, chain = _walk_view_chain(insert.args[0])
                if _tiles(chain) > 1:
                    raise NoMatch(f"K/V heads are tiled by repeat and then repeated by repeat_kv at {arg.name}")
                return root, [arg, expand, insert, *chain]
        raise NoMatch(f"K/V reach SDPA through reshape {arg.name} that is not the repeat_kv idiom")
    return arg, []


def _is_head_tiling(node: fx.Node) -> bool:
    """``x.repeat(1, n, 1, 1)``: GQA by tiling, query head h reads KV head h % H_kv (JetMoE)."""
    if not (node.op == "call_method" and node.target == "repeat"):
        return False
    sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    return len(sizes) == 4 and sizes[0] == sizes[2] == sizes[3] == 1 and isinstance(sizes[1], int)


def _is_head_chunk(node) -> bool:
    """``torch.chunk(x, m, dim=1)[c]`` of a 4-D ``x``: a range of its heads."""
    if not (_is_call(node, (operator.getitem,)) and isinstance(node.args[1], int)):
        return False
    chunk = node.args[0]
    if not _is_call(chunk, (torch.chunk,), "chunk") or len(chunk.args) < 2 or not isinstance(chunk.args[1], int):
        return False
    dim = chunk.kwargs.get("dim", chunk.args[2] if len(chunk.args) > 2 else 0)
    val = _val(chunk.args[0])
    return dim in (1, -3) and val is not None and val.dim() == 4


def _selected_heads(chain: list[fx.Node]) -> list[int] | None:
    """Stored head read by each head of ``chunk(x, m, dim=1)[c].repeat(1, n, 1, 1)``, else None."""
    for node in chain:
        if _is_head_tiling(node) and _is_head_chunk(node.args[0]):
            part = node.args[0]
            chunk, c = part.args
            # The rewrite needs a number. A cache kvpass packed has its heads marked static
            # (packed._static_heads); should a symbol reach here still, the guard makes this graph serve
            # this count only.
            per_chunk = guard_int(_val(chunk.args[0]).shape[1]) // chunk.args[1]
            tiles = node.args[1][1] if len(node.args) == 2 else node.args[2]
            return [c * per_chunk + j % per_chunk for j in range(tiles * per_chunk)]
    return None


def _tiles(chain: list[fx.Node]) -> int:
    for node in chain:
        if _is_head_tiling(node) and not _is_head_chunk(node.args[0]):
            sizes = node.args[1] if len(node.args) == 2 else node.args[1:]
            return sizes[1]
    return 1


def _computed(node: fx.Node) -> str:
    """``name = op(inputs)`` for a reason: what a node computes, by the graph's node names (the debug diff
    shortens Dynamo's input names)."""
    if node.op not in ("call_function", "call_method"):
        return f"{node.name} ({node.op})"
    inputs = ", ".join(n.name for n in node.all_input_nodes)
    return f"{node.name} = {getattr(node.target, '__name__', node.target)}({inputs})"


def _cache_write(arg: fx.Node, reader: fx.Node, role: str) -> _CacheWrite:
    root, chain = _walk_view_chain(arg)
    if _is_sequence_prefix(root):
        # StaticLayer.update returns buffer[:, :, :kv_length] when the length is known; a model
        # that tiles heads itself may slice after tiling (JetMoE)
        prefix = root
        root, before = _walk_view_chain(prefix.args[0])
        chain = [*chain, prefix, *before]
        if not _is_static_buffer(root):
            raise NoMatch(f"{role} reads a prefix of {root.name}, which is not a static cache buffer")
    if _is_static_buffer(root):
        return _static_cache_write(root, chain, role)
    overflow = _window_overflow_write(root, chain)
    if overflow is not None:
        copy, stored = overflow
        return _CacheWrite(copy, copy.args[0], stored, chain, reads_new=True)
    window_start = None
    if _is_sequence_slice(root) and _is_sequence_cat(root.args[0]) and _is_stored(root.args[0]):
        # DynamicSlidingWindowLayer with record_past (assisted decoding, prompt lookup) stores every token
        # until generate crops it, and attention reads the newest window of them.
        window_start = _window_start(root)
        root, chain = root.args[0], [*chain, root]
    if not _is_sequence_cat(root):
        raise NoMatch(
            f"{role} does not come from a cache write (two-tensor torch.cat along the sequence); it is {_computed(root)}"
        )
    extra = None
    if not _is_stored(root) and _is_sequence_cat(root.args[0][0]) and _is_stored(root.args[0][0]):
        # cat([cache write, extra]): entries kept outside this cache (DeepSeek-V4's compressed KV)
        chain, extra, root = [*chain, root], root.args[0][1], root.args[0][0]
    past, new = root.args[0]
    new_val = _val(new)
    if new_val is None or new_val.dim() != 4:
        raise NoMatch(f"{role} new tokens {getattr(new, 'name', new)} are not a 4-D [B, H, T, D] tensor")
    if window_start is not None and not _holds_a_stored_token(window_start, new_val.shape[2]):
        raise NoMatch(f"{role} is the window {root.name}[:, :, {getattr(window_start, 'name', window_start)}:] of its "
                      "cache write, which need not hold every new token and a stored one: kv4 attends over stored "
                      "tokens and all new ones")  # fmt: skip
    if not new_val.dtype.is_floating_point:
        raise NoMatch(f"{role} cache dtype {new_val.dtype} is not floating point")
    site_reader = chain[-1] if chain else reader
    evictions = [n for n in root.users if _is_stored_sequence_slice(n)]
    if not _is_stored(root):
        raise NoMatch(f"{role} {root.name} joins tensors along the sequence but is not stored in the cache")
    # Readers of its sizes only are given the packed cache (same shape), not counted among them.
    others = [n for n in root.users
              if n is not site_reader and n.op != "output" and n not in evictions and not _reads_only_shape(n)]  # fmt: skip
    for node in others:
        if _writes_in_place(node):
            raise NoMatch(f"{role} cache {root.name} is written in place by {node.name}")
    heads = _selected_heads(chain)
    if _is_empty_tensor_ctor(past):
        return _CacheWrite(root, None, new, chain, evictions, site_reader, others, extra=extra, heads=heads,
                           window_start=window_start)  # fmt: skip
    past_val = _val(past)
    if not isinstance(past_val, PackedKV) and (past_val is None or past_val.dim() != 4):
        raise NoMatch(f"{role} past {getattr(past, 'name', past)} is neither an empty cache nor a [B, H, S, D] tensor")
    return _CacheWrite(root, past, new, chain, evictions, site_reader, others, extra=extra, heads=heads,
                       window_start=window_start)  # fmt: skip


def _window_start(window: fx.Node) -> fx.Node | int:
    """``start`` of the sequence slice ``window`` = ``x[:, :, start:]`` (a start of None or 0 is a prefix,
    which :func:`_cache_write` takes first)."""
    index = window.args[1][2]
    if index.stop is not None:
        raise NoMatch(f"{window.name} reads the stored tokens {index.start}:{index.stop}, not the newest of them")
    return index.start


def _holds_a_stored_token(window_start: fx.Node | int, new_tokens) -> bool:
    """Whether ``full[:, :, window_start:]`` provably holds all ``new_tokens`` and more."""
    start = _val(window_start) if isinstance(window_start, fx.Node) else window_start
    return start is not None and statically_known_true(-start > new_tokens)


def _is_sequence_cat(node) -> bool:
    if not _is_call(node, (torch.cat,)):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return dim in (-2, 2) and len(node.args[0]) == 2


def _is_stored(write: fx.Node) -> bool:
    """The cache object keeps it: returned by the graph, whole or as a window's eviction slice."""
    return any(n.op == "output" or _is_stored_sequence_slice(n) for n in write.users)


def _writes_in_place(node: fx.Node) -> bool:
    """``x[i] = y`` or an in-place method (``x.copy_(y)``, ``x.index_copy_(...)``): it writes into ``x``,
    its first argument."""
    return node.target is operator.setitem or (node.op == "call_method" and node.target.endswith("_"))


def _is_buffer_ctor(node: fx.Node) -> bool:
    """``torch.zeros((B, H, S, D), ...)``: a static cache layer allocating inside the graph."""
    return _is_call(node, (torch.zeros,)) and isinstance(_val(node), torch.Tensor) and _val(node).dim() == 4


def _is_allocated_here(node: fx.Node) -> bool:
    """fp zeros, or an int4 buffer (StaticKVCache's first update, traced), allocated in this graph."""
    return _is_buffer_ctor(node) or (node.op == "call_function" and node.target is PackedKV)


def _is_static_buffer(node: fx.Node) -> bool:
    return node.op == "placeholder" or _is_allocated_here(node)


def _is_sequence_prefix(node: fx.Node) -> bool:
    """``x[:, :, :n]`` or ``x[:, :, :n, :]``."""
    return _is_sequence_slice(node) and node.args[1][2].start in (None, 0)


def _static_cache_write(buffer: fx.Node, chain: list[fx.Node], role: str) -> _CacheWrite:
    """``buffer.index_copy_(2, positions, new)`` into a preallocated cache, then attention over it.

    The buffer is a graph input (allocated by an earlier forward) or allocated in this graph
    (the layer's first forward, compiled): ``past`` is then the ``torch.zeros`` node.
    """
    writes = [n for n in buffer.users if _is_slot_write(n)] or [n for n in buffer.users if _is_roll_write(buffer, n)]
    if not writes and buffer.op == "placeholder" and not isinstance(_val(buffer), PackedKV):
        # Dynamo broke the graph between the update and the attention (transformers' warning under
        # output_attentions=True is one such break); the earlier graph stored the cache as it came.
        raise NoMatch(
            f"{role} does not come from a cache write: it is {buffer.name}, an fp tensor this graph takes in and "
            f"writes nothing into (a cache updated outside this graph, across a graph break say, stays fp16, "
            f"unless that graph expands K and V from it there as an MLA latent, which it stores int4)"
        )
    if len(writes) != 1:
        raise NoMatch(f"{role} does not come from a cache write: it is {buffer.name}, not written here")
    if _is_buffer_ctor(buffer):
        if not _is_stored(buffer):
            raise NoMatch(f"{role} buffer {buffer.name} is allocated in the graph but not kept by the cache")
    elif not isinstance(_val(buffer), PackedKV):
        raise NoMatch(
            f"{role} static cache buffer {buffer.name} is fp, allocated before this graph: by a first forward that "
            "ran eagerly (a plain StaticCache under generate's compile_config), or by a compiled one whose site "
            "stayed fp16 (its reason is in that graph's site table); for int4 layers pass "
            f"{cache_name()}=kvpass.StaticKVCache(model.config, max_cache_len), or call "
            "kvpass.int4_static_caches(model) before generate(cache_implementation='static')"
        )
    (write,) = writes
    if write.target == "copy_":
        (setitem,) = [n for n in write.args[1].users if _is_call(n, (operator.setitem,))]
        new = setitem.args[2]
    else:
        new = write.args[3]
    return _CacheWrite(write, buffer, new, chain, heads=_selected_heads(chain))


def _is_slot_write(node: fx.Node) -> bool:
    """``buffer.index_copy_(2, positions, new)``: a static cache layer writing its slots."""
    return node.op == "call_method" and node.target == "index_copy_" and node.args[1] in (2, -2)


def _overflow_source(node: fx.Node) -> fx.Node | None:
    """``new`` where ``node`` is ``buffer.copy_(new[:, :, -window:])`` into a buffer this graph
    allocates: a sliding static layer's first update, with more tokens than its window."""
    if not (node.op == "call_method" and node.target == "copy_" and _is_allocated_here(node.args[0])
            and _is_stored(node.args[0])):  # fmt: skip
        return None
    source = node.args[1]
    return source.args[0] if _is_sequence_slice(source) else None


def _window_overflow_write(new: fx.Node, chain: list[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """``(buffer.copy_(stored[:, :, -window:]), stored)`` into a buffer this graph allocates, if there is one.

    ``StaticSlidingWindowLayer``'s first update with more tokens than its window: it keeps the
    newest and attends over all of them. ``stored`` is ``new``, or an fp32 cast of it on the way
    to attention (``chain``) where the layer upcasts K/V before its cache update (Beam).
    """
    for stored in (new, *(n for n in chain if _is_fp32_cast(n))):
        for copy in (copy for user in stored.users for copy in user.users):
            if _overflow_source(copy) is stored:
                return copy, stored
    return None


def _is_roll_write(buffer: fx.Node, node: fx.Node) -> bool:
    """``buffer.copy_(rolled)`` where ``rolled = buffer.roll(-1, dims=-2); rolled[:, :, index] = new``.

    A full ``StaticSlidingWindowLayer``'s decode step; PackedKV runs all three in int4, in place.
    """
    if not (node.op == "call_method" and node.target == "copy_" and node.args[0] is buffer):
        return False
    rolled = node.args[1]
    if not (isinstance(rolled, fx.Node) and rolled.op == "call_method" and rolled.target == "roll"):
        return False
    dims = rolled.kwargs.get("dims", rolled.args[2] if len(rolled.args) > 2 else None)
    setitems = [n for n in rolled.users if _is_call(n, (operator.setitem,))]
    return rolled.args[0] is buffer and dims in (2, -2, (2,), (-2,)) and len(setitems) == 1


def _is_sequence_slice(node: fx.Node) -> bool:
    """``x[:, :, a:b, :]``: a slice of the sequence only."""
    if not _is_call(node, (operator.getitem,)):
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) < 3 or not isinstance(index[2], slice):
        return False
    full = slice(None, None, None)
    others_full = all(i == full or i is Ellipsis for j, i in enumerate(index) if j != 2)
    return others_full and index[2].step in (None, 1)


def _is_stored_sequence_slice(node: fx.Node) -> bool:
    """A sequence slice whose result only goes to the cache."""
    return _is_sequence_slice(node) and all(u.op == "output" for u in node.users)


def _check_packable(write: _CacheWrite, spec: QuantSpec, role: str):
    D = _val(write.new).shape[-1]
    if not isinstance(D, int):
        raise NoMatch(f"{role} head_dim is symbolic ({D})")
    if D == 0:  # Mistral Large 4's rotary key in its layers without RoPE
        raise NoMatch(f"{role} has no channels: it stores nothing to quantize")
    if D % (8 // spec.bits):
        raise NoMatch(f"{role} head_dim {D} cannot be packed {8 // spec.bits} codes per byte")
    if write.evictions and spec.scheme == "channel":
        raise NoMatch(
            f"{role} is a sliding-window cache: evicting tokens from the front breaks per-channel groups "
            f"of {spec.group} tokens; use {role.lower()}_scheme='token' for such layers"
        )


def _reads_only_shape(node: fx.Node) -> bool:
    """Whether ``node`` reads a cache's sizes only (HF's sliding layer reads the length of its cache)."""
    return node.op == "call_method" and node.target in ("size", "dim")


def _replace_cache_write(
    graph: fx.Graph, write: _CacheWrite, spec: QuantSpec, packed_writes: dict, query: fx.Node | None = None,
    mask: fx.Node | None = None, fills_pads: bool = False,
) -> None:
    if write.node in packed_writes:
        return  # a cache several sites read (differential attention) is packed once
    shape_readers = [user for user in write.node.users if _reads_only_shape(user)]
    _give_fp_readers(graph, write)
    with graph.inserting_before(write.node):
        kwargs = {"spec": spec.tag, **_append_kwargs(query, mask, fills_pads)}
        if write.past is None:
            packed = graph.call_function(graph_ops.kv4_pack, (write.new,), kwargs)
        else:
            packed = graph.call_function(graph_ops.kv4_append, (write.past, write.new), kwargs)
    packed.meta.update({k: v for k, v in write.node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    # The attention chain reads the exact new tokens (prefill) or is dropped (decode);
    # every other reader (the graph output, i.e. the cache object) gets the packed cache.
    for user in list(write.node.users):
        if user.op == "output" or user in write.evictions or user in shape_readers:
            user.replace_input_with(write.node, packed)  # the packed cache has the fp one's shape
    packed_writes[write.node] = packed


def _append_kwargs(query: fx.Node | None, mask: fx.Node | None, fills_pads: bool) -> dict:
    """A write's keywords beyond its spec (``kv4_pack``, ``kv4_append``, ``kv4_decode``), those it has."""
    return {**({"query": query} if query is not None else {}), **({"mask": mask} if mask is not None else {}),
            **({"fills_pads": True} if fills_pads else {})}  # fmt: skip


def _give_fp_readers(graph: fx.Graph, write: _CacheWrite) -> None:
    """Readers that are no attention site get what HF's cache gave them: the dequantized past
    and the exact new tokens. This materialises the fp cache for them each step."""
    if not write.fp_readers:
        return
    full = write.new
    if write.past is not None:
        with graph.inserting_before(write.node):
            past = graph.call_method("dequantize", (write.past,))
            full = graph.call_function(torch.cat, ([past, write.new],), {"dim": -2})
    for user in write.fp_readers:
        user.replace_input_with(write.node, full)


def _fold_known_sizes(graph: fx.Graph) -> None:
    """Replace each read of a size the shapes fix at one number (``x.size()[i]``, ``x.size(i)``) by
    that number.

    Dynamo keeps such reads where it traced a size as a symbol and pinned it later: after a model of
    another head_dim ran in the same frame (transformers' shared forward wrapper), DiffLlama's graphs keep
    HF's ``value.shape[-1]`` after SDPA, of V's tiled chunk of the cache. That read would keep the view,
    and so an fp copy of the int4 cache, alive past the rewritten attention."""
    for size in [n for n in graph.nodes if n.op == "call_method" and n.target == "size"]:
        whole = len(size.args) == 1 and not size.kwargs  # x.size(), read by indexing
        for read in [u for u in size.users if u.target is operator.getitem] if whole else [size]:
            value = _val(read)
            if isinstance(value, (int, torch.SymInt)) and is_concrete_int(value):
                _replace_by_number(graph, read, int(value))
                counters["known_size_folded"] += 1
        if whole and not size.users:
            graph.erase_node(size)


# Arithmetic Dynamo records on sizes (``repeat_kv``'s ``heads * n_rep``), folded once its inputs are numbers.
SIZE_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.floordiv)


def _replace_by_number(graph: fx.Graph, node: fx.Node, value: int) -> None:
    users = list(node.users)
    node.replace_all_uses_with(value)
    graph.erase_node(node)
    for user in users:
        if user.target in SIZE_ARITHMETIC and not user.kwargs and all(isinstance(a, int) for a in user.args):
            _replace_by_number(graph, user, user.target(*user.args))


def _erase_if_dead(graph: fx.Graph, nodes):
    # once each, at its last mention: K and V chains may share their root end (shared-KV MQA)
    for node in reversed(dict.fromkeys(reversed(nodes))):
        if node.graph is graph:
            _erase_unread_sizes(graph, node)
            if not node.users:
                graph.erase_node(node)


def _erase_unread_sizes(graph: fx.Graph, node: fx.Node) -> None:
    # A chain's view of a symbolic length takes it from the cache (``kv.size()[2]``, Dynamo's reads of a
    # dynamic shape); with the view rewritten, such reads would keep the fp cache alive.
    for size in [u for u in node.users if u.op == "call_method" and u.target == "size"]:
        for read in [u for u in size.users if u.target is operator.getitem and not u.users]:
            graph.erase_node(read)
        if not size.users:
            graph.erase_node(size)


# --- the two forms of attention -----------------------------------------------------------


def _sdpa_candidates(graph: fx.Graph):
    return [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def _match_sdpa(sdpa: fx.Node) -> _Attention:
    args = _sdpa_args(sdpa)
    if args["dropout_p"] != 0.0:
        raise NoMatch(f"dropout_p={args['dropout_p']} (only inference attention, dropout 0, is rewritten)")
    return _Attention(
        sdpa, [sdpa], args["query"], args["key"], sdpa, args["value"], sdpa,
        args["attn_mask"], args["scale"], bool(args["is_causal"]),
    )  # fmt: skip


SOFTMAX_TARGETS = (torch.nn.functional.softmax, torch.softmax)
MATMUL_TARGETS = (torch.matmul, operator.matmul)
BMM_TARGETS = (torch.bmm,)
CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)


def _is_call(node, targets=(), method=None) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_function" and node.target in targets) or (node.op == "call_method" and node.target == method)


def _softmax_candidates(graph: fx.Graph):
    return [n for n in graph.nodes if _is_call(n, SOFTMAX_TARGETS, "softmax") and _probs_consumer(n, MATMUL_TARGETS)]


def _bmm_softmax_candidates(graph: fx.Graph):
    return [n for n in graph.nodes if _is_call(n, SOFTMAX_TARGETS, "softmax") and _probs_consumer(n, BMM_TARGETS)]


def _is_reshape(node) -> bool:
    return _is_call(node, (torch.reshape,), "view") or _is_call(node, (), "reshape")


def _known(condition) -> bool:
    """True only when the shapes prove it, so the check adds no guard on symbolic sizes."""
    return statically_known_true(condition)


def _keeps_key_dim(view: fx.Node) -> bool:
    """A view or reshape that leaves the last (key) dimension as it was."""
    out, src = _val(view), _val(view.args[0])
    return out is not None and src is not None and _known(out.shape[-1] == src.shape[-1])


def _probs_consumer(softmax: fx.Node, targets):
    """``(probs @ V, passed)`` after softmax -> [to / type_as / view] -> [dropout], or None."""
    node, passed = softmax, [softmax]
    while len(node.users) == 1:
        (user,) = node.users
        if (
            _is_call(user, (torch.nn.functional.dropout,), "to")
            or user.target in ("type", "type_as", "contiguous")
            or (_is_reshape(user) and _keeps_key_dim(user))
            or _is_sink_drop(user)
        ):
            node = user
            passed.append(user)
            continue
        if _is_call(user, targets) and user.args[0] is node:
            return user, passed
        return None
    return None


def _is_sink_drop(node) -> bool:
    """``probs[..., :-1]``: the attention-sink column dropped after softmax (GPT-OSS, MiMo)."""
    return (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
        and node.args[1] == (Ellipsis, slice(None, -1, None))
    )  # fmt: skip


def _peel_sink(node: fx.Node, nodes: list[fx.Node]) -> tuple[fx.Node, fx.Node | None]:
    """``cat([s, sink], -1) - max(., -1, keepdim=True).values`` before softmax: ``(s, sink)``.

    Subtracting the row max changes no softmax; the sink is one more logit per head.
    """
    while _is_fp32_cast(node):
        nodes.append(node)
        node = node.args[0]
    if _is_call(node, (operator.sub,)) and len(node.args) == 2:
        shifted, row_max = node.args
        values = row_max.args[0] if _is_call(row_max, (operator.getitem,)) and row_max.args[1] == 0 else None
        if values is not None and _is_row_max(values, shifted):
            nodes += [node, row_max, values]
            node = shifted
    sink = None
    cat_dim = (node.args[1:] or (node.kwargs.get("dim"),))[0] if _is_call(node, (torch.cat,)) else None
    if cat_dim in (-1, 3) and len(node.args[0]) == 2:
        nodes.append(node)
        node, sink = node.args[0]
        sink_val = _val(sink)
        if sink_val is None or sink_val.dim() != 4 or not _known(sink_val.shape[-1] == 1):
            raise NoMatch(f"scores are concatenated with {getattr(sink, 'name', sink)}, not one sink logit per row")
    return node, sink


def _is_dtype_cast(node) -> bool:
    """``x.to(dtype)`` or ``x.float()``: a cast of the values alone."""
    return _is_call(node, (), "float") or (
        _is_call(node, (), "to") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs
    )


def _single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _peel_scaled_sink(scores: fx.Node, out: fx.Node, nodes: list[fx.Node]) -> tuple[fx.Node, fx.Node | None]:
    """``out * sigmoid(logsumexp(scores, -1) - sink)[..., None]`` (Granite-SWA): ``(the product, sink)``;
    ``(out, None)`` where ``scores`` have no log-sum-exp, or one read otherwise (logged; the site then
    keeps that read, over the cache dequantized).

    With ``Z`` the softmax's sum, ``sigmoid(log Z - s) = Z / (Z + exp(s))``: the product is the softmax
    with one more logit ``s`` whose value is zero, the sink GPT-OSS writes as a column of the scores.
    """
    lse = [u for u in scores.users if _is_call(u, (torch.logsumexp,), "logsumexp")]
    if not lse:
        return out, None

    def unread(why: str) -> tuple[fx.Node, None]:
        log.debug("kvpass: the log-sum-exp of scores %s is read as no sink: %s", scores.name, why)
        return out, None

    if len(lse) > 1 or out.target is torch.bmm or _val(scores) is None:
        return unread("more than one log-sum-exp" if len(lse) > 1 else "heads are folded into the batch, or unknown")
    (lse,) = lse
    dim = (lse.args[1:] or (lse.kwargs.get("dim"),))[0]
    if dim not in (-1, [-1], (-1,), _val(scores).dim() - 1) or lse.kwargs.get("keepdim", lse.args[2:3] == (True,)):
        return unread(f"{lse.name} is over dim {dim}, not the keys' alone")
    sub = _single_user(lse)
    if not (_is_call(sub, (operator.sub,)) and sub.args[0] is lse and isinstance(sub.args[1], fx.Node)):
        return unread(f"{lse.name} is not read as logsumexp(scores) - sink alone")
    sink, sink_val = sub.args[1], _val(sub.args[1])
    if sink_val is None or sink_val.dim() > 3:
        return unread(f"{sink.name} does not broadcast to the log-sum-exp's [B, H, T]")
    chain = [lse, sub]

    def past_casts(node: fx.Node) -> fx.Node | None:
        # the reader of `node` past dtype casts, which join the chain
        user = _single_user(node)
        while _is_dtype_cast(user):
            chain.append(user)
            user = _single_user(user)
        return user

    for name, target in (("sigmoid", torch.sigmoid), ("unsqueeze", torch.unsqueeze)):
        node = past_casts(chain[-1])
        if not _is_call(node, (target,), name):
            return unread(f"{chain[-1].name} is read by {getattr(node, 'name', 'several nodes')}, not {name}")
        chain.append(node)
    if (node.args[1:] or (node.kwargs.get("dim"),))[0] not in (-1, _val(scores).dim() - 1):
        return unread(f"{node.name} does not add the last dimension")
    product = past_casts(node)
    if not (_is_call(product, (operator.mul,)) and {*product.args} == {out, chain[-1]} and len(out.users) == 1):
        return unread(f"the output {out.name} is not scaled by {chain[-1].name} alone")
    nodes += [product, *reversed(chain)]
    return product, sink


def _is_row_max(node, of: fx.Node) -> bool:
    if not (_is_call(node, (torch.max,), "max") and node.args[0] is of):
        return False
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    return dim in (-1, 3) and keepdim is True


def _number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _is_float_input(x) -> bool:
    """``t.item()`` of a Python float Dynamo passes in as a 0-d tensor ``t``: it stops specialising a
    float that changed between compiles (a second model of the same architecture, other head_dim)."""
    if not _is_call(x, (), "item"):
        return False
    (tensor,) = x.args
    return tensor.op == "placeholder" and getattr(tensor.meta.get("grapharg"), "pass_arg_as_tensor", False)


def _is_fp32_cast(node) -> bool:
    return _is_dtype_cast(node) and (node.target == "float" or node.args[1] is torch.float32)


def _folded_heads(flat: fx.Node, role: str) -> fx.Node:
    """``x.reshape(B * H, S, D)`` of a 4-D ``x [B, H, S, D]``: returns ``x``."""
    if not _is_reshape(flat) or not isinstance(flat.args[0], fx.Node):
        raise NoMatch(f"{role} of the 3-D attention is {flat.name}, not a reshape of a [B, H, S, D] tensor")
    src, out = _val(flat.args[0]), _val(flat)
    if src is None or out is None or src.dim() != 4 or out.dim() != 3:
        raise NoMatch(f"{role} reshape {flat.name} does not fold the heads of a 4-D tensor into the batch")
    if not (_known(out.shape[0] == src.shape[0] * src.shape[1]) and _known(out.shape[2] == src.shape[3])):
        raise NoMatch(f"{role} reshape {flat.name} is not [B, H, S, D] -> [B * H, S, D]")
    return flat.args[0]


def _baddbmm_args(node: fx.Node) -> dict:
    names = ("input", "batch1", "batch2")
    bound = {"beta": 1.0, "alpha": 1.0, **dict(zip(names, node.args))}
    bound.update(node.kwargs)
    return bound


@dataclasses.dataclass
class _Scores:
    """The softmax input read back to ``q @ k^T``."""

    nodes: list[fx.Node]
    query: fx.Node  # 4-D [B, H, T, D]
    key: fx.Node  # 4-D [B, H_kv, S, D]
    key_reader: fx.Node
    folded: bool  # computed on [B * H, T, S] (torch.bmm / baddbmm)
    scale: float
    softcap: float | fx.Node
    bias: list[_Bias]
    keep: fx.Node | None
    drop: fx.Node | None
    query_scale: tuple | None = None  # see _Attention.query_scale


def _bias_term(term, added_at: fx.Node, factor: float = 1.0) -> _Bias:
    if not isinstance(term, fx.Node):
        raise NoMatch(f"scores get a constant {term!r} added at {added_at.name}")
    at, val = _val(added_at), _val(term)
    # Added to [B * H, T, S] scores: a per-head term has the heads folded into its batch.
    folded = at is not None and at.dim() == 3 and val is not None and val.dim() == 3 and not _known(val.shape[0] == 1)
    return _Bias(term, factor, folded)


def _walk_scores(node: fx.Node) -> _Scores:
    """From the softmax input back to ``q @ k^T``; see the module docstring for what is accepted.

    Stages only go forward (masking, then the soft-cap, then the scale), so a mask added
    before the scale or inside the cap is refused rather than folded wrongly.
    """
    nodes, bias = [], []
    keep = drop = None
    scale, softcap, stage, query_scale = 1.0, 0.0, 0, None
    while True:
        if _is_reshape(node):
            if not _keeps_key_dim(node):
                raise NoMatch(f"scores are reshaped at {node.name} across the key dimension")
            nodes.append(node)
            node = node.args[0]
        elif _is_fp32_cast(node):
            nodes.append(node)
            node = node.args[0]
        elif stage == 0 and _is_call(node, (torch.max,)) and len(node.args) == 2 and _is_very_negative(node.args[1]):
            # clamping at finfo.min changes no row that has a key left
            nodes += [node, node.args[1]] if isinstance(node.args[1], fx.Node) else [node]
            node = node.args[0]
        elif stage == 0 and _is_call(node, (operator.add, torch.add), "add") and len(node.args) == 2 and not node.kwargs:
            lhs, rhs = node.args
            scores_side = lhs if _leads_to_qk(lhs) else rhs if _leads_to_qk(rhs) else None
            if scores_side is None:
                raise NoMatch(f"neither side of {node.name} leads to q @ k^T")
            bias.append(_bias_term(rhs if scores_side is lhs else lhs, node))
            nodes.append(node)
            node = scores_side
        elif stage == 0 and keep is None and _is_call(node, (torch.where,)) and len(node.args) == 3:
            keep, inner, fill = node.args
            if not _is_very_negative(fill):
                raise NoMatch(f"scores are masked at {node.name} with {fill}, not a very negative constant")
            nodes += [node, fill] if isinstance(fill, fx.Node) else [node]
            node = inner
        elif stage == 0 and drop is None and _is_call(node, (), "masked_fill") and len(node.args) == 3:
            inner, drop, fill = node.args
            if not _is_very_negative(fill):
                raise NoMatch(f"scores are masked at {node.name} with {fill}, not a very negative constant")
            nodes.append(node)
            node = inner
        elif stage == 0 and _is_call(node, (operator.mul,)) and _is_call(node.args[0], (torch.tanh,), "tanh"):
            cap = node.args[1] if _is_float_input(node.args[1]) else _number(node.args[1])
            inner = node.args[0].args[0]
            divisor = _is_call(inner, (operator.truediv,)) and inner.args[1]
            if cap is None or not (divisor is cap or _number(divisor) == cap):
                raise NoMatch(f"scores pass through tanh at {node.name} that is not cap * tanh(s / cap)")
            nodes += [node, node.args[0], inner]
            softcap, node, stage = cap if isinstance(cap, fx.Node) else float(cap), inner.args[0], 1
        elif stage < 2 and _is_call(node, (operator.mul, operator.truediv)):
            factor = _number(node.args[1])
            if _is_float_input(node.args[1]):
                query_scale = (node.target, node.args[1])
            elif factor is None:
                raise NoMatch(f"scores are scaled at {node.name} by a tensor, not a constant")
            else:
                scale = factor if node.target is operator.mul else 1.0 / factor
            nodes.append(node)
            node, stage = node.args[0], 2
        else:
            break
    if _is_call(node, MATMUL_TARGETS):
        query, k_t = node.args[:2]
        if not (_is_call(k_t, (torch.transpose,), "transpose") and sorted(d % 4 for d in k_t.args[1:3]) == [2, 3]):
            raise NoMatch(f"the keys of {node.name} are not transposed over their last two dimensions")
        nodes += [node, k_t]
        return _Scores(nodes, query, k_t.args[0], k_t, False, scale, softcap, bias, keep, drop, query_scale)
    if _is_call(node, BMM_TARGETS, "bmm") or _is_call(node, (torch.baddbmm,), "baddbmm"):
        if node.target in (torch.bmm, "bmm"):
            q_flat, k_t = (node.args + tuple(node.kwargs.values()))[:2]
        else:
            args = _baddbmm_args(node)
            q_flat, k_t, alpha, beta = args["batch1"], args["batch2"], _number(args["alpha"]), _number(args["beta"])
            if _is_float_input(args["alpha"]):
                query_scale, alpha = (operator.mul, args["alpha"]), 1.0
            if alpha is None or beta is None:
                raise NoMatch(f"baddbmm {node.name} has a non-constant alpha or beta")
            if stage == 2:
                raise NoMatch(f"baddbmm {node.name} is scaled again after its alpha, bias included")
            scale *= alpha
            added = args["input"]
            if _is_call(added, (torch.zeros,)):
                nodes.append(added)  # a zero bias: baddbmm used as a scaled bmm
            elif beta:
                bias.append(_bias_term(added, node, beta))
        if not (_is_call(k_t, (torch.transpose,), "transpose") and sorted(d % 3 for d in k_t.args[1:3]) == [1, 2]):
            raise NoMatch(f"the keys of {node.name} are not transposed over their last two dimensions")
        query, key = _folded_heads(q_flat, "query"), _folded_heads(k_t.args[0], "K")
        if not _known(_val(query).shape[1] == _val(key).shape[1]):
            raise NoMatch(f"3-D attention {node.name} folds different head counts for q and K")
        nodes += [node, k_t, k_t.args[0], q_flat]
        return _Scores(nodes, query, key, k_t.args[0], True, scale, softcap, bias, keep, drop, query_scale)
    raise NoMatch(f"softmax input {node.name} is not q @ k^T (times a constant, plus a mask)")


def _match_eager(softmax: fx.Node) -> _Attention:
    """``scores -> softmax -> [to] [-> view] [-> dropout] -> matmul(., v)`` or ``bmm`` over folded heads."""
    consumer = _probs_consumer(softmax, MATMUL_TARGETS) or _probs_consumer(softmax, BMM_TARGETS)
    out, probs_nodes = consumer
    dim = softmax.kwargs.get("dim", softmax.args[1] if len(softmax.args) > 1 else None)
    if dim not in (-1, _val(softmax).dim() - 1 if _val(softmax) is not None else 3):
        raise NoMatch(f"softmax over dim {dim}, not the key dimension")
    for node in probs_nodes:
        if _is_call(node, (torch.nn.functional.dropout,)):
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if p != 0.0 and training:
                raise NoMatch(f"attention dropout p={p} in training mode (only inference attention is rewritten)")
    sink_nodes = []
    scores_input, sink = _peel_sink(softmax.args[0], sink_nodes)
    if (sink is None) != (not any(_is_sink_drop(n) for n in probs_nodes)):
        raise NoMatch(f"the softmax input of {out.name} and its probs disagree on an attention-sink column")
    scores = _walk_scores(scores_input)
    scaled_nodes = []
    output, scaled_sink = _peel_scaled_sink(scores_input, out, scaled_nodes)
    if sink is not None and scaled_sink is not None:
        raise NoMatch(f"two attention sinks: a column of the scores and {scaled_sink.name}, a scale of the output")
    any_sink = sink if sink is not None else scaled_sink
    if any_sink is not None and not (scores.bias or scores.keep is not None or scores.drop is not None):
        raise NoMatch(f"attention sink {any_sink.name} with no mask to carry it")
    value, value_reader, nodes = out.args[1], out, [*scaled_nodes, out]
    if out.target is torch.bmm:
        value = _folded_heads(value, "V")
        value_reader = out.args[1]
        nodes.append(value_reader)
    nodes += [*reversed(probs_nodes), *sink_nodes, *scores.nodes]
    return _Attention(
        output, nodes, scores.query, scores.key, scores.key_reader, value, value_reader, None, scale=scores.scale,
        is_causal=False, softcap=scores.softcap, keep=scores.keep, drop=scores.drop, bias=scores.bias,
        folded=out.target is torch.bmm, sink=sink, scaled_sink=scaled_sink, query_scale=scores.query_scale,
    )  # fmt: skip


def _is_very_negative(fill) -> bool:
    """A masking fill: a number, ``torch.tensor(number)`` or ``torch.full((), number)`` of at most -1e4."""
    if isinstance(fill, fx.Node) and fill.op == "call_function" and fill.target is torch.tensor:
        fill = fill.args[0]
    elif isinstance(fill, fx.Node) and fill.op == "call_function" and fill.target is torch.full:
        if fill.args[0] not in ((), []):
            return False
        fill = fill.args[1]
    return _number(fill) is not None and fill <= -1e4


def _leads_to_qk(node) -> bool:
    for _ in range(10):  # through views, casts, the scale, the soft-cap, clamps and masks
        if _is_call(node, MATMUL_TARGETS + BMM_TARGETS + (torch.baddbmm,), "baddbmm") or _is_call(node, (), "bmm"):
            return True
        if not isinstance(node, fx.Node) or not node.args:
            return False
        node = node.args[1] if _is_call(node, (torch.where,)) and len(node.args) == 3 else node.args[0]
    return False


def _flex_candidates(graph: fx.Graph):
    return [n for n in graph.nodes if _is_call(n, FLEX_TARGETS)]


def _match_flex(flex: fx.Node) -> _Attention:
    # Its scores come from a traced score_mod and a block mask (sliding windows, documents, softcaps as
    # code), which kv4's ops have no argument for. Found so that it is reported, and so that its cache is
    # not taken for a latent: a packed cache reaching this op in the next graph fails Dynamo's trace.
    raise NoMatch("flex_attention (attn_implementation='flex_attention'): its score_mod and block mask have no "
                  "kv4 form; attn_implementation='sdpa' or 'eager' gives int4 caches")  # fmt: skip


# form -> (candidates in a graph, matcher); a candidate that does not match is reported.
ATTENTION_FORMS = {
    "sdpa": (_sdpa_candidates, _match_sdpa),
    "eager": (_softmax_candidates, _match_eager),
    "bmm": (_bmm_softmax_candidates, _match_eager),
    "flex": (_flex_candidates, _match_flex),
}


def _is_static(write: _CacheWrite) -> bool:
    return write.node.op == "call_method"


def _match_cache(attn: _Attention, config: KVConfig) -> tuple[_CacheWrite, _CacheWrite]:
    k = _cache_write(attn.key, attn.key_reader, "K")
    v = _cache_write(attn.value, attn.value_reader, "V")
    if (k.past is None) != (v.past is None) or _is_static(k) != _is_static(v) or k.reads_new != v.reads_new:
        raise NoMatch("K and V caches are in different states (one empty or static, the other not)")
    attn.tiles = _tiles(k.chain)
    if attn.tiles != _tiles(v.chain):
        raise NoMatch(f"K is tiled {attn.tiles} times over the heads and V {_tiles(v.chain)} times")
    if attn.tiles > 1:
        _check_tiled_masks(attn)
    if k.heads is not None:
        raise NoMatch("K reads a chunk of the cached heads; only V may (DiffLlama)")
    if v.heads is not None and not _known(len(v.heads) == _val(k.new).shape[1]):
        raise NoMatch(f"V reads {len(v.heads)} heads picked from a chunk, K has {_val(k.new).shape[1]}")
    if _is_static(k):
        for write, spec, role in ((k, config.k, "K"), (v, config.v, "V")):
            if _is_buffer_ctor(write.past):
                _check_packable(write, spec, role)
                if spec.scheme != "token":
                    raise NoMatch(
                        f"{role} is a static cache and kv4 fills its slots one write at a time; "
                        f"scheme={spec.scheme!r} needs its tokens in order, per-token groups ('token') do not"
                    )
        return k, v  # a graph input's buffer keeps the spec it was allocated with
    if k.node is v.node and config.k.scheme != "token":
        raise NoMatch(
            f"K and V are one cache tensor {k.node.name} (shared-KV MQA), stored with K's spec, and V is read "
            f"only from per-token groups; k_scheme={config.k.scheme!r} would need 'token'"
        )
    k_spec, v_spec = _site_specs(k, v, config)
    _check_packable(k, k_spec, "K")
    _check_packable(v, v_spec, "V")
    return k, v


def _fills_pads(specs: tuple[QuantSpec, QuantSpec]) -> bool:
    """Whether a site's first append copies each left-padded row's first tokens into its first pad
    slots (``PackedKV.filled_pads``), so K's sinks are the row's own: where both caches store every
    token on its own (a per-channel group or an fp window would mix the copies with their neighbours)."""
    return all(spec.tokens_apart for spec in specs)


def _site_specs(k: _CacheWrite, v: _CacheWrite, config: KVConfig) -> tuple[QuantSpec, QuantSpec]:
    """The specs K and V are stored with: one cache tensor read as both (shared-KV MQA) has K's."""
    if k.node is v.node:  # nor waits for K's prefix, as the twin's does not (kvpass.simulate), nor reads queries
        return (dataclasses.replace(config.k, defer_prefix=False, query_rounded=False),) * 2
    return config.k, config.v


def _check_tiled_masks(attn: _Attention) -> None:
    """Tiled heads are permuted into grouped order around the op; a per-head mask would need it too."""
    masks = [attn.attn_mask, attn.keep, attn.drop, attn.sink] + [term.node for term in attn.bias]
    for mask in masks:
        val = _val(mask)
        if mask is None or (val is not None and (val.dim() < 4 or _known(val.shape[-3] == 1))):
            continue
        name = getattr(mask, "name", mask)
        raise NoMatch(f"heads are tiled by repeat and mask {name} is not one mask for every head")
    if any(term.folded for term in attn.bias):
        raise NoMatch("heads are tiled by repeat and a bias is added per head on folded heads")
    if attn.scaled_sink is not None and not _known(_val(attn.scaled_sink).numel() == 1):
        raise NoMatch(f"heads are tiled by repeat and sink {attn.scaled_sink.name} may differ by head")


def _grouped_heads(graph: fx.Graph, x: fx.Node, tiles: int) -> fx.Node:
    """Head ``r * H_kv + g`` (tiled order) to ``g * tiles + r`` (grouped order, what the op reads)."""
    x = graph.call_method("unflatten", (x, 1, (tiles, -1)))
    return graph.call_method("flatten", (graph.call_method("transpose", (x, 1, 2)), 1, 2))


def _tiled_heads(graph: fx.Graph, x: fx.Node, tiles: int) -> fx.Node:
    x = graph.call_method("unflatten", (x, 1, (-1, tiles)))
    return graph.call_method("flatten", (graph.call_method("transpose", (x, 1, 2)), 1, 2))


def _copy_meta(src: fx.Node, dst: fx.Node):
    dst.meta.update({key: value for key, value in src.meta.items() if key in ("nn_module_stack", "stack_trace")})


def _replace_output(graph: fx.Graph, attn: _Attention, fused: fx.Node) -> None:
    _copy_meta(attn.output, fused)
    if attn.folded:
        with graph.inserting_after(fused):
            fused = graph.call_method("flatten", (fused, 0, 1))  # [B, H, T, D] -> [B * H, T, D]
        _copy_meta(attn.output, fused)
    attn.output.replace_all_uses_with(fused)


def _sink_column(graph: fx.Graph, attn: _Attention) -> None:
    """A sink read as a scale of the output, as the sink column ``[B, H, T, 1]`` the fused ops take."""
    if attn.scaled_sink is None:
        return
    column = graph.call_method("unsqueeze", (attn.scaled_sink, -1))  # broadcasts as the scale did
    rows = graph.call_function(operator.getitem, (attn.query, (Ellipsis, slice(None, 1))))
    attn.sink = graph.call_method("expand_as", (column, rows))


def _add_sink(graph: fx.Graph, attn: _Attention, k_new, v_new, k_like: fx.Node, v_like: fx.Node):
    """The sink as one more new token after ``k_new`` / ``v_new`` (None: a static read has none):
    key and value zero (shaped like a token of ``k_like`` / ``v_like``), its logit ``0 + sink`` from the mask."""
    first = (Ellipsis, slice(None, 1), slice(None))  # x[..., :1, :]
    zero_k, zero_v = (
        graph.call_function(torch.zeros_like, (graph.call_function(operator.getitem, (x, first)),)) for x in (k_like, v_like)
    )
    if k_new is None:
        k_new, v_new = zero_k, zero_v
    else:
        k_new = graph.call_function(torch.cat, ([k_new, zero_k],), {"dim": -2})
        v_new = graph.call_function(torch.cat, ([v_new, zero_v],), {"dim": -2})
    # mask [.., S] broadcast to the sink's [B, H, T, 1] rows, then the sink as column S + 1
    rows = graph.call_function(operator.add, (attn.attn_mask, graph.call_function(torch.zeros_like, (attn.sink,))))
    attn.attn_mask = graph.call_function(torch.cat, ([rows, attn.sink],), {"dim": -1})
    return k_new, v_new


def _build_mask(graph: fx.Graph, attn: _Attention) -> None:
    """Every term and bool mask the scores went through, as one mask for the fused op.

    ``where(keep, s, -big) + m`` is ``s + where(keep, m, -inf)``, and likewise for
    ``masked_fill(drop, -big)``, whichever order the model applied them in.
    """
    if not (attn.bias or attn.keep is not None or attn.drop is not None):
        return
    mask = attn.attn_mask
    with graph.inserting_before(attn.output):
        for term in attn.bias:
            node = term.node
            if term.folded:
                node = graph.call_method("unflatten", (node, 0, (-1, _val(attn.query).shape[1])))
            if term.factor != 1.0:
                node = graph.call_function(operator.mul, (node, term.factor))
            mask = node if mask is None else graph.call_function(operator.add, (mask, node))
        if attn.keep is not None:
            mask = graph.call_function(torch.where, (attn.keep, 0.0 if mask is None else mask, float("-inf")))
        if attn.drop is not None:
            mask = graph.call_function(torch.where, (attn.drop, float("-inf"), 0.0 if mask is None else mask))
    attn.attn_mask = mask


def _packed_buffer(graph: fx.Graph, write: _CacheWrite, spec: QuantSpec) -> QuantSpec:
    """The buffer ``write`` fills, as int4: allocated so when the graph allocates it."""
    if not _is_buffer_ctor(write.past):
        return _static_buffer_spec(write)  # allocated with its spec by an earlier forward
    spec = spec.for_slots
    ctor, val = write.past, _val(write.past)
    # The sizes as the graph gives them: a symbolic one (the length of generate's static cache, once a
    # second call's differed) is a node there, and a raw symbol in a node's arguments fails when it runs.
    size = ctor.kwargs.get("size", ctor.args[0] if len(ctor.args) == 1 else ctor.args)
    size = size if isinstance(size, fx.Node) else tuple(size)  # a node: some tensor's .shape
    with graph.inserting_before(ctor):
        packed = graph.call_function(
            graph_ops.kv4_zeros, (size,), {"dtype": val.dtype, "device": val.device, "spec": spec.tag}
        )  # fmt: skip
    _copy_meta(ctor, packed)
    ctor.replace_all_uses_with(packed)
    graph.erase_node(ctor)
    write.past = packed
    return spec


def _packed_buffer_once(graph: fx.Graph, write: _CacheWrite, spec: QuantSpec, shared: "_SharedWrites") -> QuantSpec:
    """:func:`_packed_buffer` by the first site that reads ``write``'s buffer; later ones (differential
    attention, a layer that reads an earlier one's K/V) take its int4 buffer and spec."""
    if write.node not in shared.buffers:
        spec = _packed_buffer(graph, write, spec)
        shared.buffers[write.node] = write.past, spec
    write.past, spec = shared.buffers[write.node]
    return spec


def _static_buffer_spec(write: _CacheWrite) -> QuantSpec | None:
    """The spec of a static cache's int4 buffer allocated before this graph (None: any other write)."""
    if not _is_static(write) or _is_buffer_ctor(write.past):
        return None
    return getattr(_val(write.past), "spec", None)


def _static_read(graph: fx.Graph, write: _CacheWrite) -> fx.Node:
    """The buffer, or the prefix of it that attention read."""
    prefix = [n for n in write.chain if _is_sequence_prefix(n)]
    if not prefix:
        return write.past
    return graph.call_function(operator.getitem, (write.past, prefix[0].args[1]))


def _write_slots(graph: fx.Graph, write: _CacheWrite) -> fx.Node:
    """``buffer.index_copy_(2, positions, new)`` as ``kv4::write_``, quantizing into the int4 buffer
    in place; the node that writes."""
    if write.node.target == "copy_":
        return write.node  # a sliding layer's roll, slot write and copy back are int4 already
    with graph.inserting_before(write.node):
        written = graph.call_function(graph_ops.kv4_write_, (write.past, write.node.args[2], write.new))
    _copy_meta(write.node, written)
    graph.erase_node(write.node)
    return written


def _scaled_query(graph: fx.Graph, attn: _Attention) -> fx.Node:
    """The query times the scale the scores were multiplied (or divided) by as a tensor, if any."""
    if attn.query_scale is None:
        return attn.query
    scale_op, factor = attn.query_scale
    return graph.call_function(scale_op, (attn.query, factor))


def _fused_attention(graph: fx.Graph, attn: _Attention, k: _CacheWrite, v: _CacheWrite, k_past, v_past, specs,
                     appends: dict | None = None) -> fx.Node | None:  # fmt: skip
    """Replace the attention by ``kv4_sdpa`` over ``k_past`` / ``v_past`` and, for a DynamicCache,
    the exact new tokens (a static buffer holds them already, quantized). With ``appends`` (the K
    append's keywords), by ``kv4_decode``, which appends too: returned, its outputs 1 and 2 the caches."""
    _build_mask(graph, attn)
    with graph.inserting_before(attn.output):
        _sink_column(graph, attn)
        query = _scaled_query(graph, attn)
        query = _grouped_heads(graph, query, attn.tiles) if attn.tiles > 1 else query
        k_new = v_new = None
        if not _is_static(k):
            k_new, v_new = (
                w.new if w.extra is None else graph.call_function(torch.cat, ([w.new, w.extra],), {"dim": -2})
                for w in (k, v)
            )  # fmt: skip
        if attn.sink is not None and appends is None:
            k_new, v_new = _add_sink(graph, attn, k_new, v_new, k.new, v.new)
        elif attn.sink is not None:
            appends = {**appends, "sink": attn.sink}  # the call attends to it and stores the new tokens alone
        kwargs = {
            "attn_mask": attn.attn_mask, "scale": attn.scale, "is_causal": attn.is_causal,
            "k_spec": specs[0].tag, "v_spec": specs[1].tag,
            **({"softcap": attn.softcap} if attn.softcap else {}),
            **({"v_heads": v.heads} if v.heads is not None else {}),
        }  # fmt: skip
        step = None
        if appends is None:
            fused = graph.call_function(graph_ops.kv4_sdpa, (query, k_past, k_new, v_past, v_new), kwargs)
        else:
            step = graph.call_function(graph_ops.kv4_decode, (query, k_past, k_new, v_past, v_new), {**kwargs, **appends})
            fused = graph.call_function(operator.getitem, (step, 0))
            fused._rename(f"{step.name}_out")
        if attn.tiles > 1:
            fused = _tiled_heads(graph, fused, attn.tiles)
    _replace_output(graph, attn, fused)
    _erase_if_dead(graph, attn.nodes + k.chain + v.chain)
    return step


def _appends_with_attention(attn: _Attention, k: _CacheWrite, v: _CacheWrite, shared: _SharedWrites, order: dict) -> str:
    """Why a decode site's appends cannot be one call with its attention (``kv4_decode``), or "" if
    they can: each write read by this site alone, and besides it only where the call's outputs
    exist (after the attention) and as a cache, not as floats."""
    if k.node is v.node:
        return "K and V are one tensor"
    if k.extra is not None or v.extra is not None or v.heads is not None:
        return "attention reads other new tokens than the appends store"
    if k.window_start is not None or v.window_start is not None:
        return "attention reads the newest window of the cache, the appends all of it"
    site = {*attn.nodes, *k.chain, *v.chain}
    # The call replaces the whole attention, views of the cache included: none may outlive it.
    for node in site - {attn.output}:
        if any(_outside(user, site) for user in node.users):
            return f"{node.name}, of its attention, is read elsewhere too"
    for write in (k, v):
        if write.node in shared.packed or shared.pending[write.node] > 1 or write.fp_readers:
            return f"cache write {write.node.name} has other readers"
        late = [u for u in write.node.users if u.op != "output" and _outside(u, {*site, *_returned_evictions(write)})]
        if any(order.get(u, -1) < order[attn.output] for u in late):
            return f"cache write {write.node.name} is read before the attention"
    return ""


def _outside(user: fx.Node, site: set) -> bool:
    """Whether ``user`` reads a node of ``site`` for more than ``site``: lengths read only for it
    (``repeat_kv``'s expand of a symbolic length) go with it."""
    return user not in site and not (_reads_only_shape(user) and _only_feeds(user, site))


def _only_feeds(node: fx.Node, nodes: set) -> bool:
    """Whether every use of ``node``'s value, directly or through ``getitem``, is by ``nodes``."""
    return all(u in nodes or (u.target is operator.getitem and _only_feeds(u, nodes)) for u in node.users)


def _append_with_attention(graph: fx.Graph, attn: _Attention, k: _CacheWrite, v: _CacheWrite, specs,
                           shared: _SharedWrites, appends: dict) -> None:  # fmt: skip
    """Replace a decode site's attention and both cache writes by one ``kv4_decode``, whose outputs 1
    and 2 (``kv4_decode_k``, ``kv4_decode_v``) the writes' readers get; ``appends``: K's append keywords."""
    step = _fused_attention(graph, attn, k, v, k.past, v.past, specs, appends)
    last = step
    for i, (write, role) in enumerate(((k, "k"), (v, "v")), 1):
        with graph.inserting_after(last):
            packed = graph.call_function(operator.getitem, (step, i))
        packed._rename(f"{step.name}_{role}")
        _copy_meta(write.node, packed)
        _erase_unread_sizes(graph, write.node)  # the chain's, gone with it
        write.node.replace_all_uses_with(packed)
        shared.packed[write.node] = packed
        last = packed
        for eviction in _returned_evictions(write):  # HF slices before its attention: after the call now
            last.append(eviction)
            last = eviction
    counters["decode_appends_with_attention"] += 1


def _read_stored(graph: fx.Graph, attn: _Attention) -> None:
    """Replace an attention over K and V caches that this graph takes and never writes (an encoder-decoder's
    cross-attention after its first step: the encoder's output, stored once) by ``kv4_sdpa`` over them with
    no new tokens, for every attention form; SDPA over them would read them int4 too (``PackedKV``), an eager
    form dequantized."""
    k = _stored_read(attn.key, attn.key_reader, "K")
    v = _stored_read(attn.value, attn.value_reader, "V")
    if attn.is_causal or attn.sink is not None or attn.scaled_sink is not None:
        raise NoMatch("a causal mask or a sink over caches read with no new tokens")
    attn.tiles = _tiles(k.chain)
    if attn.tiles != _tiles(v.chain) or k.heads is not None:
        raise NoMatch("K and V are tiled differently, or K reads a chunk of the stored heads")
    if attn.tiles > 1:
        _check_tiled_masks(attn)
    specs = (_val(k.past).spec, _val(v.past).spec)
    _fused_attention(graph, attn, k, v, k.past, v.past, specs)


def _stored_read(arg: fx.Node, reader: fx.Node, role: str) -> _CacheWrite:
    """``arg``'s cache as :func:`_read_stored` reads it: a packed graph input that nothing writes in place."""
    root, chain = _walk_view_chain(arg)
    if root.op != "placeholder" or not isinstance(_val(root), PackedKV):
        raise NoMatch(f"{role} is not a packed cache this graph takes")
    if any(_writes_in_place(user) for user in root.users):
        raise NoMatch(f"{role} cache {root.name} is written in place")
    return _CacheWrite(root, root, None, chain, reader=chain[-1] if chain else reader, heads=_selected_heads(chain))


def _returned_evictions(write: _CacheWrite) -> list[fx.Node]:
    """A sliding layer's eviction slices of ``write`` that only the graph's output reads: wherever HF
    slices (before its attention), they can follow the call that appends."""
    return [e for e in write.evictions if all(user.op == "output" for user in e.users)]


def _scales_query(graph: fx.Graph, attn: _Attention, k: _CacheWrite, v: _CacheWrite,
                  order: dict) -> tuple[fx.Node | None, str]:  # fmt: skip
    """The query a K write takes query scales or query rounding from, or None and why there is none."""
    if k.node is v.node:  # V would be read as stored, times the scales
        return None, "K and V are one tensor"
    if not _known(_val(attn.query).shape[2] == _val(k.new).shape[2]):
        return None, "its query has other tokens than the write stores (cross-attention over an encoder's output)"
    if order.get(attn.query, len(order)) > order[k.node] and not _hoist_before(attn.query, k.node, order):
        return None, "its query is computed after the cache update, from more than views and casts of an earlier one"
    if attn.tiles == 1:
        return attn.query, ""
    # The write groups query heads by the KV head they read, as the op does (JetMoE).
    with graph.inserting_before(k.node):
        return _grouped_heads(graph, attn.query, attn.tiles), ""


def _is_view_or_cast(node: fx.Node) -> bool:
    """A view, copy or cast of its first argument: moving it earlier changes no value."""
    return _is_call(node, (torch.reshape, torch.transpose, torch.permute)) or (
        node.op == "call_method" and node.target in VIEW_METHODS
    )


def _hoist_before(node: fx.Node, anchor: fx.Node, order: dict) -> bool:
    """Move ``node`` before ``anchor`` where the nodes between that it comes from are views and casts of
    one value computed before ``anchor`` (GPT-Neo casts its query to fp32 after the cache update, XGLM
    splits its heads there); True if it was moved."""
    chain = []
    while order.get(node, len(order)) > order[anchor]:
        if not (_is_view_or_cast(node) and node.args and isinstance(node.args[0], fx.Node)):
            return False
        if any(order.get(n, len(order)) > order[anchor] for n in node.all_input_nodes if n is not node.args[0]):
            return False  # a size computed after the update
        chain.append(node)
        node = node.args[0]
    for i, moved in enumerate(reversed(chain), 1):
        anchor.prepend(moved)
        order[moved] = order[anchor] - 1 + i / (len(chain) + 1)  # between anchor's predecessor and it
    return True


def _rewrite_site(
    graph: fx.Graph, attn: _Attention, k: _CacheWrite, v: _CacheWrite, config: KVConfig, shared: _SharedWrites,
    order: dict, query: fx.Node | None = None,
    mask: fx.Node | None = None,
    fills_pads: bool = False,
) -> str:
    if k.reads_new and v.reads_new:
        for write, spec in ((k, config.k), (v, config.v)):
            _packed_buffer_once(graph, write, spec, shared)  # PackedKV's copy_ quantizes the kept tokens in place
        return "prefill"
    if _is_static(k):
        # The new tokens go into the buffer (quantized) and attention reads only the buffer;
        # HF's mask (or the prefix HF reads) hides the slots not written yet.
        specs = []
        for write, spec in ((k, config.k), (v, config.v)):
            written = write.node in shared.buffers
            specs.append(_packed_buffer_once(graph, write, spec, shared))
            if not written:
                _write_slots(graph, write)
        with graph.inserting_before(attn.output):
            k_read, v_read = _static_read(graph, k), _static_read(graph, v)
        _fused_attention(graph, attn, k, v, k_read, v_read, specs)
        return "static"
    k_spec, v_spec = _site_specs(k, v, config)
    prefill = k.past is None
    apart = "" if prefill else _appends_with_attention(attn, k, v, shared, order)
    if not prefill and not apart:
        _append_with_attention(graph, attn, k, v, (k_spec, v_spec), shared, _append_kwargs(query, mask, fills_pads))
    else:
        if apart:
            log.debug("kvpass: site %s appends apart from its attention: %s", attn.output.name, apart)
            counters["decode_appends_apart"] += 1
        for write, spec in ((k, k_spec), (v, v_spec)):
            # V fills its rows' pads as K does (it needs the mask for that alone), or neither does.
            mask_read = mask if write is k or fills_pads else None
            _replace_cache_write(graph, write, spec, shared.packed, query if write is k else None, mask_read, fills_pads)
        if prefill:
            # Attention over an empty past is attention over the new tokens, kept exact.
            for write, reader in ((k, attn.key_reader), (v, attn.value_reader)):
                (write.chain[-1] if write.chain else reader).replace_input_with(write.node, write.new)
        else:
            k_past, v_past = _read_past(graph, k, attn), _read_past(graph, v, attn)
            _fused_attention(graph, attn, k, v, k_past, v_past, (k_spec, v_spec))
    for write in (k, v):
        shared.pending[write.node] -= 1
        if shared.pending[write.node]:
            continue  # another site still reads this cache write
        past_ctor = write.node.args[0][0]
        _erase_if_dead(graph, [write.node])
        if write.past is None:
            _erase_if_dead(graph, [past_ctor])
    return "prefill" if prefill else "decode"


def _read_past(graph: fx.Graph, write: _CacheWrite, attn: _Attention) -> fx.Node:
    """The stored tokens a decode site attends to besides the new ones: the whole past, or for a window
    ``full[:, :, start:]`` that holds every new token and more, ``past[:, :, start + new tokens:]``."""
    if write.window_start is None:
        return write.past
    with graph.inserting_before(attn.output):
        tokens = graph.call_method("size", (write.new, 2))
        first = graph.call_function(operator.add, (write.window_start, tokens))
        return graph.call_function(operator.getitem, (write.past, (slice(None), slice(None), slice(first, None))))


@dataclasses.dataclass
class _SharedWrites:
    """Cache writes several sites read: packed once, erased after the last of them (a static
    buffer: allocated int4 and written once)."""

    packed: dict = dataclasses.field(default_factory=dict)  # cat node -> its kv4_pack / kv4_append
    pending: Counter = dataclasses.field(default_factory=Counter)  # cat node -> sites not rewritten yet
    buffers: dict = dataclasses.field(default_factory=dict)  # static slot write -> (its int4 buffer, spec)


# Ops that compute attention scores or outputs from a cache tensor read directly.
ATTENTION_OPS = (*SDPA_TARGETS, *MATMUL_TARGETS, *BMM_TARGETS, torch.baddbmm, torch.einsum, *FLEX_TARGETS)
VIEW_METHODS = {"view", "reshape", "expand", "transpose", "permute", "contiguous", "unsqueeze", "squeeze",
                "flatten", "unflatten", "to", "float", "type_as", "repeat", "repeat_interleave", "split", "chunk"}  # fmt: skip


def _read_directly_by_attention(write: fx.Node) -> bool:
    """Whether views of ``write`` (no compute in between) reach an attention op."""
    seen, todo = set(), [write]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _is_call(user, ATTENTION_OPS):
                return True
            if _is_call(user, (operator.getitem, torch.split, torch.chunk, torch.transpose, torch.reshape)) or (
                user.op == "call_method" and user.target in VIEW_METHODS
            ):
                todo.append(user)
    return False


def _pack_dynamic_latent(graph: fx.Graph, node: fx.Node, config: KVConfig, shared: _SharedWrites) -> tuple[list, bool]:
    """A DynamicCache latent ``cat([past, new])``, packed like any cache write; its readers get
    the new tokens (prefill) or ``cat([past.dequantize(), new])``. Returns (readers, has a past)."""
    write = _cache_write(node, None, "latent cache")
    _check_packable(write, config.v, "latent cache")
    write.fp_readers = list(write.others)
    _replace_cache_write(graph, write, config.v.for_head_dim(_val(write.new).shape[-1]), shared.packed)
    past_ctor = node.args[0][0]
    _erase_if_dead(graph, [node])
    if write.past is None:
        _erase_if_dead(graph, [past_ctor])
    return write.fp_readers, write.past is not None


def _full_window_chunk(node: fx.Node) -> fx.Node | None:
    """``joined`` where ``node`` is ``buffer.copy_(joined[:, :, -window:])``, ``joined = cat([buffer[:, :, a:b], new])``:
    a sliding static layer taking several tokens once its window fills (chunked prefill, a continued chat)."""
    if not (node.op == "call_method" and node.target == "copy_" and _is_sequence_slice(node.args[1])):
        return None
    joined = node.args[1].args[0]
    if not _is_sequence_cat(joined):
        return None
    kept = joined.args[0][0]
    return joined if _is_sequence_slice(kept) and kept.args[0] is node.args[0] else None


def _is_static_latent_write(node: fx.Node) -> bool:
    """A static layer's write: slots (``index_copy_``), a full sliding window's roll, an overflowing
    first write, or several tokens into a full window (not built: :func:`_pack_static_latent` says so)."""
    return (_is_slot_write(node) or _is_roll_write(node.args[0], node) or _overflow_source(node) is not None
            or _full_window_chunk(node) is not None)  # fmt: skip


def _read_by_readers(node: fx.Node) -> fx.Node:
    """What a static latent write's readers read: the buffer, or the new tokens (an overflowing
    first write), or the buffer's kept tokens joined with them (several tokens into a full window)."""
    return _overflow_source(node) or _full_window_chunk(node) or node.args[0]


def _pack_static_latent(graph: fx.Graph, node: fx.Node, config: KVConfig) -> tuple[list, bool]:
    """A static cache's latent write (:func:`_is_static_latent_write`): the buffer int4 (allocated
    so, if this graph allocates it), written in place. Readers of the buffer get every slot
    dequantized, the new tokens exact, as a DynamicCache latent's readers get them:
    ``buffer.dequantize().index_copy(2, positions, new)``, or for a rolled window
    ``cat([buffer.dequantize()[:, :, :-1], new])``; an overflowing first write's readers read
    the new tokens already. Returns (readers, has a past)."""
    buffer, overflow = node.args[0], _overflow_source(node)
    if _full_window_chunk(node) is not None:
        raise NoMatch(f"latent cache {buffer.name} takes several tokens into a full sliding window (cat, then copy_ "
                      "of the newest), which is not built")  # fmt: skip
    if overflow is not None:
        write = _CacheWrite(node, buffer, overflow, [], reads_new=True)
    else:
        write = _static_cache_write(buffer, [], "latent cache")
    rolled = node.args[1] if _is_roll_write(buffer, node) else None
    positions = node.args[2] if _is_slot_write(node) else None  # read now: erasing the write clears its args
    readers = [u for u in buffer.users if u not in (node, rolled) and u.op != "output"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    if any(order[r] < order[node] for r in readers):
        raise NoMatch(f"latent cache {buffer.name} is read before its slots are written")
    has_past = not _is_allocated_here(buffer)
    if _is_buffer_ctor(buffer):
        spec = config.v.for_head_dim(_val(write.new).shape[-1]).for_slots
        _check_packable(write, spec, "latent cache")
        if spec.scheme != "token":
            raise NoMatch(f"latent cache is a static cache, which needs per-token groups; v_scheme={spec.scheme!r}")
        _packed_buffer(graph, write, spec)
    written = _write_slots(graph, write)
    if overflow is not None:
        return [u for u in overflow.users if u is not node.args[1]], has_past  # they read the new tokens, exact
    with graph.inserting_before(written.next):
        stored = graph.call_method("dequantize", (write.past,))
        if rolled is None:
            full = graph.call_method("index_copy", (stored, 2, positions, write.new))
        else:
            kept = graph.call_function(operator.getitem, (stored, (slice(None), slice(None), slice(None, -1))))
            full = graph.call_function(torch.cat, ([kept, write.new],), {"dim": 2})
    for reader in readers:
        reader.replace_input_with(write.past, full)
    return readers, has_past


@dataclasses.dataclass
class _Expansion:
    """MLA's K and V expanded from two latent caches read whole (``expand_kv`` of DeepSeek-V2/V3 and
    kin): ``kv = linear(latent, W).view(B, S, H, dn + dv).transpose(1, 2)``, ``k_nope, v = kv.split([dn,
    dv], -1)``, ``K = kv.new_empty(...)`` with ``K[..., :dn] = k_nope`` and ``K[..., dn:] = rope.expand(-1,
    H, -1, -1)``. ``latent`` and ``rope`` are the packed caches as their fp readers get them (:class:`_LatentRead`)."""

    nodes: list[fx.Node]  # the expansion, consumers first, erased once attention no longer reads it
    size_reads: list[fx.Node]  # K.size() read for its batch or length (a dynamic length's decode graph)
    weight: fx.Node  # W: [H * (dn + dv), r]
    heads: int
    nope: int  # dn: the channels of K that come from the latent
    latent: _LatentRead
    rope: fx.Node  # [B, 1, S, dr]: the rotary part of K, every token, dequantized (this step's exact)
    rope_new: fx.Node  # [B, 1, T, dr]: this step's, exact


@dataclasses.dataclass
class _LatentRead:
    """What a packed latent's fp readers get (:func:`_rewrite_latent_caches`), taken apart."""

    nodes: list[fx.Node]  # the read, from the node readers read back to the dequantize
    past: fx.Node  # the packed cache before this step, or the static buffer holding this step's tokens too
    new: fx.Node  # [B, 1, T, D]: this step's tokens, exact
    positions: fx.Node | None = None  # a static buffer's slots of them
    rolled: bool = False  # a full sliding window rolled, this step's token in its last slot


def _latent_read(node: fx.Node, role: str) -> _LatentRead:
    """``cat([past.dequantize(), new])`` (a DynamicCache), ``buffer.dequantize().index_copy(2, positions,
    new)`` (a static buffer's slots) or ``cat([buffer.dequantize()[:, :, :-1], new])`` (a rolled window)."""
    if _is_sequence_cat(node) and len(node.args[0]) == 2:
        stored, new = node.args[0]
        if _is_call(stored, method="dequantize"):
            return _LatentRead([node, stored], stored.args[0], new)
        if _is_sequence_slice(stored) and stored.args[1][2] == slice(None, -1) and _is_call(stored.args[0],
                                                                                              method="dequantize"):
            return _LatentRead([node, stored, stored.args[0]], stored.args[0].args[0], new, rolled=True)
    if _is_call(node, method="index_copy") and node.args[1] == 2 and _is_call(node.args[0], method="dequantize"):
        return _LatentRead([node, node.args[0]], node.args[0].args[0], node.args[3], node.args[2])
    raise NoMatch(f"the {role} is read as none of a packed past joined with the new tokens, a static buffer's slots "
                  "with them, or a rolled window's")  # fmt: skip


def _channel_free_read(node: fx.Node) -> _LatentRead | None:
    """A rotary latent of no channels (Mistral Large 4's layers without RoPE), which no cache packs
    (:func:`_check_packable`), read as HF joins it: ``cat([past, new])``."""
    if _is_sequence_cat(node) and _val(node) is not None and _known(_val(node).shape[-1] == 0):
        return _LatentRead([node], *node.args[0])
    return None


def _is_last_dim_slice(index) -> bool:
    """``x[..., a:b]`` or ``x[:, :, :, a:b]`` of a 4-D ``x``."""
    if not (isinstance(index, tuple) and isinstance(index[-1], slice) and index[-1].step is None):
        return False
    rest = index[:-1]
    return (rest == (Ellipsis,) or len(rest) == 3) and all(i is Ellipsis or i == slice(None) for i in rest)


def _match_expansion(attn: _Attention) -> _Expansion:
    """The latent caches ``attn``'s K and V are expanded from, in the form of :class:`_Expansion`."""
    split_v = attn.value
    if not (split_v.target is operator.getitem and split_v.args[1] == 1 and _is_call(split_v.args[0], (torch.split,
            torch.functional.split), "split")):  # fmt: skip
        raise NoMatch("V is not the second part of a split")
    split = split_v.args[0]
    kv, widths = split.args[0], split.args[1]
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    if not (isinstance(widths, (list, tuple)) and len(widths) == 2 and dim in (-1, 3) and kv.target == "transpose"):
        raise NoMatch("V is not split from the last dimension of a transposed projection")
    view = kv.args[0]
    linear = view.args[0] if _is_call(view, method="view") else None
    if not (tuple(kv.args[1:]) == (1, 2) and _is_call(linear, (torch._C._nn.linear,)) and
            (len(linear.args) < 3 or linear.args[2] is None) and not linear.kwargs.get("bias")):  # fmt: skip
        raise NoMatch("K and V are not a bias-free linear projection viewed as heads and transposed")
    key = attn.key
    if not _is_call(key, method="new_empty") or key.args[0] is not kv:
        raise NoMatch("K is not filled into a new tensor shaped like the projection")
    # The head count from W's rows, a number: the view infers it (-1), a symbol once the batch is dynamic.
    nope, rows = widths[0], _val(linear.args[1]).shape[0]
    if _val(view).shape[-1] != sum(widths) or rows % sum(widths):
        raise NoMatch("the projection's rows are not each head's K part then V part")
    heads = rows // sum(widths)
    copies, size_reads = {}, []
    for part in key.users:
        if part is attn.key_reader:
            continue
        if _reads_only_shape(part) and all(u.target is operator.getitem and u.args[1] in (0, 2) for u in part.users):
            size_reads.append(part)  # the batch or the length, which the rotary latent has too
            continue
        index = part.args[1] if part.target is operator.getitem else None
        copy = _single_user(part)
        if not (_is_last_dim_slice(index) and _is_call(copy, method="copy_") and copy.args[0] is part):
            raise NoMatch(f"K is read by {part.name} besides attention and the two copies filling it")
        copies[index[-1].start, index[-1].stop] = copy
    nope_copy, rope_copy = copies.get((None, nope)), copies.get((nope, None))
    if len(copies) != 2 or nope_copy is None or rope_copy is None:
        raise NoMatch(f"K is not filled as K[..., :{nope}] and K[..., {nope}:]")
    expand = rope_copy.args[1]
    if not (nope_copy.args[1].target is operator.getitem and nope_copy.args[1].args == (split, 0)
            and _is_call(expand, method="expand")):  # fmt: skip
        raise NoMatch("K is not the projection's first part beside the rotary latent expanded over heads")
    latent = _latent_read(linear.args[0], "latent")
    rope = _channel_free_read(expand.args[0]) or _latent_read(expand.args[0], "rotary latent")
    if _val(latent.new).shape[1] != 1 or _val(rope.new).shape[1] != 1:
        raise NoMatch("the latents have more than one head")
    if _val(attn.query).shape[-1] != nope + _val(rope.new).shape[-1]:
        raise NoMatch(f"the query's channels are not K's {nope} projected ones and the rotary key's")
    if (latent.positions, latent.rolled) != (rope.positions, rope.rolled):
        raise NoMatch("the latent and the rotary latent are written differently")
    if latent.rolled and _val(latent.new).shape[2] != 1:
        raise NoMatch("several tokens into a rolled window")
    parts = [rope_copy, nope_copy, rope_copy.args[0], nope_copy.args[0], key, expand, nope_copy.args[1], split_v]
    return _Expansion(parts + [split, kv, view, linear, *latent.nodes], size_reads, linear.args[1], heads, nope,
                      latent, rope.nodes[0], rope.new)  # fmt: skip


def _rope_scores(graph: fx.Graph, q_rope: fx.Node, rope: fx.Node, scale) -> fx.Node:
    """``q_rope . rope`` scaled: the rotary part of each score, for every head over the shared rope key."""
    return graph.call_function(operator.mul, (graph.call_function(torch.matmul, (q_rope, graph.call_method(
        "transpose", (rope, -2, -1)))), scale))  # fmt: skip


def _masked(graph: fx.Graph, scores: fx.Node, mask: fx.Node | None, keeps: bool) -> fx.Node:
    """``scores`` under ``mask``: where it is true if it ``keeps`` (a bool mask); else added to them."""
    if mask is None:
        return scores
    if keeps:
        return graph.call_method("masked_fill", (scores, graph.call_function(operator.invert, (mask,)), float("-inf")))
    return graph.call_function(operator.add, (scores, mask))


def _absorb(graph: fx.Graph, attn: _Attention, mla: _Expansion, spec: str) -> None:
    """Attention over the latent itself, K and V never expanded (MLA's weight absorption): with ``W``
    split per head into ``W_k`` (the dn rows making K) and ``W_v``, ``q_nope . k_nope = (q_nope W_k) .
    latent``, and ``p @ v = (p @ latent) W_v^T``. So ``kv4_sdpa`` attends with ``q_nope W_k`` over the
    int4 latent as one KV head, K and V alike; the rotary part of the scores enters as an additive mask."""
    if attn.is_causal or attn.softcap or attn.folded:
        raise NoMatch("only a mask or a sink may shape the scores (no is_causal, softcap or folded heads)")
    static = mla.latent.positions is not None
    if static and attn.attn_mask is None and not (attn.bias or attn.keep is not None or attn.drop is not None):
        raise NoMatch("a static buffer's slots are read with no mask to hide those not written yet")
    _build_mask(graph, attn)
    with graph.inserting_before(attn.output):
        _sink_column(graph, attn)
        query = _scaled_query(graph, attn)
        scale = attn.scale if attn.scale is not None else _val(attn.query).shape[-1] ** -0.5
        # [H, dn + dv, r]: head h's rows of W, first K's, then V's
        per_head = graph.call_method("unflatten", (mla.weight, 0, (mla.heads, -1)))
        w_k = graph.call_function(operator.getitem, (per_head, (slice(None), slice(None, mla.nope))))
        w_v = graph.call_function(operator.getitem, (per_head, (slice(None), slice(mla.nope, None))))
        q_nope = graph.call_function(operator.getitem, (query, (Ellipsis, slice(None, mla.nope))))
        q_rope = graph.call_function(operator.getitem, (query, (Ellipsis, slice(mla.nope, None))))
        q_latent = graph.call_function(torch.matmul, (q_nope, w_k))
        keeps = getattr(_val(attn.attn_mask), "dtype", None) == torch.bool  # _build_mask's terms are added
        mask = _masked(graph, _rope_scores(graph, q_rope, mla.rope, scale), attn.attn_mask, keeps)
        new = mla.latent.new
        if static:
            # The buffer holds this step's tokens quantized; they are read exact, after the slots, whose
            # own columns are hidden (their visibility among themselves is the mask's at their slots).
            positions = mla.latent.positions
            among_new = graph.call_function(torch.index_select, (attn.attn_mask, -1, positions))
            slots = graph.call_method("index_fill", (mask, -1, positions, float("-inf")))
            mask = _masked(graph, _rope_scores(graph, q_rope, mla.rope_new, scale), among_new, keeps)
            mask = graph.call_function(torch.cat, ([slots, mask],), {"dim": -1})
        elif mla.latent.rolled:
            # The window's last slot holds this step's token quantized, and the read its exact one in that
            # column: hidden there, it is read exact after the window.
            kept = graph.call_function(operator.getitem, (mask, (Ellipsis, slice(None, -1))))
            last = graph.call_function(operator.getitem, (mask, (Ellipsis, slice(-1, None))))
            hidden = graph.call_function(torch.full_like, (last, float("-inf")))
            mask = graph.call_function(torch.cat, ([kept, hidden, last],), {"dim": -1})
        if attn.sink is not None:
            attn.attn_mask = mask
            new, _ = _add_sink(graph, attn, new, new, new, new)
            mask = attn.attn_mask
        kwargs = {"attn_mask": mask, "scale": scale, "is_causal": False, "k_spec": spec, "v_spec": spec}
        args = (q_latent, mla.latent.past, new, mla.latent.past, new)
        out_latent = graph.call_function(graph_ops.kv4_sdpa, args, kwargs)
        fused = graph.call_function(torch.matmul, (out_latent, graph.call_method("transpose", (w_v, -2, -1))))
    for size in mla.size_reads:
        size.replace_input_with(attn.key, mla.rope)
    _replace_output(graph, attn, fused)
    _erase_if_dead(graph, attn.nodes + mla.nodes)


def _absorb_site(graph: fx.Graph, report: SiteReport, site: fx.Node) -> None:
    """A decode site over K and V expanded from int4 latents, rewritten to attend over the latent
    (:func:`_absorb`) where its expansion has MLA's form; otherwise left expanding, the reason logged."""
    try:
        attn = ATTENTION_FORMS[report.form][1](site)
        mla = _match_expansion(attn)
        spec = getattr(_val(mla.latent.past), "spec", None)
        if spec is None:
            raise NoMatch(f"the latent cache {mla.latent.past.name} is not a PackedKV with its spec in this graph")
        _absorb(graph, attn, mla, spec.tag)
    except NoMatch as why:
        log.debug("kvpass: site %d (%s) expands K and V from its latent each step: %s", report.index, report.module, why)
        return
    report.reason = "attends over its int4 latent cache directly (MLA's projections absorbed: K and V never expanded)"
    counters["absorbed_latent_site"] += 1


def _rewrite_latent_caches(graph: fx.Graph, config: KVConfig, shared: _SharedWrites, unmatched) -> set[int]:
    """Store caches that the graph reads, but no attention directly (MLA latents), int4; relabel the sites
    they feed. Returns the indices of the unmatched sites it found reading a latent it left fp16 (their
    reasons say why)."""
    reads, phase, left, over_fp16_latents = {}, "prefill", {}, set()
    for node in list(graph.nodes):
        if node in shared.packed or node in shared.buffers:
            continue  # a write some site rewrote (a sliding layer's roll stays a copy_)
        static = node.op == "call_method" and _is_static_latent_write(node)
        if not (static or (_is_sequence_cat(node) and _is_stored(node))):
            continue
        cache = node.args[0] if static else node
        read = _read_by_readers(node) if static else cache
        if _read_directly_by_attention(read):
            continue  # an attention form that did not match reads it: that site says why
        if all(user is node or user.op == "output" or _is_stored_sequence_slice(user) for user in read.users):
            # A latent's whole cache is read by the step that writes it; a history only kept is not
            # (QuantizedCache's fp residual, which its next step reads beside its quantized tokens).
            log.info("kvpass: cache write %s stays fp16: no attention in this graph reads it (a history kept for "
                     "a later step, or a cache whose attention lies past a graph break: TORCH_LOGS=graph_breaks "
                     "says where Dynamo broke)", cache.name)  # fmt: skip
            continue
        try:
            if static:
                readers, has_past = _pack_static_latent(graph, node, config)
            else:
                readers, has_past = _pack_dynamic_latent(graph, node, config, shared)
        except NoMatch as why:
            log.debug("kvpass: latent cache %s stays fp16: %s", cache.name, why)
            left[cache] = str(why), layer_index(_module_path(node))
            continue
        # What the readers now get: the new tokens (prefill) or every stored token dequantized,
        # by the layer that reads it (a later layer's site descends from it too, through the residual).
        for reader in readers:
            reads.update(dict.fromkeys(reader.all_input_nodes, layer_index(_module_path(reader))))
        if has_past:
            phase = "latent"
        counters["latent_cache_write"] += 1
    for report, site in unmatched if reads or left else ():
        layer = layer_index(report.module)
        if _has_ancestor(site, {read for read, reader_layer in reads.items() if reader_layer == layer}):
            report.rewritten, report.phase = True, phase
            report.reason = "attends over K/V projected from an int4 latent cache (dequantized on read each step)"
            if phase == "latent":
                _absorb_site(graph, report, site)
            if config.for_layer(layer) is not config:
                report.reason += "; the latent cache is stored with V's settings, so this layer's K bits do not apply"
            counters[f"{report.form}_{phase}_site"] += 1
        elif "does not come from a cache write" in report.reason:
            # its K/V come from no cache write because they are projected from a latent that stayed fp16
            why = next((why for cache, (why, cache_layer) in left.items()
                        if cache_layer == layer and _has_ancestor(site, {cache})), None)  # fmt: skip
            if why is not None:
                report.reason = f"attends over K/V projected from a latent cache left fp16: {why}"
                over_fp16_latents.add(report.index)
    return over_fp16_latents


def _for_head_dims(config: KVConfig, k: _CacheWrite, v: _CacheWrite, notes: list[str]) -> KVConfig:
    """``config`` with K's and V's specs for their head dims (:meth:`QuantSpec.for_head_dim`)."""
    specs, narrow = {}, {}
    for role, write, spec in (("K", k, config.k), ("V", v, config.v)):
        heads, dim = _val(write.new).shape[1], _val(write.new).shape[-1]
        narrow_spec = specs[role.lower()] = spec.for_head_dim(dim)
        if narrow_spec != spec and not _is_static(write):  # slots never take the extras
            if narrow_spec.span_heads:
                span = f"{narrow_spec.heads_per_group(heads, dim) * dim} values (whole heads)"
            else:
                span = f"{spec.token_group(dim)} values"
            scale = "fp16" if reference.scale_dtype(narrow_spec, heads, dim) == reference.SCALE_DTYPE else "8-bit"
            narrow.setdefault(f"head_dim {dim}: one {scale} scale per {span}", []).append(role)
            stripped = [what for what, has in (("query scales", spec.query_scaled), ("query rounding", spec.query_rounded))
                        if has]  # fmt: skip
            if stripped:
                notes.append(f"K head_dim {dim}: stored without {' and '.join(stripped)}, as heads under "
                             f"{MIN_EXTRAS_HEAD_DIM} channels are")  # fmt: skip
    notes.extend(f"{' and '.join(roles)} {why} leaves no bytes for a second code plane, sinks or offset"
                 for why, roles in narrow.items())  # fmt: skip
    return dataclasses.replace(config, **specs)


def _sliding_kept(write: _CacheWrite) -> int | None:
    """How many tokens a sliding layer's eviction (``full[:, :, -kept:]``) keeps; None for other caches."""
    for eviction in write.evictions:
        start = eviction.args[1][2].start
        if isinstance(start, int) and start < 0 and eviction.args[1][2].stop is None:
            return -start
    return None


def _attention_output(candidate: fx.Node, form: str) -> fx.Node:
    """A candidate's result: the SDPA or flex_attention call, or an eager form's ``probs @ V``."""
    if form in ("sdpa", "flex"):
        return candidate
    return _probs_consumer(candidate, MATMUL_TARGETS if form == "eager" else BMM_TARGETS)[0]


def _kept_between_forwards(node: fx.Node) -> bool:
    """Whether ``node`` may be a KV cache's tensor: one of 4 dims or more (batch, heads, tokens,
    channels; a convolution's state has 3) that the graph returns or writes into, or that it takes
    in and is no parameter (a cache's tensor read, or a value a graph break passed on)."""
    val = _val(node)
    if not isinstance(val, torch.Tensor) or val.dim() < 4:
        return False
    if node.op in ("placeholder", "get_attr"):
        return not isinstance(val, torch.nn.Parameter)
    return any(user.op == "output" or (_writes_in_place(user) and user.args[:1] == (node,)) for user in node.users)


def _reads_no_cache(attn: _Attention, computed_here: set) -> bool:
    """Whether K and V descend from nothing a cache could hold, short of values ``computed_here`` (other
    attentions' results, which read their own caches; convolutions): an attention over values of this
    forward alone, such as Inkling2's over its layers' outputs or a vision encoder's over its patches,
    where a cache write is not missed but absent."""
    starts = [n for n in (attn.key, attn.value) if isinstance(n, fx.Node)]
    return not _upstream(starts, _kept_between_forwards, stop=computed_here)


def _has_ancestor(node: fx.Node, targets: set, limit: int = 400) -> bool:
    return _upstream(node.all_input_nodes, targets.__contains__, limit=limit)


def _upstream(starts: list[fx.Node], found, stop: set = frozenset(), limit: int | None = None) -> bool:
    """Whether ``found(n)`` holds for a node among ``starts`` or their inputs, transitively, not
    walking into ``stop`` and giving up after ``limit`` nodes."""
    seen, todo = set(), list(starts)
    while todo and (limit is None or len(seen) < limit):
        node = todo.pop()
        if node in seen or node in stop:
            continue
        if found(node):
            return True
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return False


def rewrite(gm: fx.GraphModule, config: KVConfig) -> list[SiteReport]:
    """Rewrite every matching attention site of ``gm`` in place; report every one found."""
    graph = gm.graph
    _fold_known_sizes(graph)
    candidates = [(node, form) for form, (find, _) in ATTENTION_FORMS.items() for node in find(graph)]
    order = {node: i for i, node in enumerate(graph.nodes)}
    candidates.sort(key=lambda c: order[c[0]])
    reports, matched, unmatched = [], [], []
    # A convolution's output is this forward's (ViT's patches of a 4-D pixel_values input): no cache holds it.
    computed_here = {_attention_output(node, form) for node, form in candidates}
    computed_here |= {node for node in graph.nodes if _is_call(node, CONVOLUTIONS)}
    for index, (node, form) in enumerate(candidates):
        module = _module_path(node)
        site_config = config.for_layer(layer_index(module))
        attn = None
        try:
            attn = ATTENTION_FORMS[form][1](node)
            matched.append((index, module, form, attn, site_config, *_match_cache(attn, site_config)))
        except NoMatch as why:
            reports.append(SiteReport(index, module, form, "?", False, str(why)))
            # Read now: rewriting the other sites replaces the attention results the walk stops at.
            reads_no_cache = attn is not None and _reads_no_cache(attn, computed_here)
            unmatched.append((reports[-1], node, str(why), reads_no_cache))
    # Match every site before rewriting any: a cache write may be read by several of them.
    shared, site_readers = _SharedWrites(), {}
    for *_, k, v in matched:
        for write in (k, v):
            shared.pending[write.node] += 1
            site_readers.setdefault(write.node, set()).add(write.reader)
    # A cache read by several layers' sites is stored once, with the settings of the first.
    owners: dict[fx.Node, KVConfig] = {}
    for index, module, form, attn, site_config, k, v in matched:
        notes = []
        if config.k_layers and layer_index(module) is None:
            notes.append(f"no layer index in module path {module!r}: K has the settings for every layer")
        site_config = _for_head_dims(site_config, k, v, notes)
        stored_config = owners.setdefault(k.node, site_config)
        if stored_config.k != site_config.k:
            shared_spec = stored_config.k.tag
            notes.append(f"K cache {k.node.name} is shared with an earlier layer and keeps its K spec {shared_spec}")
        site_config = stored_config
        held = _static_buffer_spec(k)
        if held is not None and held != site_config.k.for_slots:
            notes.append(f"K's static buffer {k.past.name} was allocated with {held.tag} and keeps it, "
                         f"not these settings' {site_config.k.for_slots.tag}")  # fmt: skip
        for write, role in ((k, "K"), (v, "V")):
            write.fp_readers = [n for n in write.others if n not in site_readers[write.node]]
            if write.fp_readers:
                names = ", ".join(n.name for n in write.fp_readers)
                notes.append(f"{role} cache {write.node.name} is also read by {names}, which gets it dequantized")
                log.info("kvpass: site %d (%s): %s", index, module, notes[-1])
        kept = _sliding_kept(k)
        if site_config.k.defer_prefix and kept is not None and kept + 1 < site_config.k.prefix_tokens:
            notes.append(f"K's sliding window keeps {kept} tokens, under the {site_config.k.prefix_tokens} its prefix "
                         "waits for: from a shorter prompt on, its K stays unquantized")  # fmt: skip
        query = None
        # A first write fixes query scales from its queries, a cache waiting for its prefix gathers them,
        # and a query-rounded K rounds its writes of enough tokens against them (QuantSpec.rounds).
        k_spec = site_config.k
        uses = ["query scales"] if k_spec.query_scaled and (k.past is None or k_spec.defer_prefix) else []
        uses += ["query rounding"] if k_spec.query_rounded and k.node is not v.node else []
        # A write an earlier site read is stored already, with that site's query: nothing to say here.
        if uses and not _is_static(k) and k.node not in shared.packed:
            query, why = _scales_query(graph, attn, k, v, order)
            if query is None:
                notes.append(f"K is stored without {' and '.join(uses)}: {why}")
        if query is None and k_spec.query_rounded:
            # Codes rounded to nearest say so in their spec: the twin and readers go by it.
            site_config = dataclasses.replace(site_config, k=dataclasses.replace(k_spec, query_rounded=False))
        # The mask comes with the query: the slots it hides from every query are left padding, which
        # K's statistics skip. Only the SDPA form's, and only when computed before the cache write.
        mask = attn.attn_mask if query is not None and order.get(attn.attn_mask, len(order)) < order[k.node] else None
        fills_pads = mask is not None and order[mask] < order[v.node] and _fills_pads(_site_specs(k, v, site_config))
        phase = _rewrite_site(graph, attn, k, v, site_config, shared, order, query, mask, fills_pads)
        reports.append(SiteReport(index, module, form, phase, True, "; ".join(notes)))
        counters[f"{form}_{phase}_site"] += 1
    for report, node, *_ in unmatched:
        try:
            _read_stored(graph, ATTENTION_FORMS[report.form][1](node))
        except NoMatch:
            continue  # the site's own reason stands
        report.rewritten, report.phase = True, "read"
        report.reason = "attends over int4 caches an earlier step wrote (a cross-attention's, of the encoder's output)"
        counters[f"{report.form}_read_site"] += 1
    unmatched = [entry for entry in unmatched if not entry[0].rewritten]
    over_fp16_latents = _rewrite_latent_caches(graph, config, shared, [(report, node) for report, node, *_ in unmatched])
    for report, _, no_match, reads_no_cache in unmatched:
        if report.rewritten:
            continue
        # Last: a site projected from a latent (above) may read only the new tokens its cache stores.
        if reads_no_cache and report.index not in over_fp16_latents:
            report.phase = NO_CACHE
            report.reason = f"reads no KV cache: K and V descend from nothing kept between forwards ({no_match})"
            log.debug("kvpass: site %d (%s, %s) %s", report.index, report.module, report.form, report.reason)
            counters["site_without_cache"] += 1
        else:
            log.debug("kvpass: site %d (%s, %s) left fp16: %s", report.index, report.module, report.form, report.reason)
            counters["site_left_fp16"] += 1
    reports.sort(key=lambda r: r.index)
    graph.lint()
    gm.recompile()
    return reports
