"""The ``kv4`` Dynamo backend: the kv4 rewrite composed with an inner compiler."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging

import torch
from torch._dynamo.backends.registry import lookup_backend

from kvpass import debug, passes
from kvpass.config import KVConfig, QuantSpec
from kvpass.tables import index_ranges

log = logging.getLogger("kvpass")


@dataclasses.dataclass
class CompiledGraph:
    """One graph the backend rewrote: its normalised code before and after, and its sites."""

    name: str
    # Out of the repr: a printed .graphs list would be pages of code (.diff shows what changed).
    before: str = dataclasses.field(repr=False)
    after: str = dataclasses.field(repr=False)
    sites: list[passes.SiteReport]

    @property
    def diff(self) -> str:
        return debug.graph_diff(self.before, self.after, self.name)


# A kv4 cache's inner tensors take more shapes than an fp cache's: prompts of under 6, 6-63 and 64+
# tokens keep different extras, and K waits unquantized for 64 tokens. Twelve varied generate() calls
# on a Llama compiled 34 graphs (20 since second planes' lengths are unbacked), against 9-10 with fp
# caches (docs/design.md); at Dynamo's default limit of 8 the third call stopped compiling and every
# later step ran eagerly on dequantized caches.
RECOMPILE_LIMIT = 64


class _RecompileLimitWatch(logging.Filter):
    """Says what Dynamo's recompile-limit warning means for kv4 caches; passes every record on."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Dynamo offers no hook for this; its own warning names the function and the limit.
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            log.warning(
                "kvpass: %s. From now on that function's calls that need a new graph run uncompiled: KV caches "
                "they create stay fp16, and kv4 caches are read dequantized (correct, but neither kv4's memory "
                "nor its speed). Raise torch._dynamo.config.recompile_limit (kvpass sets at least %d).",
                record.getMessage().splitlines()[0], RECOMPILE_LIMIT,
            )  # fmt: skip
        return True


@functools.cache
def _watch_recompile_limit() -> None:
    logging.getLogger("torch._dynamo.convert_frame").addFilter(_RecompileLimitWatch())


def _allow_recompiles() -> None:
    _watch_recompile_limit()
    # Dynamo's settings are per thread (a ContextVar each, torch 2.13): setting one reaches this thread
    # only. A server's request threads, or generate in a thread of its own as transformers' streaming
    # recipe runs it, would start at the default and stop compiling the model past it, so the default
    # is raised too, for threads this backend has not compiled in (a private entry; a torch without it
    # keeps one setting for every thread, which the line below sets).
    limit = getattr(torch._dynamo.config, "_config", {}).get("recompile_limit")
    if limit is not None:
        limit.default = max(limit.default, RECOMPILE_LIMIT)
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        log.info("kvpass: raising torch._dynamo.config.recompile_limit from %d to %d (kv4 caches take more "
                 "shapes than fp caches)", torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)  # fmt: skip
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT


# Numbered across the process, not per backend: two compiled models (a draft model and its target) write
# the same debug_dir, and one's graph_0 files must not replace the other's.
_graph_ids = itertools.count()


def rewrite_then(inner_compiler, config: KVConfig):
    """A Dynamo backend: rewrite attention sites of each graph, then hand it to ``inner_compiler``.

    The returned callable keeps a :class:`CompiledGraph` per graph in ``.graphs``.
    """

    def kv4_compiler(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
        _check_inner_options(config, options)
        _allow_recompiles()
        name = f"graph_{next(_graph_ids)}"
        before = debug.normalize_graph_code(gm)
        sites = passes.rewrite(gm, config)
        if config.k_layers and not kv4_compiler.k_layers_checked:
            kv4_compiler.k_layers_checked = _check_k_layers(config, kv4_compiler.graphs, sites)
        record = CompiledGraph(name, before, debug.normalize_graph_code(gm), sites)
        kv4_compiler.graphs.append(record)
        for site in sites:
            if site.left_fp16:
                log.info("kvpass: %s site %d (%s) stays fp16: %s", name, site.index, site.module, site.reason)
        if not kv4_compiler.fp16_warned:
            kv4_compiler.fp16_warned = _warn_fp16_sites(name, sites)
        if debug.debug_requested(config.debug, config.debug_dir):
            debug.report(record.name, record.before, record.after, sites, config.debug_dir)
        return inner_compiler(gm, example_inputs, mode=mode, options=options)

    kv4_compiler.graphs = []
    kv4_compiler.config = config
    kv4_compiler.k_layers_checked = False
    kv4_compiler.fp16_warned = False
    return kv4_compiler


def _warn_fp16_sites(name: str, sites: list[passes.SiteReport]) -> bool:
    """Warn, once a backend, that a graph leaves attention sites fp16 (INFO gives each site's reason, which a
    user who compiled for int4 caches would otherwise never see; the reason says whether the cache stays fp16
    too, as it does unless another graph stored it). Whether it warned."""
    left = [site for site in sites if site.left_fp16]
    if not left:
        return False
    first = left[0]
    log.warning("kvpass: %s leaves %d of its %d attention sites fp16; site %d (%s): %s. Each site's "
                "reason is logged at INFO (logging.getLogger('kvpass')), and the backend's .graphs hold them; "
                "this warning is not repeated for later graphs", name, len(left), sum(s.reads_cache for s in sites),
                first.index, first.module, first.reason)  # fmt: skip
    return True


def _check_k_layers(config: KVConfig, earlier: list[CompiledGraph], sites: list[passes.SiteReport]) -> bool:
    """Warn of ``k_layer_bits`` layers that hold no attention site, once ``sites`` repeat a layer an earlier
    graph had: every layer runs in a forward, so by then each layer's sites were compiled (or ran across a
    graph break, out of kv4's reach too), and the backend sees graphs, never the model. Whether it checked."""
    seen_before = {passes.layer_index(s.module) for graph in earlier for s in graph.sites if s.reads_cache}
    now = {passes.layer_index(s.module) for s in sites if s.reads_cache}
    if not (seen_before & now) - {None}:
        return False
    seen = sorted((seen_before | now) - {None})
    unknown = sorted(set(dict(config.k_layers)) - set(seen))
    if unknown:
        log.warning("kvpass: k_layer_bits names layer(s) %s, where no compiled graph has an attention site (the "
                    "sites are in layers %s): their bits apply to nothing. A layer's index is the number in its "
                    "module path, from 0 (model.layers.0.self_attn)",
                    index_ranges(unknown), index_ranges(seen))  # fmt: skip
    return True


def _check_inner_options(config: KVConfig, options: dict | None) -> None:
    """``options`` reaching a kv4 backend are its inner compiler's: kv4's own settings were taken out by
    ``backend="kv4"`` or belong in ``kvpass.kv4(...)``, and only inductor reads any."""
    if not options:
        return
    settings = sorted(set(options) & set(SETTINGS))
    if settings:
        raise ValueError(f"kvpass: options {settings} are kv4 settings, which a kvpass.kv4(...) backend takes as "
                         f"its own arguments (kvpass.kv4({settings[0]}=...)); backend='kv4' takes them as options")
    if config.inner != "inductor":
        raise ValueError(f"kvpass: options {sorted(options)} are not kv4 settings, and the {config.inner} inner "
                         f"compiler takes no options. kv4's settings: {list(SETTINGS)}; inductor's options need "
                         f"inner='inductor'")  # fmt: skip


def _inner(name: str):
    """The inner compiler; ``mode``/``options`` of ``torch.compile`` reach it as keywords."""
    if name == "inductor":
        return _inductor
    backend = lookup_backend(name) if name != "eager" else (lambda gm, example_inputs: gm.forward)

    def without_options(gm, example_inputs, mode=None, options=None):
        if mode:
            _warn_ignored(name, mode)
        return backend(gm, example_inputs)

    return without_options


# Once per mode, not per graph: generate's compile route passes CompileConfig's default
# mode="reduce-overhead" to every graph it compiles.
@functools.lru_cache(maxsize=None)
def _warn_ignored(name: str, mode) -> None:
    log.warning("kvpass: the %s inner compiler ignores mode=%r; CUDA graphs (mode='reduce-overhead') need "
                "kv4(inner='inductor')", name, mode)  # fmt: skip


def _inductor(gm, example_inputs, mode=None, options=None):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    # What torch.compile(backend="inductor", mode=...) would do for a built-in backend.
    # (list_mode_options(None) lists every mode, so no mode means no patches.)
    patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    return compile_fx(gm, example_inputs, config_patches=patches)


_DEFAULT = KVConfig()


def kv4(
    *,
    bits: int = _DEFAULT.k.bits,
    k_scheme: str = _DEFAULT.k.scheme,
    k_group: int = _DEFAULT.k.group,
    k_rotate: bool = _DEFAULT.k.rotate,
    v_scheme: str = _DEFAULT.v.scheme,
    v_group: int = _DEFAULT.v.group,
    v_rotate: bool = _DEFAULT.v.rotate,
    k_bits: int | None = None,
    v_bits: int | None = None,
    symmetric: bool = _DEFAULT.k.symmetric,
    k_symmetric: bool | None = None,
    v_symmetric: bool | None = None,
    window: int = _DEFAULT.k.window,
    clip: bool | None = None,
    refine: int | None = None,
    k_sinks: int | None = None,
    v_sinks: int | None = None,
    k_center: bool | None = None,
    v_center: bool | None = None,
    k_query_scaled: bool | None = None,
    k_defer_prefix: bool | None = None,
    k_prefix_tokens: int = _DEFAULT.k.prefix_tokens,
    k_query_rounded: int | bool | None = None,
    k_layer_bits: dict[int, int] | None = None,
    inner: str = _DEFAULT.inner,
    debug: bool = False,
    debug_dir: str | None = None,
):
    """A kv4 backend with non-default settings, for ``torch.compile(model, backend=kv4(...))``.

    ``bits`` sets both K and V unless ``k_bits``/``v_bits`` say otherwise. ``*_scheme`` is
    ``"token"`` (groups of channels per token) or ``"channel"`` (K only: groups of tokens
    per channel, KIVI-style, with an unquantized residual); ``*_rotate`` applies a Hadamard
    rotation of the head dimension before quantizing. ``symmetric=False`` stores a zero
    point per group (asymmetric grid, codes ``0..2**bits - 1``) for both K and V unless
    ``k_symmetric``/``v_symmetric`` say otherwise. ``clip`` picks each symmetric group's scale
    for the least squared error instead of ``amax / qmax`` (default: on for symmetric grids,
    off for asymmetric ones, which cannot clip). ``window`` keeps the newest ``window`` to
    ``window + 63`` tokens of K and V unquantized (per-token schemes; static caches keep
    none). ``refine`` keeps a second code plane (the quantized error) for the newest ``refine``
    tokens of K and V, at most 1/8 of a cache (per-token schemes without a window; static
    caches keep none; default: the default's, none with a ``window``); ``refine=0`` turns it off.
    ``k_sinks``/``v_sinks`` keep the first tokens of K/V unquantized (attention sinks), and
    ``k_center``/``v_center`` quantize K/V minus a fixed per-(sequence, head) offset, the mean of
    the first tokens (symmetric per-token schemes without a window; static caches keep neither;
    default: the default's where the scheme allows, else off).
    ``k_query_scaled`` stores K times per-channel scales taken from a prompt's queries and keys,
    read with the query divided by them (per-token schemes without a window; static caches and
    prompts under 64 tokens keep none; ``QuantSpec.query_scaled``).
    ``k_defer_prefix`` holds a cache's K unquantized (16 bits) until it holds 64 tokens, which then
    fix K's sinks, offset and query scales as a prompt of 64 would (``QuantSpec.defer_prefix``): a
    chat from a short prompt keeps all three, at the cost of 16-bit K in caches under 64 tokens
    (default: on where K takes any of the three).
    ``k_prefix_tokens`` is how many tokens after K's sinks its offset and query scales are computed
    over, at most, and what a deferring K waits for (``QuantSpec.prefix_tokens``; at least 64).
    ``k_query_rounded=N`` chooses K's codes against the queries of the append that quantizes them,
    in appends of ``N`` tokens or more, instead of rounding to nearest, at the same bytes: ``True``
    rounds every append, ``False`` none (symmetric per-token schemes without a window; static caches
    round to nearest; ``QuantSpec.query_rounded``; default: appends of ``ROUNDED_APPEND_TOKENS`` (64),
    a prompt or a prefill chunk, not decode steps).
    ``k_layer_bits`` maps layer indices to K bits for those layers (the rest of K's settings
    unchanged): ``{11: 8}`` stores layer 11's keys in int8. A layer's index is the last number
    in its attention module's path (``model.layers.11.self_attn``); a cache shared by several
    layers keeps the spec of the first layer that reads it, and a static cache allocated before
    compiling (``StaticKVCache``) the specs it was made with (the site table says so). A named
    layer with no attention site is named in a warning once a graph repeats a layer (the first
    decode step): the backend sees graphs, not the model. ``inner`` is the compiler the
    rewritten graph goes to: ``"eager"`` (cheapest to compile), ``"aot_eager"`` or
    ``"inductor"``. ``debug`` logs each graph's diff and site table through the ``kvpass``
    logger (as does ``KVPASS_DEBUG=1``); ``debug_dir`` (or ``KVPASS_DEBUG_DIR``) saves them as files there
    too, with ``debug`` or without.
    Raises ``ValueError`` naming any setting outside what is accepted.
    """
    k_symmetric = symmetric if k_symmetric is None else k_symmetric
    v_symmetric = symmetric if v_symmetric is None else v_symmetric

    def default(asked, default_value, allowed):
        # A default setting the chosen scheme cannot take is off, not an error; an asked one is checked.
        return (default_value if allowed else type(default_value)()) if asked is None else asked

    k_plain = k_scheme == "token" and not window  # per-token groups without a window
    v_plain = v_scheme == "token" and not window
    k_extras = dict(
        bits=k_bits or bits, scheme=k_scheme, group=k_group, rotate=k_rotate, symmetric=k_symmetric,
        window=window if k_scheme == "token" else 0, clip=_DEFAULT.k.clip and k_symmetric if clip is None else clip,
        refine=default(refine, _DEFAULT.k.refine, k_plain), sinks=default(k_sinks, _DEFAULT.k.sinks, k_plain),
        center=default(k_center, _DEFAULT.k.center, k_plain and k_symmetric),
        query_scaled=default(k_query_scaled, _DEFAULT.k.query_scaled, k_plain),
        query_rounded=default(k_query_rounded, _DEFAULT.k.query_rounded, k_plain and k_symmetric),
    )
    deferrable = any(k_extras[name] for name in ("sinks", "center", "query_scaled"))
    k = _spec("K", **k_extras, defer_prefix=default(k_defer_prefix, _DEFAULT.k.defer_prefix, deferrable),
              prefix_tokens=k_prefix_tokens)  # fmt: skip
    config = KVConfig(
        k=k,
        v=_spec(
            "V", bits=v_bits or bits, scheme=v_scheme, group=v_group, rotate=v_rotate, symmetric=v_symmetric,
            window=window, clip=_DEFAULT.v.clip and v_symmetric if clip is None else clip,
            refine=default(refine, _DEFAULT.v.refine, v_plain), sinks=default(v_sinks, _DEFAULT.v.sinks, v_plain),
            center=default(v_center, _DEFAULT.v.center, v_plain and v_symmetric),
        ),
        k_layers=_k_layers(k, k_layer_bits or {}),
        inner=inner,
        debug=debug,
        debug_dir=debug_dir,
    )
    return rewrite_then(_inner(config.inner), config)


def _spec(cache: str, **fields) -> QuantSpec:
    # QuantSpec names its own field (group, not k_group or v_group): say which cache's it is.
    try:
        return QuantSpec(**fields)
    except ValueError as why:
        raise ValueError(f"{cache} spec: {why}") from None


def _k_layers(k: QuantSpec, bits_by_layer: dict[int, int]) -> tuple[tuple[int, QuantSpec], ...]:
    if not isinstance(bits_by_layer, dict):
        raise ValueError(f"k_layer_bits must be a dict of layer index to K bits ({{11: 8}}), got {bits_by_layer!r}")
    for layer in bits_by_layer:
        if type(layer) is not int or layer < 0:
            raise ValueError(f"k_layer_bits: layer {layer!r} is not a layer index (an int >= 0)")
    layers = []
    for layer, bits in sorted(bits_by_layer.items()):
        try:
            layers.append((layer, dataclasses.replace(k, bits=bits)))
        except ValueError as why:
            raise ValueError(f"k_layer_bits[{layer}]: {why}") from None
    return tuple(layers)


# The keywords of kv4(): what torch.compile(..., backend="kv4", options={...}) may set.
SETTINGS = tuple(inspect.signature(kv4).parameters)


def check_settings(settings: dict, what: str, taken: tuple[str, ...] = ()) -> None:
    """Refuse ``settings`` naming anything but :func:`kv4`'s keywords, less those ``taken`` by the caller
    (``what`` takes the rest), naming the ones accepted, or holding a value :func:`kv4` refuses: before
    any work, which may run in processes of its own."""
    accepted = [name for name in SETTINGS if name not in taken]
    unknown = [name for name in settings if name not in accepted]
    if unknown:
        raise ValueError(f"kv4 settings {unknown} are not kvpass.kv4 settings {what} takes; those are {accepted}")
    kv4(**settings)


def kv4_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """``backend="kv4"`` (a ``torch_dynamo_backends`` entry point): the default settings, or those
    ``torch.compile``'s ``options`` set (``options={"bits": 8}``, any :func:`kv4` keyword). Options that
    are no kv4 setting go to the inner compiler (``options={"inner": "inductor", "max_autotune": True}``)."""
    options = options or {}
    settings = {name: value for name, value in options.items() if name in SETTINGS}
    inner_options = {name: value for name, value in options.items() if name not in SETTINGS}
    return default_backend(**settings)(gm, example_inputs, mode=mode, options=inner_options or None)


_BACKENDS: dict[KVConfig, object] = {}


def default_backend(**settings):
    """The compiler behind ``backend="kv4"``, or behind ``backend="kv4"`` with ``options=settings``:
    one per distinct configuration in a process, so that its ``.graphs`` record every graph it rewrote."""
    backend = kv4(**settings)
    return _BACKENDS.setdefault(backend.config, backend)
