"""KV-cache objects (transformers' ``Cache``) in and out of a tensor-parallel graph.

:func:`open_caches` opens a cache (one opaque pytree leaf) into its *slots*, the attributes of its layers that hold
tensors, so they bind to graph inputs and outputs like other tensors. Out: graph outputs that land only in a cache
may stay sharded; :class:`CacheOutput` rebuilds the object from the one Dynamo reconstructed and records each
tensor's shard with its owner in a weak identity map. In: a K/V tensor passed back must be one its module returned
(:func:`lookup`, else :class:`CacheError`); the capture sees zero-memory stand-ins of the global shape
(:func:`capture_copies`). A cache passed in is updated in place, as the model would update it.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["CacheError", "CacheOutput", "open_caches", "lookup", "capture_copies", "stand_in"]

# tensor -> (owner token, Shard | None): every cache tensor a TensorParallelModule returned
_RETURNED = WeakIdKeyDictionary()
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_DATA = ("keys", "values")  # the attributes transformers' cache layers keep their K/V in


class CacheError(ValueError):
    """A KV cache that a tensor-parallel module cannot take: not its own, or not of a layout it can open."""


def _cache_type():
    mod = sys.modules.get("transformers.cache_utils")  # a Cache object exists only once transformers made it
    return getattr(mod, "Cache", None)


def is_cache(x) -> bool:
    if isinstance(x, (torch.Tensor,) + _SCALARS):  # the common leaves, without a module lookup (Dynamo traces this)
        return False
    cls = _cache_type()
    return cls is not None and isinstance(x, cls)


def stand_in(t: torch.Tensor, shape=None) -> torch.Tensor:
    """A zero-memory tensor like ``t`` (one element expanded to ``shape``, default ``t``'s)."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(tuple(t.shape) if shape is None else shape)


def _slots(cache) -> tuple:
    """((layer index | None, attribute), ...) of the tensors ``cache`` holds, in a fixed order."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise CacheError(f"fxopt.parallelize: a {type(cache).__name__} holds no list of layers; the caches it can "
                         f"shard are transformers' layered ones (DynamicCache); call with use_cache=False")
    out = [(None, k) for k, v in sorted(vars(cache).items()) if isinstance(v, torch.Tensor)]
    for i, layer in enumerate(layers):
        out += [(i, k) for k, v in sorted(vars(layer).items()) if isinstance(v, torch.Tensor)]
    return tuple(out)


def _get(cache, slot):
    i, attr = slot
    return getattr(cache if i is None else cache.layers[i], attr)


def _statics(cache) -> tuple:
    """The hashable state besides tensors (layer types, ``is_initialized``, lengths): part of the signature."""
    def scalars(obj):
        return tuple((k, v) for k, v in sorted(vars(obj).items()) if isinstance(v, _SCALARS))
    return (type(cache).__name__, scalars(cache), tuple((type(l).__name__, scalars(l)) for l in cache.layers))


@dataclass(frozen=True)
class OpenCache:
    """One cache among the pytree leaves: its leaf index, where its tensors start in the flat list, its layout."""

    leaf: int
    start: int
    slots: tuple
    statics: tuple


def open_caches(leaves: list) -> tuple:
    """(flat, caches): the pytree ``leaves`` with every cache object replaced by its tensors, and where they sit."""
    flat, caches = [], []
    for i, x in enumerate(leaves):
        if is_cache(x):
            slots = _slots(x)
            caches.append(OpenCache(i, len(flat), slots, _statics(x)))
            flat.extend(_get(x, s) for s in slots)
        else:
            flat.append(x)
    return flat, tuple(caches)


def _where(name: str, slot) -> str:
    return f"{name}.layers[{slot[0]}].{slot[1]}" if slot[0] is not None else f"{name}.{slot[1]}"


def slot_names(caches: tuple) -> dict:
    """flat index -> a readable name (``DynamicCache.layers[0].keys``) of every cache tensor."""
    return {c.start + j: _where(c.statics[0], slot) for c in caches for j, slot in enumerate(c.slots)}


def lookup(flat: list, caches: tuple, token) -> dict:
    """flat index -> Shard | None (replicated) of every cache tensor; raises CacheError for a foreign one."""
    specs = {}
    for c in caches:
        for j, slot in enumerate(c.slots):
            t = flat[c.start + j]
            entry = _RETURNED.get(t)
            where = _where(c.statics[0], slot)
            if entry is None and slot[1] not in _DATA:
                specs[c.start + j] = None  # bookkeeping (a sliding window's size): fed whole, as it came
                continue
            if entry is None:
                raise CacheError(f"fxopt.parallelize: the cache passed in holds {where} {tuple(t.shape)}, a tensor "
                                 f"this module did not return (a cache of another model, or cropped / reordered "
                                 f"outside it); pass the cache this module returned, or none")
            if entry[0] is not token:
                raise CacheError(f"fxopt.parallelize: {where} of the cache passed in was returned by another "
                                 f"TensorParallelModule; each module takes back only its own cache")
            specs[c.start + j] = entry[1]
    return specs


def capture_copies(leaves: list, caches: tuple, specs: dict, tp: int) -> list:
    """The leaves with each cache replaced by a shallow copy whose sharded tensors are zero-memory stand-ins of the
    global shape (the capture never runs on them; Dynamo may mutate the copy, not the caller's object)."""
    from ..passes.tensor_parallel import Shard

    out = list(leaves)
    for c in caches:
        src = leaves[c.leaf]
        dup = copy.copy(src)
        dup.layers = [copy.copy(layer) for layer in src.layers]
        for j, slot in enumerate(c.slots):
            t = _get(src, slot)
            sh: Optional[Shard] = specs.get(c.start + j)
            if sh is None:
                continue  # a whole tensor: the capture may see it as it is
            shape = list(t.shape)
            if shape[sh.dim] != sh.local(tp):
                raise CacheError(f"fxopt.parallelize: a cache tensor {tuple(t.shape)} was returned with "
                                 f"{sh.local(tp)} of {sh.size} entries on dim {sh.dim}, it holds {shape[sh.dim]}")
            shape[sh.dim] = sh.size
            i, attr = slot
            setattr(dup if i is None else dup.layers[i], attr, stand_in(t, tuple(shape)))
        out[c.leaf] = dup
    return out


def tensor_source(t: torch.Tensor, dummy_ids: dict, leaf_ids: dict, what: str) -> tuple:
    """("graph", output index) or ("input", flat input index) of a tensor in the model's output."""
    if id(t) in dummy_ids:
        return ("graph", dummy_ids[id(t)])
    if id(t) in leaf_ids:
        return ("input", leaf_ids[id(t)])
    raise RuntimeError(f"fxopt.parallelize: {what} is neither a graph output nor an input")


@dataclass
class CacheOutput:
    """How to rebuild one cache object of the model's output after a run of the graph."""

    template: Any  # the object Dynamo reconstructed, its slot tensors cleared
    slots: tuple
    sources: tuple  # per slot: ("graph", output index) or ("input", flat input index)
    inplace: Optional[int] = None  # leaf index of the input cache this object is (updated in place), or None
    changed: dict = field(default_factory=dict)  # top-level attributes the forward set on that input cache
    specs: tuple = ()  # per slot: the Shard of a graph output left local (None: replicated)

    @classmethod
    def capture(cls, obj, dummy_ids: dict, leaf_ids: dict, inplace: Optional[int], before: Optional[dict]):
        slots = _slots(obj)
        sources = [tensor_source(_get(obj, slot), dummy_ids, leaf_ids, "a tensor of the output cache")
                   for slot in slots]
        changed = {}
        if before is not None:
            changed = {k: v for k, v in vars(obj).items() if k != "layers" and not isinstance(v, torch.Tensor)
                       and (k not in before or before[k] is not v)}
        for i, attr in slots:  # the template keeps no tensor alive (dummies of the full shape, stand-ins)
            setattr(obj if i is None else obj.layers[i], attr, None)
        return cls(obj, slots, tuple(sources), inplace, changed)

    def graph_outputs(self) -> dict:
        """graph output index -> slot description, for the outputs this object holds."""
        name = type(self.template).__name__
        return {w: _where(name, slot) for (k, w), slot in zip(self.sources, self.slots) if k == "graph"}

    def build(self, outs, flat: list, leaves: list, token):
        tensors = [outs[w] if k == "graph" else flat[w] for k, w in self.sources]
        obj = leaves[self.inplace] if self.inplace is not None else copy.copy(self.template)
        layers = [copy.copy(layer) for layer in self.template.layers]
        for (i, attr), t in zip(self.slots, tensors):
            setattr(obj if i is None else layers[i], attr, t)
        obj.layers = layers
        for k, v in self.changed.items():
            setattr(obj, k, v)
        for (k, _), t, sh in zip(self.sources, tensors, self.specs):
            if k == "graph":
                _RETURNED[t] = (token, sh)
        return obj
