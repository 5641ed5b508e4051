"""Quantized checkpoints: :func:`load_quantized` reads GPTQ (v1, v2) and AWQ (GEMM) safetensors into fxopt's
format; :func:`save_quantized` writes GPTQ.

K = in_features, N = out_features, G = group size; ``W[n, k] = (q[k, n] - zero[g, n]) * scale[g, n]`` with g =
``g_idx[k]`` (GPTQ) or ``k // G``. GPTQ's qweight [K/8, N] is fxopt's own layout; its ``qzeros`` [K/G, N/8] are packed
along N (v1 stores zero - 1, v2 the zero); AWQ packs qweight [K, N/8] and qzeros along N in the interleaved order
:data:`AWQ_ORDER`. Act-order ``g_idx`` becomes a permutation applied to the qweight rows once at load time. Loading is
all-or-nothing: everything is validated before the first module is replaced, and a problem raises a ValueError naming
it. ``load_quantized(save_quantized(m))`` is bitwise exact. Details: docs/architecture.md, "Quantization".
"""
from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from .format import PACK, PackedW4, pack_int4, unpack_int4
from .linear import QuantLinear, _set_submodule, share_sibling_storage

log = logging.getLogger(__name__)

GPTQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds output column 8c + AWQ_ORDER[i]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ST_DTYPES = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
              "F32": torch.float32, "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
              "BOOL": torch.bool}


def unpack_along_n(packed: torch.Tensor, order=GPTQ_ORDER) -> torch.Tensor:
    """int32 [R, N/8] -> int64 codes [R, N]; nibble i of column c is code ``8c + order[i]``."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"expected int32 [R, N/8], got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * 4
    nib = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.int64)  # [R, C, 8], nib[..., i] = code order[i]
    out = torch.empty_like(nib)
    out[..., list(order)] = nib
    return out.reshape(packed.shape[0], -1)


def pack_along_n(codes: torch.Tensor, order=GPTQ_ORDER) -> torch.Tensor:
    """Inverse of :func:`unpack_along_n`: integer codes [R, N] in 0..15 -> int32 [R, N/8]."""
    R, N = codes.shape
    if N % PACK:
        raise ValueError(f"pack_along_n needs N % 8 == 0, got {N}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
        raise ValueError("pack_along_n: codes must lie in 0..15")
    nib = c.view(R, N // PACK, PACK)[..., list(order)]
    shifts = torch.arange(PACK, device=c.device) * 4
    packed = (nib << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def _perm_from_g_idx(g_idx: Optional[torch.Tensor], K: int, G: int) -> Optional[torch.Tensor]:
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != K:
        raise ValueError(f"g_idx has {g.numel()} entries, expected K = {K}")
    natural = torch.arange(K) // G
    if torch.equal(g, natural):
        return None
    if int(g.min()) < 0 or int(g.max()) >= K // G:
        raise ValueError(f"g_idx values must lie in 0..{K // G - 1}")
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], natural):
        raise ValueError(f"g_idx does not put exactly group_size={G} input features in each group")
    return perm


def gptq_to_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
                   group_size: int, v2: bool = False, dtype: Optional[torch.dtype] = None) -> PackedW4:
    """One GPTQ layer (v1: zeros stored minus one; v2: as they are) -> :class:`PackedW4` (act-order permuted)."""
    K = qweight.shape[0] * PACK
    G = K if group_size == -1 else group_size
    zeros = unpack_along_n(qzeros) + (0 if v2 else 1)
    perm = _perm_from_g_idx(g_idx, K, G)
    if perm is not None:
        qweight = pack_int4(unpack_int4(qweight).index_select(0, perm))
    dtype = dtype or scales.dtype
    return PackedW4(qweight.contiguous(), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(), G, perm)


def awq_to_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                  dtype: Optional[torch.dtype] = None) -> PackedW4:
    """One AWQ GEMM layer (qweight int32 [K, N/8], interleaved nibbles) -> :class:`PackedW4`."""
    K = qweight.shape[0]
    G = K if group_size == -1 else group_size
    codes = unpack_along_n(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_along_n(qzeros, AWQ_ORDER)
    dtype = dtype or scales.dtype
    return PackedW4(pack_int4(codes), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(), G)


def packed_to_gptq(packed: PackedW4, v2: bool = False, name: str = "layer") -> dict:
    """:class:`PackedW4` -> GPTQ tensors ``{qweight, qzeros, scales, g_idx}`` (rows in the original K order)."""
    K, G = packed.in_features, packed.group_size
    z = packed.zeros.detach().float().cpu()
    lo, hi = (0, 15) if v2 else (1, 16)
    fmt = "gptq_v2" if v2 else "gptq"
    if not torch.equal(z, z.round()):
        raise ValueError(f"{name}: zeros are not integers; GPTQ checkpoints store integer zero points")
    if z.numel() and (int(z.min()) < lo or int(z.max()) > hi):
        other = "gptq" if v2 else "gptq_v2"
        raise ValueError(f"{name}: format {fmt!r} stores zero points {lo}..{hi}, found {int(z.min())}..{int(z.max())};"
                         f" save with format={other!r}")
    qzeros = pack_along_n(z.to(torch.int64) - (0 if v2 else 1))
    qweight = packed.qweight.detach().cpu()
    natural = torch.arange(K, dtype=torch.int32) // G
    if packed.perm is None:
        g_idx = natural
    else:
        perm = packed.perm.detach().cpu().to(torch.int64)
        codes = unpack_int4(qweight)
        orig = torch.empty_like(codes)
        orig[perm] = codes  # stored row r is input feature perm[r]
        qweight = pack_int4(orig)
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[perm] = natural
    return {"qweight": qweight.contiguous(), "qzeros": qzeros, "scales": packed.scales.detach().cpu().contiguous(),
            "g_idx": g_idx}


@dataclass
class QuantSpec:
    """The quantization settings of a checkpoint: ``fmt`` (``"gptq"``, ``"gptq_v2"`` or ``"awq_gemm"``) and
    ``group_size`` (``-1``: per output channel)."""

    fmt: str
    group_size: int


def read_quant_config(path: str) -> QuantSpec:
    """Read and validate the quantization settings of the checkpoint directory ``path``."""
    qc, source = None, None
    cfg_file = os.path.join(path, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cfg = json.load(f)
        if isinstance(cfg.get("quantization_config"), dict):
            qc, source = cfg["quantization_config"], cfg_file
    for name in ("quantize_config.json", "quant_config.json"):
        p = os.path.join(path, name)
        if qc is None and os.path.isfile(p):
            with open(p) as f:
                qc, source = json.load(f), p
    if qc is None:
        raise ValueError(f"{path}: no quantization settings found (config.json 'quantization_config', "
                         f"quantize_config.json or quant_config.json)")
    method = str(qc.get("quant_method", "")).lower()
    if not method:  # AutoGPTQ's / AutoAWQ's older files carry no quant_method
        if "w_bit" in qc or "zero_point" in qc:
            method = "awq"
        elif any(k in qc for k in ("desc_act", "damp_percent", "static_groups", "true_sequential")):
            method = "gptq"
        else:
            raise ValueError(f"{source}: cannot tell the quantization method (no 'quant_method')")
    if method not in ("gptq", "awq"):
        raise ValueError(f"{source}: unknown quant_method {method!r}; supported: 'gptq', 'awq'")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{source}: bits = {bits!r}; only 4-bit checkpoints are supported")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"{source}: group_size = {group_size!r}; expected a positive int or -1")
    if qc.get("dynamic"):
        raise ValueError(f"{source}: per-module 'dynamic' quantization overrides are not supported")
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if qc.get("is_marlin_format"):
            fmt = "marlin"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{source}: unknown GPTQ checkpoint_format {fmt!r}; supported: 'gptq', 'gptq_v2'")
        pack_dtype = str(qc.get("pack_dtype", "int32")).replace("torch.", "")
        if pack_dtype != "int32":
            raise ValueError(f"{source}: pack_dtype {pack_dtype!r}; only int32 packing is supported")
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{source}: AWQ version {version!r} is not supported; only 'gemm'")
        if qc.get("zero_point", True) is False:
            raise ValueError(f"{source}: AWQ without zero points (zero_point: false) is not supported")
        fmt = "awq_gemm"
    return QuantSpec(fmt, group_size)


def _checkpoint_dir_and_files(path: str) -> tuple[str, list[str]]:
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return os.path.dirname(path) or ".", [path]
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a directory or a .safetensors file")
    indexes = sorted(glob.glob(os.path.join(path, "*.safetensors.index.json")))
    if len(indexes) > 1:
        raise ValueError(f"{path}: several safetensors index files: {[os.path.basename(i) for i in indexes]}")
    if indexes:
        with open(indexes[0]) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{indexes[0]}: no 'weight_map'")
        files = [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{indexes[0]}: shard(s) missing from {path}: {missing}")
        return path, files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no .safetensors files")
    return path, files


def _read_headers(files: list[str]) -> dict:
    """name -> (file, shape, dtype) for every tensor, without reading data."""
    from safetensors import safe_open

    out = {}
    for fn in files:
        try:
            with safe_open(fn, framework="pt") as f:
                for k in f.keys():
                    if k in out:
                        raise ValueError(f"tensor {k!r} appears in both {out[k][0]} and {fn}")
                    s = f.get_slice(k)
                    out[k] = (fn, tuple(s.get_shape()), _ST_DTYPES.get(s.get_dtype(), s.get_dtype()))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise ValueError(f"{fn}: not a readable .safetensors file (truncated or corrupt?): {e}") from None
    return out


def _read_tensors(headers: dict, names) -> dict:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(headers[n][0], []).append(n)
    out = {}
    for fn, ns in by_file.items():
        try:
            with safe_open(fn, framework="pt", device="cpu") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise ValueError(f"{fn}: cannot read its tensors (truncated or corrupt?): {e}") from None
    return out


def _expected_shapes(fmt: str, K: int, N: int, G: int) -> dict:
    ng = K // G
    if fmt == "awq_gemm":
        return {"qweight": (K, N // PACK), "qzeros": (ng, N // PACK), "scales": (ng, N)}
    return {"qweight": (K // PACK, N), "qzeros": (ng, N // PACK), "scales": (ng, N), "g_idx": (K,)}


def load_quantized(model: nn.Module, path: str, *, dtype: Optional[torch.dtype] = None,
                   strict: bool = True) -> nn.Module:
    """Load a GPTQ (v1/v2) or AWQ (GEMM) 4-bit safetensors checkpoint into ``model`` (in place); return ``model``.

    Args:
        model: the float model (or one already holding :class:`QuantLinear` modules of the same shapes).
        path: checkpoint directory (safetensors [+ index] and its config), or one ``.safetensors`` file.
        dtype: dtype of the quantized layers' scales / zeros / bias (default: the replaced linear's when fp16/bf16,
            else the file's).
        strict: reject model tensors missing from the file and file tensors the model does not have.

    Every linear ``name`` with ``name.qweight`` in the file becomes a :class:`QuantLinear`.
    """
    ckpt_dir, files = _checkpoint_dir_and_files(path)
    spec = read_quant_config(ckpt_dir)
    headers = _read_headers(files)
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")

    modules = dict(model.named_modules())
    prefixes = sorted(k[: -len(".qweight")] for k in headers if k.endswith(".qweight"))
    if not prefixes:
        raise ValueError(f"{path}: no '<name>.qweight' tensors: not a quantized checkpoint")
    required, optional = ("qweight", "qzeros", "scales"), () if spec.fmt == "awq_gemm" else ("g_idx",)
    problems: list[str] = []
    layer_plans = {}
    consumed = set()
    for p in prefixes:
        mod = modules.get(p)
        if not isinstance(mod, (nn.Linear, QuantLinear)):
            problems.append(f"{p}.qweight: the model has no nn.Linear named {p!r}"
                            + (f" (found {type(mod).__name__})" if mod is not None else ""))
            continue
        K, N = mod.in_features, mod.out_features
        G = K if spec.group_size == -1 else spec.group_size
        if K % PACK or N % PACK:
            problems.append(f"{p}: in/out features ({K}, {N}) must be multiples of 8 for 4-bit packing")
            continue
        if K % G:
            problems.append(f"{p}: group size {G} does not divide in_features {K}")
            continue
        want = dict(_expected_shapes(spec.fmt, K, N, G), bias=(N,))
        needed = required + (("bias",) if mod.bias is not None else ())
        names = {s: f"{p}.{s}" for s in required + optional + needed[len(required):]}
        problems += [f"missing key {names[s]!r}" for s in needed if names[s] not in headers]
        for s, key in names.items():
            if key not in headers:
                continue
            consumed.add(key)
            _, shape, dt = headers[key]
            if shape != want[s]:
                problems.append(f"{key}: shape {list(shape)} disagrees with the model's {type(mod).__name__}"
                                f"(in={K}, out={N}), group {G}: expected {list(want[s])}")
            elif s in ("qweight", "qzeros") and dt != torch.int32:
                problems.append(f"{key}: dtype {dt}, expected int32")
            elif s == "g_idx" and dt not in (torch.int32, torch.int64):
                problems.append(f"{key}: dtype {dt}, expected int32")
            elif s in ("scales", "bias") and dt not in _FLOAT_DTYPES:
                problems.append(f"{key}: dtype {dt}, expected float16/bfloat16/float32")
        wdt = mod.weight.dtype if isinstance(mod, nn.Linear) else None
        dev = (mod.weight if isinstance(mod, nn.Linear) else mod.qweight).device
        layer_plans[p] = (names, G, dtype or (wdt if wdt in (torch.float16, torch.bfloat16) else None), dev)

    # Float tensors: everything in the model's state dict outside the quantized layers.
    state = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for k, t in state.items():
        aliases.setdefault(id(t), []).append(k)
    float_keys = {k: t for k, t in state.items() if k.rpartition(".")[0] not in prefixes}
    for k in headers:
        if k in consumed:
            continue
        if k in float_keys:
            _, shape, dt = headers[k]
            if tuple(float_keys[k].shape) != shape:
                problems.append(f"{k}: shape {list(shape)} disagrees with the model's {list(float_keys[k].shape)}")
            elif float_keys[k].is_floating_point() != (dt in _FLOAT_DTYPES or (isinstance(dt, torch.dtype)
                                                                                  and dt.is_floating_point)):
                problems.append(f"{k}: dtype {dt} in the file, but the model's tensor is {float_keys[k].dtype} "
                                "(a float/integer mismatch is not cast)")
        elif strict:
            problems.append(f"unexpected key {k!r} (not in the model)")
    if strict:
        for k, t in float_keys.items():
            if k not in headers and not any(a in headers for a in aliases[id(t)]):
                problems.append(f"missing key {k!r}")
    if problems:
        raise ValueError(f"cannot load {path} ({spec.fmt}, group {spec.group_size}): " + "; ".join(problems[:20])
                         + (f"; ... ({len(problems) - 20} more)" if len(problems) > 20 else ""))

    # Convert every quantized layer (may still raise: g_idx contents) before touching the model.
    new_modules = {}
    for p, (names, G, layer_dtype, dev) in layer_plans.items():
        t = _read_tensors(headers, [n for n in names.values() if n in headers])
        get = lambda s: t.get(names.get(s))  # noqa: E731
        try:
            if spec.fmt == "awq_gemm":
                packed = awq_to_packed(get("qweight"), get("qzeros"), get("scales"), G, layer_dtype)
            else:
                packed = gptq_to_packed(get("qweight"), get("qzeros"), get("scales"), get("g_idx"), G,
                                        v2=spec.fmt == "gptq_v2", dtype=layer_dtype)
        except ValueError as e:
            raise ValueError(f"cannot load {path}: layer {p}: {e}") from None
        for s_ in ("scales", "bias"):
            v = get(s_)
            if v is not None and not bool(torch.isfinite(v).all()):
                raise ValueError(f"cannot load {path}: {names[s_]} holds {int((~torch.isfinite(v)).sum())} NaN/inf "
                                 f"value(s) (in {headers[names[s_]][0]})")
        packed = PackedW4(packed.qweight.to(dev), packed.scales.to(dev), packed.zeros.to(dev), packed.group_size,
                          None if packed.perm is None else packed.perm.to(dev))
        new_modules[p] = QuantLinear.from_packed(packed, get("bias"))
    float_data = _read_tensors(headers, [k for k in headers if k in float_keys])

    # Apply: nothing below can fail on the checkpoint's content.
    for p, m in new_modules.items():
        _set_submodule(model, p, m)
    share_sibling_storage(model)
    with torch.no_grad():
        for k, v in float_data.items():
            float_keys[k].copy_(v)
    log.info("load_quantized: %s (%s, group %s): %d quantized linear(s), %d float tensor(s)", path, spec.fmt,
             spec.group_size, len(new_modules), len(float_data))
    return model


def save_quantized(model: nn.Module, path: str, *, format: str = "gptq") -> None:
    """Save a model holding :class:`QuantLinear` modules as a GPTQ safetensors checkpoint in directory ``path``.

    Args:
        model: the model (its other parameters and buffers are saved as they are; tied tensors once).
        path: output directory (created; it must not already hold other ``.safetensors`` files).
        format: ``"gptq"`` (v1, AutoGPTQ: zeros stored minus one) or ``"gptq_v2"`` (GPTQModel).

    Writes ``model.safetensors``, ``config.json`` (with ``quantization_config``) and ``quantize_config.json``.
    """
    from safetensors.torch import save_file

    fmt = {"gptq": "gptq", "gptq_v1": "gptq", "gptq_v2": "gptq_v2"}.get(str(format).lower())
    if fmt is None:
        raise ValueError(f"unknown format {format!r}; supported: 'gptq' (v1), 'gptq_v2'")
    qlinears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not qlinears:
        raise ValueError("save_quantized: the model has no QuantLinear module")
    per_channel = all(m.group_size == m.in_features for m in qlinears.values())
    sizes = {m.group_size for m in qlinears.values()}
    if not per_channel and len(sizes) != 1:
        raise ValueError(f"save_quantized: GPTQ checkpoints have one group size, found "
                         f"{ {n: m.group_size for n, m in qlinears.items()} }")
    group_size = -1 if per_channel and (len(sizes) != 1 or next(iter(sizes)) not in (32, 64, 128)) else sizes.pop()

    tensors: dict[str, torch.Tensor] = {}
    sym = True
    for n, m in qlinears.items():
        tensors.update({f"{n}.{k}": v for k, v in packed_to_gptq(m.packed(), v2=fmt == "gptq_v2", name=n).items()})
        if m.bias is not None:
            tensors[f"{n}.bias"] = m.bias.detach().cpu().contiguous()
        sym = sym and bool((m.zeros == 8).all())
    seen = {}
    for k, t in model.state_dict().items():
        if k.rpartition(".")[0] in qlinears:
            continue
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                 t.dtype)
        if ident in seen:  # tied weights: saved once (the loader accepts the alias)
            log.debug("save_quantized: %s is tied to %s, saved once", k, seen[ident])
            continue
        seen[ident] = k
        tensors[k] = t.detach().cpu().contiguous()

    os.makedirs(path, exist_ok=True)
    others = [f for f in glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(
        os.path.join(path, "*.safetensors.index.json")) if os.path.basename(f) != "model.safetensors"]
    if others:
        raise ValueError(f"save_quantized: {path} already holds other checkpoint files "
                         f"{[os.path.basename(f) for f in others]}")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
          "desc_act": any(m.perm is not None for m in qlinears.values()), "sym": sym,
          "checkpoint_format": fmt, "pack_dtype": "int32"}
    hf_config = getattr(model, "config", None)
    cfg = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}, quantization_config=qc)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, default=str)
    with open(os.path.join(path, "quantize_config.json"), "w") as f:
        json.dump(qc, f, indent=2)
    log.info("save_quantized: %s (%s, group %s): %d quantized linear(s)", path, fmt, group_size, len(qlinears))
