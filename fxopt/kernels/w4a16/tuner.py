"""The W4A16 tuner: per (M bucket, K, N, group, dtype) it times a short candidate list once and keeps the pick.

Candidates (``candidate_configs``, first = the untuned default): the bucket's Triton tiles, "dequant_matmul" above
M = 256, then Gluon / "gemv1" / "mma" where they apply and their ``Routes`` switch is on. Picks live in the process,
in ``FXOPT_W4A16_TUNE_CACHE`` and in the shipped ``picks_h200.json``. ``docs/kernels.md`` ("tuner.py").
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict
from typing import Optional

import torch
import triton

from fxopt import env
from fxopt.kernels import cdiv, outside_graph_pools
from fxopt.kernels.w4a16 import routing
from fxopt.kernels.w4a16.common import (INTERPRET, NUM_SMS_DEFAULT, W4A16Config, config_from_dict, fit_block_k,
                                        integer_zeros, m_bucket, num_sms, split_for)
from fxopt.kernels.w4a16.dequant import launch_dequant_matmul
from fxopt.kernels.w4a16.gemv1 import gemv1_configs, launch_gemv1
from fxopt.kernels.w4a16.triton_tiles import launch_swap

log = logging.getLogger(__name__)

# The Triton tiles per M bucket, from H200 sweeps: (method, block_m, block_n, waves, warps, stages); waves = programs
# per SM that the K split aims at (0: no split). "swapx" wins up to M = 32, "swapd" from M = 64 to 256.
_SWAP16 = (("swapx", 16, 64, 4, 4, 3), ("swapx", 16, 64, 5, 4, 3), ("swapx", 16, 128, 2, 4, 3),
           ("swapx", 16, 128, 3, 4, 3), ("swapx", 16, 128, 8, 4, 3), ("swapx", 16, 64, 8, 4, 3),
           ("swapx", 16, 128, 4, 4, 4))
TRITON_TILES = {
    1: _SWAP16, 2: _SWAP16, 4: _SWAP16, 8: _SWAP16,
    16: _SWAP16 + (("swapd", 16, 64, 2, 4, 3),),  # within 2% of swapx at M = 16 on both shapes swept
    32: (("swapx", 32, 128, 2, 4, 3), ("swapx", 32, 128, 1, 4, 3), ("swapx", 32, 64, 2, 4, 3),
         ("swapx", 32, 128, 4, 4, 4), ("swapx", 32, 64, 3, 4, 3), ("swapd", 32, 64, 4, 4, 3),
         ("swapd", 32, 64, 2, 4, 3)),
    64: (("swapd", 64, 64, 4, 4, 3), ("swapd", 64, 64, 2, 4, 3), ("swapd", 64, 128, 2, 4, 3),
         ("swapd", 64, 128, 1, 4, 3), ("swapd", 64, 128, 1, 8, 3), ("swapx", 64, 64, 2, 4, 4),
         ("swapx", 32, 128, 1, 4, 3), ("swapx", 32, 128, 2, 4, 3), "dequant_matmul"),
    128: (("swapd", 128, 64, 2, 4, 3), ("swapd", 128, 128, 1, 4, 3), ("swapd", 128, 64, 1, 4, 3),
          ("swapd", 64, 128, 2, 4, 3), ("swapd", 128, 128, 1, 8, 3), ("swapd", 128, 128, 2, 8, 3),
          ("swapd", 128, 256, 1, 8, 3), ("swapd", 128, 128, 1, 8, 4), ("swapx", 128, 64, 2, 4, 3),
          ("swapx", 128, 64, 1, 4, 3), "dequant_matmul"),
    256: (("swapd", 128, 64, 1, 4, 3), ("swapd", 128, 128, 1, 4, 3), ("swapd", 128, 128, 2, 4, 3),
          ("swapd", 128, 128, 1, 8, 3), ("swapd", 128, 256, 1, 8, 3), ("swapd", 256, 128, 1, 8, 3),
          ("swapd", 128, 128, 1, 8, 4), "dequant_matmul", ("swapx", 128, 64, 1, 4, 3)),
    # compute-bound: cuBLAS on a dequantized copy won every shape measured; swapx is the fused fallback for
    # fractional zeros (swapd is exact only for integer ones)
    4096: ("dequant_matmul", ("swapd", 128, 256, 0, 8, 3), ("swapd", 256, 128, 0, 8, 3),
           ("swapd", 128, 128, 0, 8, 3), ("swapx", 128, 128, 0, 8, 3)),
}


def _triton_configs(M, N, K, group_size, sms, integer_zeros_: bool, dequant: str) -> list[W4A16Config]:
    bucket = m_bucket(M)
    rows = TRITON_TILES[min((b for b in TRITON_TILES if b >= bucket), default=4096)]
    out: list[W4A16Config] = []
    for row in rows:
        if row == "dequant_matmul":
            # fused kernels only unless asked: below M = 256 no call writes a 16-bit copy of a weight
            if dequant == "on" or (dequant == "auto" and bucket > 256):
                out.append(W4A16Config(method="dequant_matmul"))
            continue
        method, bm, bn, waves, warps, stages = row
        if method == "swapd" and not integer_zeros_:
            continue
        if bucket > 256 and method == "swapx" and integer_zeros_:
            continue  # the fallback row: with integer zeros the swapd tiles are listed
        bk = fit_block_k(128, K, group_size)
        if bk < 16 or (method == "swapd" and bk % 32):
            continue
        n_mn = cdiv(M, bm) * cdiv(N, bn)
        split = split_for(n_mn, K // bk, int(waves * sms)) if waves else 1
        # the main kernel launches with programmatic dependent launch: 0.5-1.5 us less per call at M <= 16
        cfg = W4A16Config(bm, bn, bk, split, warps, stages, method, pdl=True)
        if cfg not in out:
            out.append(cfg)
    if not out:  # no fused config fits (K not a multiple of 16 for any tile): a correct last resort
        log.warning("w4a16: no fused config fits K=%d N=%d group %d; dequantizing to a 16-bit weight", K, N,
                    group_size)
        out.append(W4A16Config(method="dequant_matmul"))
    return out


def _gluon_configs(M, N, K, group_size, integer_zeros_, dtype, capability) -> list[W4A16Config]:
    """The Gluon kernel's candidates where it runs: sm_90 (wgmma, setmaxnreg), bf16 (fp16 was never timed on a
    GPU), integer zeros (its exact bf16x2 dequantization), group 128, K and N multiples of 128."""
    if (capability != (9, 0) or dtype != torch.bfloat16 or not integer_zeros_ or group_size != 128 or K % 128
            or N % 128):
        return []
    try:
        from fxopt.kernels.w4a16 import gluon
    except Exception as e:  # noqa: BLE001 - CPU use must not break
        log.debug("w4a16: Gluon kernel unavailable (%s)", e)
        return []
    return gluon.gluon_candidates(m_bucket(M), K, N) if gluon.HAS_GLUON else []


def _mma_configs(M, N, K, group_size, sms, capability) -> list[W4A16Config]:
    if m_bucket(M) > 16 or capability < (8, 0):
        return []
    try:
        from fxopt.kernels.w4a16 import mma
    except Exception as e:  # noqa: BLE001
        log.debug("w4a16: mma kernel unavailable (%s)", e)
        return []
    return mma.mma_configs(M, N, K, group_size, sms) if mma.HAS_GLUON else []


def candidate_configs(M: int, N: int, K: int, group_size: int, num_sms: int = NUM_SMS_DEFAULT,
                      integer_zeros: bool = True, dtype: Optional[torch.dtype] = None, device=None,
                      capability: Optional[tuple] = None, routes: Optional[routing.Routes] = None
                      ) -> list[W4A16Config]:
    """The configs the tuner times for this shape (first = untuned default); a CUDA ``device`` or a ``capability``
    admits the GPU-only builds (Gluon, gemv1, mma) after the Triton tiles; ``routes`` default to the active ones."""
    r = routes or routing.active()
    out = _triton_configs(M, N, K, group_size, num_sms, integer_zeros, r.dequant_matmul)
    cuda = capability is not None or (device is not None and torch.device(device).type == "cuda")
    if not cuda:
        return out
    if capability is None:
        capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (0, 0)
    if r.gluon:
        out += _gluon_configs(M, N, K, group_size, integer_zeros, dtype, capability)
    if r.gemv1:
        out += gemv1_configs(M, N, K, group_size, num_sms)
    if r.mma:
        out += _mma_configs(M, N, K, group_size, num_sms, capability)
    return out


def interpreter_config(M: int, K: int, group_size: int) -> W4A16Config:
    """The fixed small config of the Triton interpreter (CPU tests)."""
    bk = fit_block_k(32, K, group_size)
    if M <= 16:
        return W4A16Config(block_m=16, block_n=32, block_k=bk, split_k=min(2, K // bk))
    return W4A16Config(block_m=32, block_n=32, block_k=bk, split_k=1)


def launch(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """Run one config on a 2-D x (contiguous rows)."""
    if cfg.method == "dequant_matmul":
        return launch_dequant_matmul(x2d, qweight, scales, zeros, group_size, bias)
    if cfg.method in ("swapx", "swapd"):
        return launch_swap(x2d, qweight, scales, zeros, group_size, bias, cfg)
    if cfg.method == "gemv1":
        return launch_gemv1(x2d, qweight, scales, zeros, group_size, bias, cfg)
    if cfg.method == "mma":
        from fxopt.kernels.w4a16.mma import launch_mma

        return launch_mma(x2d, qweight, scales, zeros, group_size, bias, cfg)
    if cfg.method == "gluon":
        from fxopt.kernels.w4a16.gluon import launch_gluon

        return launch_gluon(x2d, qweight, scales, zeros, group_size, bias, cfg)
    raise ValueError(f"w4a16: unknown method {cfg.method!r}")


_TUNED: dict = {}


def _bench_us(fn, reps: int = 10) -> float:
    # L2 is emptied by reading 256 MB (a zero-fill leaves dirty lines whose write-back the timed call pays); the call
    # is replayed from a CUDA graph (timed eagerly, a two-kernel config would pay the host's launch gap).
    flush = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as e:  # not capturable: eager timing (host gaps included)
        log.debug("w4a16 tuner: graph capture failed (%s), timing eagerly", e)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.max()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
    return times[len(times) // 2]


_STREAMED_MAX_BUCKET = 16  # M buckets timed back to back over weight copies (see _weight_copies)
_STREAMED_CALLS = 24


def _weight_copies(qweight, scales, zeros, budget_bytes: int) -> list:
    """The packed weight and copies that together exceed three times L2 (at most 8, within ``budget_bytes``), for
    timing calls back to back from HBM; [] when one extra copy does not fit (the tuner then flushes L2 instead)."""
    one = qweight.numel() * 4 + (scales.numel() + zeros.numel()) * scales.element_size()
    try:
        l2 = torch.cuda.get_device_properties(qweight.device).L2_cache_size
    except Exception:
        l2 = 50 * 1024 * 1024
    n = min(8, max(2, -(-3 * l2 // one)))
    if (n - 1) * one > budget_bytes:
        return []
    try:
        return [(qweight, scales, zeros)] + [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(n - 1)]
    except torch.OutOfMemoryError:
        return []


def bench_streamed_us(fn_on, copies, reps: int, calls: int = _STREAMED_CALLS) -> float:
    """Per-call time (median of ``reps`` replays) of ``calls`` calls back to back in one CUDA graph, each on the next
    weight copy, as a model's layers run (PDL overlap included). ``benchmarks/common.streamed_us`` is this."""
    for c in copies:
        fn_on(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn_on(copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return sorted(times)[len(times) // 2]


def _agrees_with_default(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config,
                         default: W4A16Config) -> bool:
    """"gemv1" / "mma" (cross-CTA atomics) must match the default candidate's output (2e-2 of max |y| for bf16, 4e-3
    for fp16) before they are timed; otherwise they are dropped with a warning."""
    ref = launch(x2d, qweight, scales, zeros, group_size, bias, default).float()
    y = launch(x2d, qweight, scales, zeros, group_size, bias, cfg).float()
    tol = (2e-2 if x2d.dtype == torch.bfloat16 else 4e-3) * float(ref.abs().max()) + 1e-3
    err = float((y - ref).abs().max())
    if not err <= tol:  # NaN included
        log.warning("w4a16: %s disagrees with %s (max error %.3g > %.3g): not a candidate", cfg.label(),
                    default.label(), err, tol)
        return False
    return True


def _tune_disk_key(device_name: str, key: tuple, cands: list) -> str:
    """The tuner file's key: device model, software versions, shape and a digest of the candidate labels (a pick is
    never reused on another GPU, build or candidate list). ``key``: (device, dtype, M bucket, K, N, G, bias, intz)."""
    import fxopt  # not at module level: fxopt imports this module

    return (f"{device_name}|torch {torch.__version__}|triton {triton.__version__}|fxopt {fxopt.__version__}|"
            + shape_key(*key[1:8], cands))


def shape_key(dtype, bucket: int, K: int, N: int, G: int, has_bias: bool, intz: bool, cands: list) -> str:
    """The version-free part of a tuner key (the shipped picks' key after the device name): shape and digest."""
    # the timing method is part of the digest (small-M buckets back to back, larger ones after an L2 flush)
    timing = "streamed" if bucket <= _STREAMED_MAX_BUCKET else "flushed"
    digest = hashlib.sha1("\n".join([f"timing {timing} rounds 2"] + [c.label() for c in cands]).encode()
                          ).hexdigest()[:12]
    return (f"{str(dtype).replace('torch.', '')} M{bucket} K{K} N{N} G{G} bias{int(has_bias)} intz{int(bool(intz))}|"
            f"cands {digest}")


def _tune_disk_load(path: Optional[str], dkey: str, cands: list) -> Optional[W4A16Config]:
    """The pick stored for ``dkey``, if it is one of ``cands``. Unreadable files are ignored: the tuner then just
    times."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get(dkey)
        cfg = config_from_dict(entry["config"]) if entry else None
    except Exception as e:  # noqa: BLE001 - a stale or hand-edited file must not break a model
        log.debug("w4a16: tuner file %s not used (%s)", path, e)
        return None
    return cfg if cfg in cands else None


def _tune_disk_store(path: Optional[str], dkey: str, cfg: W4A16Config, us: float) -> None:
    """Add one pick to the file (read-merge-replace, so concurrent processes lose at most their own entry)."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        table = {}
        if os.path.exists(path):
            try:
                with open(path) as f:
                    table = json.load(f)
            except Exception:  # noqa: BLE001 - rewrite a corrupt file
                table = {}
        table[dkey] = {"config": asdict(cfg), "label": cfg.label(), "us": round(us, 2)}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("w4a16: tuner file %s not written (%s)", path, e)


_FIRST_ROUND_REPS = 10
_FINAL_ROUND_REPS = 30


def _pick_fastest(cands: list, time_us) -> tuple:
    """(config, us) of the fastest candidate by ``time_us(config, reps)`` (a config that raises is skipped; (first,
    inf) when none ran): every candidate once, then the ones within 8% of the best (at most four) again, longer."""
    def time_all(entries, reps):  # entries (index, config) -> sorted (us, index, config) of those that ran
        timed = []
        for i, c in entries:
            try:
                timed.append((time_us(c, reps), i, c))
            except Exception as e:
                log.debug("w4a16 config %s failed: %s", c, e)
        return sorted(timed, key=lambda e: (e[0], e[1]))

    timed = time_all(enumerate(cands), _FIRST_ROUND_REPS)
    if not timed:
        return (cands[0] if cands else None), float("inf")
    close = [e for e in timed if e[0] <= 1.08 * timed[0][0]][:4]
    final = time_all([(i, c) for _, i, c in close], _FINAL_ROUND_REPS) if len(close) > 1 else []
    t, _, c = (final or close)[0]
    return c, t


def tuned_config(x2d, N: int, zeros, group_size: int, has_bias: bool) -> Optional[W4A16Config]:
    """The pick :func:`choose_config` already made for this shape under the active routes, or None (times nothing)."""
    M, K = x2d.shape
    key = (x2d.device.index, x2d.dtype, m_bucket(M), K, N, group_size, has_bias, integer_zeros(zeros),
           routing.active())
    return _TUNED.get(key)


def choose_config(x2d, qweight, scales, zeros, group_size, bias=None) -> W4A16Config:
    """Tuned config for this shape under the active routes (timed once per key on CUDA, kept in the process and in
    the tuner's file); the default candidate when tuning is impossible."""
    M, K = x2d.shape
    N = qweight.shape[1]
    if INTERPRET or x2d.device.type != "cuda":
        return interpreter_config(M, K, group_size)
    intz = integer_zeros(zeros)
    routes = routing.active()
    key = (x2d.device.index, x2d.dtype, m_bucket(M), K, N, group_size, bias is not None, intz, routes)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    cands = candidate_configs(M, N, K, group_size, num_sms(x2d.device), integer_zeros=intz, dtype=x2d.dtype,
                              device=x2d.device, routes=routes)
    if len(cands) == 1 or env.no_tune():
        return cands[0]
    path = env.w4a16_tune_cache()
    dkey = _tune_disk_key(torch.cuda.get_device_name(x2d.device), key, cands)
    cfg = _tune_disk_load(path, dkey, cands)
    if cfg is not None:  # timed by an earlier process on this GPU model and software (also read under capture)
        log.info("w4a16 M-bucket %d K=%d N=%d G=%d -> %s (from %s)", key[2], K, N, group_size, cfg, path)
        _TUNED[key] = cfg
        return cfg
    capturing = torch.cuda.is_current_stream_capturing()

    def agrees(c):  # "gemv1" / "mma": must match the default candidate's output before being timed
        try:
            return _agrees_with_default(x2d, qweight, scales, zeros, group_size, bias, c, cands[0])
        except Exception as e:  # a config that fails to compile is not a candidate
            log.debug("w4a16 config %s failed: %s", c, e)
            return False

    skey = _shipped_key(dkey)
    cfg = _tune_disk_load(SHIPPED_PICKS, skey, cands)
    if cfg is not None and (cfg.method not in ("gemv1", "mma") or (not capturing and agrees(cfg))):
        log.info("w4a16 M-bucket %d K=%d N=%d G=%d -> %s (shipped pick)", key[2], K, N, group_size, cfg)
        _TUNED[key] = cfg
        return cfg
    if capturing:  # no timing inside a CUDA-graph capture: the default candidate
        return cands[0]

    def tune():
        streamed = key[2] <= _STREAMED_MAX_BUCKET
        copies = _weight_copies(qweight, scales, zeros, 512 * 1024 * 1024) if streamed else []

        def time_us(c, reps):
            if copies:  # small M: calls back to back over weight copies (PDL overlap counted, weights from HBM)
                t = bench_streamed_us(lambda w: launch(x2d, *w, group_size, bias, c), copies, reps)
            else:
                t = _bench_us(lambda: launch(x2d, qweight, scales, zeros, group_size, bias, c), reps=reps)
            log.debug("w4a16 M=%d K=%d N=%d %s: %.1f us (%d reps)", M, K, N, c, t, reps)
            return t

        return _pick_fastest([c for c in cands if c.method not in ("gemv1", "mma") or agrees(c)], time_us)

    # Timed in a thread of its own: during a CUDA-graph-tree warm-up the caller's allocations go to the graph's pool,
    # which must not receive the weight copies, timing graphs and workspaces of the tuner.
    best, best_t = outside_graph_pools(tune)
    if best_t == float("inf"):
        best = cands[0]
    log.info("w4a16 tuned M-bucket %d K=%d N=%d G=%d -> %s (%.1f us)", key[2], K, N, group_size, best, best_t)
    _TUNED[key] = best
    if best_t < float("inf"):
        _tune_disk_store(path, dkey, best, best_t)
        _TIMED_HERE[skey] = (best, best_t)
    return best


# Picks timed on the benchmark GPU, keyed like the tuner's file without software versions (gemv1 / mma picks are
# still checked against the default build). Written by ``export_picks`` (``benchmarks/generate.py``).
SHIPPED_PICKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "picks_h200.json")
_TIMED_HERE: dict = {}  # shipped key -> (config, us) for every shape this process timed


def _shipped_key(dkey: str) -> str:
    """The tuner file's key without its torch / triton / fxopt version fields."""
    parts = dkey.split("|")
    return "|".join([parts[0]] + [p for p in parts[1:] if not p.startswith(("torch ", "triton ", "fxopt "))])


def export_picks(path: str = SHIPPED_PICKS) -> int:
    """Merge every pick this process timed into ``path`` (default: the package's shipped table); returns how many."""
    for skey, (cfg, us) in _TIMED_HERE.items():
        _tune_disk_store(path, skey, cfg, us)
    return len(_TIMED_HERE)
