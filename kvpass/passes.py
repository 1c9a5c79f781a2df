"""Find attention sites in Dynamo's torch-level FX graphs and rewrite them to kv4 ops.

A site is an SDPA call whose K and V arguments lead back, through the view chain of
``repeat_kv`` at most, to a cache write ``torch.cat([past, new], dim=-2)``. Accepted
node shapes:

* cache write: ``torch.cat([past, new], dim=-2 or 2)``, ``past`` being
  ``torch.tensor([])`` (the prefill graph of a ``DynamicCache``), a PackedKV placeholder
  (decode graphs) or a plain ``[B, H, S, D]`` float tensor (a cache filled elsewhere);
* view chain: nothing (SDPA with or without ``enable_gqa``), or ``x[:, :, None]`` ->
  ``expand`` -> ``reshape`` (``repeat_kv``), which the GQA-aware kv4 op makes redundant;
* besides attention the written cache may only be returned (the cache object keeps it)
  or sliced along the sequence and returned (a sliding-window layer's eviction);
* SDPA: ``dropout_p == 0``, any ``attn_mask``, ``is_causal`` and ``scale``.

The prefill attention keeps its SDPA, over the exact new tokens; only the stored cache
becomes int4. Every SDPA that does not match is reported with its reason and left alone.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter

import torch
import torch.fx as fx

from kvpass import graph_ops
from kvpass.config import KVConfig, QuantSpec
from kvpass.packed import PackedKV

log = logging.getLogger("kvpass")

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# Every replacement, by kind; tests and the CLI read it like Inductor's counters.
counters: Counter = Counter()


class NoMatch(Exception):
    """A site that stays fp16; the message is the reason shown to the user."""


@dataclasses.dataclass
class SiteReport:
    index: int
    module: str
    phase: str  # "prefill" (empty past) or "decode"
    rewritten: bool
    reason: str = ""


@dataclasses.dataclass
class _CacheWrite:
    cat: fx.Node
    past: fx.Node | None  # None: the empty tensor of a fresh DynamicCache layer
    new: fx.Node
    chain: list[fx.Node]  # view nodes between the cat and SDPA, nearest to SDPA first
    # `full[:, :, -(window - 1):]` of a sliding-window layer: what it keeps for later steps
    evictions: list[fx.Node] = dataclasses.field(default_factory=list)


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
    if _method_or_function(arg, "reshape"):
        expand = arg.args[0]
        if isinstance(expand, fx.Node) and _method_or_function(expand, "expand"):
            insert = expand.args[0]
            if isinstance(insert, fx.Node) and _is_repeat_kv_insert(insert):
                return insert.args[0], [arg, expand, insert]
        raise NoMatch(f"K/V reach SDPA through reshape {arg.name} that is not the repeat_kv idiom")
    return arg, []


def _cache_write(sdpa_arg: fx.Node, role: str) -> _CacheWrite:
    root, chain = _walk_view_chain(sdpa_arg)
    if not (root.op == "call_function" and root.target is torch.cat):
        raise NoMatch(f"{role} does not come from a cache write (torch.cat along the sequence); it is {root.format_node()}")
    tensors = root.args[0]
    dim = root.args[1] if len(root.args) > 1 else root.kwargs.get("dim", 0)
    if dim not in (-2, 2) or len(tensors) != 2:
        raise NoMatch(f"{role} cache write {root.name} is not a two-tensor cat along dim -2 (dim={dim})")
    past, new = tensors
    new_val = _val(new)
    if new_val is None or new_val.dim() != 4:
        raise NoMatch(f"{role} new tokens {getattr(new, 'name', new)} are not a 4-D [B, H, T, D] tensor")
    if not new_val.dtype.is_floating_point:
        raise NoMatch(f"{role} cache dtype {new_val.dtype} is not floating point")
    allowed_users = set(chain[-1:]) | {n for n in root.users if n.op == "output"}
    if chain == []:
        allowed_users |= {n for n in root.users if n.op == "call_function" and n.target in SDPA_TARGETS}
    evictions = [n for n in root.users if _is_stored_sequence_slice(n)]
    others = [n.name for n in root.users if n not in allowed_users and n not in evictions]
    if others:
        raise NoMatch(f"{role} cache {root.name} is also read by {', '.join(others)}, which would need it as fp16")
    if _is_empty_tensor_ctor(past):
        return _CacheWrite(root, None, new, chain, evictions)
    past_val = _val(past)
    if not isinstance(past_val, PackedKV) and (past_val is None or past_val.dim() != 4):
        raise NoMatch(f"{role} past {getattr(past, 'name', past)} is neither an empty cache nor a [B, H, S, D] tensor")
    return _CacheWrite(root, past, new, chain, evictions)


def _is_stored_sequence_slice(node: fx.Node) -> bool:
    """``x[:, :, a:b, :]`` (a slice of the sequence only) whose result only goes to the cache."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) < 3 or not isinstance(index[2], slice):
        return False
    full = slice(None, None, None)
    others_full = all(i == full or i is Ellipsis for j, i in enumerate(index) if j != 2)
    return others_full and index[2].step in (None, 1) and all(u.op == "output" for u in node.users)


def _check_packable(write: _CacheWrite, spec: QuantSpec, role: str):
    D = _val(write.new).shape[-1]
    if not isinstance(D, int):
        raise NoMatch(f"{role} head_dim is symbolic ({D})")
    if D % (8 // spec.bits):
        raise NoMatch(f"{role} head_dim {D} cannot be packed {8 // spec.bits} codes per byte")
    if spec.scheme == "token":
        try:
            spec.token_group(D)
        except ValueError as err:
            raise NoMatch(str(err)) from None
    if spec.rotate and D & (D - 1):
        raise NoMatch(f"{role} head_dim {D} is not a power of two, so it cannot be Hadamard-rotated")
    if write.evictions and spec.scheme == "channel":
        raise NoMatch(
            f"{role} is a sliding-window cache: evicting tokens from the front breaks per-channel groups "
            f"of {spec.group} tokens; use {role.lower()}_scheme='token' for such layers"
        )


def _match(sdpa: fx.Node, config: KVConfig) -> tuple[_CacheWrite, _CacheWrite, dict]:
    args = _sdpa_args(sdpa)
    if args["dropout_p"] != 0.0:
        raise NoMatch(f"dropout_p={args['dropout_p']} (only inference attention, dropout 0, is rewritten)")
    k = _cache_write(args["key"], "K")
    v = _cache_write(args["value"], "V")
    if (k.past is None) != (v.past is None):
        raise NoMatch("K and V caches are in different states (one empty, one not)")
    _check_packable(k, config.k, "K")
    _check_packable(v, config.v, "V")
    return k, v, args


def _replace_cache_write(graph: fx.Graph, write: _CacheWrite, spec: QuantSpec) -> None:
    with graph.inserting_before(write.cat):
        if write.past is None:
            packed = graph.call_function(graph_ops.kv4_pack, (write.new,), {"spec": spec.tag})
        else:
            packed = graph.call_function(graph_ops.kv4_append, (write.past, write.new), {"spec": spec.tag})
    packed.meta.update({k: v for k, v in write.cat.meta.items() if k in ("nn_module_stack", "stack_trace")})
    # The attention chain reads the exact new tokens (prefill) or is dropped (decode);
    # every other reader (the graph output, i.e. the cache object) gets the packed cache.
    for user in list(write.cat.users):
        if user.op == "output" or user in write.evictions:
            user.replace_input_with(write.cat, packed)


def _erase_if_dead(graph: fx.Graph, nodes):
    for node in nodes:
        if node.graph is graph and not node.users:
            graph.erase_node(node)


def rewrite(gm: fx.GraphModule, config: KVConfig) -> list[SiteReport]:
    """Rewrite every matching attention site of ``gm`` in place; report every SDPA call."""
    graph = gm.graph
    reports = []
    sdpas = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    for index, sdpa in enumerate(sdpas):
        module = _module_path(sdpa)
        try:
            k, v, args = _match(sdpa, config)
        except NoMatch as why:
            reports.append(SiteReport(index, module, "?", False, str(why)))
            log.debug("kvpass: site %d (%s) left fp16: %s", index, module, why)
            counters["site_left_fp16"] += 1
            continue
        prefill = k.past is None
        for write, spec in ((k, config.k), (v, config.v)):
            _replace_cache_write(graph, write, spec)
        if prefill:
            # Attention over an empty past is attention over the new tokens, kept exact.
            for write in (k, v):
                first_view = write.chain[-1] if write.chain else sdpa
                first_view.replace_input_with(write.cat, write.new)
            counters["prefill_site"] += 1
        else:
            with graph.inserting_before(sdpa):
                fused = graph.call_function(
                    graph_ops.kv4_sdpa,
                    (args["query"], k.past, k.new, v.past, v.new),
                    {
                        "attn_mask": args["attn_mask"],
                        "scale": args["scale"],
                        "is_causal": args["is_causal"],
                        "k_spec": config.k.tag,
                        "v_spec": config.v.tag,
                    },
                )
            fused.meta.update({k_: v_ for k_, v_ in sdpa.meta.items() if k_ in ("nn_module_stack", "stack_trace")})
            sdpa.replace_all_uses_with(fused)
            graph.erase_node(sdpa)
            _erase_if_dead(graph, k.chain + v.chain)
            counters["decode_site"] += 1
        for write in (k, v):
            past_ctor = write.cat.args[0][0]
            _erase_if_dead(graph, [write.cat])
            if write.past is None:
                _erase_if_dead(graph, [past_ctor])
        reports.append(SiteReport(index, module, "prefill" if prefill else "decode", True))
        counters["site_rewritten"] += 1
    graph.lint()
    gm.recompile()
    return reports
