"""How fast can the H200 stream a packed int4 weight in the tile pattern of the small-M kernels? (session 17)

The M = 1 mma.sync kernel (``fxopt/kernels/w4a16_mma.py``) reaches 2.5-3.0 TB/s of packed weight while bf16
``F.linear`` streams 4.0-4.4 TB/s. This probe takes the arithmetic away and keeps only the loads: each program reads
a column tile [K/8 slice, BN] of int32 words in steps of 16 word rows (one K tile of 128) and folds them with xor
into one word per column, written out so that nothing is dead code. Two layouts of the same words:

* ``rowmajor``: fxopt's format, [K/8, N]: a K tile of a column tile is 16 segments of 4 BN bytes, N * 4 bytes apart;
* ``panel``: [N / BN, K/8, BN]: the same K tile is one contiguous 64 BN-byte block.

Plus ``flat``: one contiguous read of the whole buffer; ``tma``: a Gluon kernel whose one producer warp streams [16, BN]
word tiles of the row-major layout through a STAGES-deep shared-memory ring by TMA while 4 consumer warps read the
slots (the data path of a TMA-fed small-M kernel); and ``cublas``: bf16 ``F.linear`` at M = 1 on a weight of the
same byte count (K x N / 4 bf16 elements: what the vendor's GEMV streams at this size). Each row: the time per
call of calls on several weight copies (together > 3x L2) replayed in one CUDA graph, and GB/s of words read.

    python benchmarks/w4a16_layout_probe.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _tile_read_kernel(w_ptr, out_ptr, K8, N, ROWS_PER_SPLIT, stride_wr, stride_wp,
                      BN: tl.constexpr, PANEL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, 16)
    cols = tl.arange(0, BN)
    r0 = pid_k * ROWS_PER_SPLIT
    if PANEL:  # [N / BN, K8, BN]: panel pid_n, rows contiguous
        base = w_ptr + pid_n * stride_wp + cols[None, :]
    else:  # [K8, N]
        base = w_ptr + pid_n * BN + cols[None, :]
    acc = tl.zeros((16, BN), dtype=tl.int32)
    for r in range(r0, r0 + ROWS_PER_SPLIT, 16):
        acc ^= tl.load(base + (r + rows)[:, None] * stride_wr)
    folded = tl.reduce(acc, 0, _xor)
    tl.store(out_ptr + pid_k * N + pid_n * BN + cols, folded)


@triton.jit
def _flat_read_kernel(w_ptr, out_ptr, n_words, PER_PROG: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(0, PER_PROG, BLOCK):
        idx = pid * PER_PROG + i + offs
        acc ^= tl.load(w_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


try:  # Gluon (Triton >= 3.5, sm_90): the TMA ring probe
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @gluon.jit
    def _gxor(a, b):
        return a ^ b

    @gluon.jit
    def _tma_producer(desc, ring, ready, empty, r0, n0, n_tiles, STAGES: gl.constexpr):
        for i in range(n_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [r0 + i * 16, n0], ready.index(s), ring.index(s))

    @gluon.jit
    def _tma_consumer(ring, ready, empty, out_ptr, n_tiles, N, n0, pid_k, BN: gl.constexpr, STAGES: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        acc = gl.zeros([16, BN], gl.int32, layout)
        for i in range(n_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc ^= ring.index(s).load(layout)
            mbarrier.arrive(empty.index(s), count=1)
        folded = gl.reduce(acc, 0, _gxor)
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + pid_k * N + n0 + cols, folded)

    @gluon.jit
    def _tma_read_kernel(desc, out_ptr, N, TILES_PER_SPLIT, BN: gl.constexpr, STAGES: gl.constexpr):
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BN], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_tma_consumer, (ring, ready, empty, out_ptr, TILES_PER_SPLIT, N, pid_n * BN, pid_k, BN, STAGES)),
            (_tma_producer, (desc, ring, ready, empty, pid_k * TILES_PER_SPLIT * 16, pid_n * BN, TILES_PER_SPLIT,
                             STAGES)),
        ], [1], [24])

    HAS_GLUON = True
except Exception as e:  # pragma: no cover
    print("no Gluon probe:", e)
    HAS_GLUON = False


def _tma_desc(w: torch.Tensor, BN: int):
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [16, BN], layout)


def _graph_time_us(fns, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(fns))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8192x8192,8192x28672,4096x11008")
    ap.add_argument("--bns", default="64,128,256,512")
    ap.add_argument("--warps", default="4")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    l2 = 60 * 2 ** 20
    rows = []
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        K8 = K // 8
        nbytes = K8 * N * 4
        copies = max(2, -(-3 * l2 // nbytes))
        gen = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randint(-2 ** 31, 2 ** 31 - 1, (K8, N), device=dev, dtype=torch.int32, generator=gen)
              for _ in range(copies)]
        for BN in (int(b) for b in args.bns.split(",")):
            if N % BN:
                continue
            panels = [w.reshape(K8, N // BN, BN).permute(1, 0, 2).contiguous() for w in ws]
            tiles = N // BN
            for warps in (int(v) for v in args.warps.split(",")):
                for waves in (1, 2, 4):
                    split = max(1, min(K8 // 16, round(waves * sms * max(1, 4 * 4 // warps) / tiles)))
                    while (K8 // 16) % split:
                        split -= 1
                    rps = K8 // split
                    out = torch.empty(split, N, device=dev, dtype=torch.int32)
                    for layout, bufs in (("rowmajor", ws), ("panel", panels)):
                        def launch(w, layout=layout):
                            stride_wp = w.stride(0) if layout == "panel" else 0
                            stride_wr = w.stride(1) if layout == "panel" else w.stride(0)
                            _tile_read_kernel[(tiles, split)](w, out, K8, N, rps, stride_wr, stride_wp, BN=BN,
                                                             PANEL=layout == "panel", num_warps=warps)
                        us = _graph_time_us([lambda w=w: launch(w) for w in bufs])
                        rows.append(dict(K=K, N=N, layout=layout, BN=BN, warps=warps, split=split,
                                         grid=tiles * split, us=round(us, 2), GBps=round(nbytes / us / 1e3)))
                        print(rows[-1], flush=True)
        flat_out = torch.empty(sms * 8 * 1024, device=dev, dtype=torch.int32)
        n_words = K8 * N
        for progs in (sms * 4, sms * 8):
            per = -(-n_words // progs)
            per = -(-per // 1024) * 1024
            us = _graph_time_us([lambda w=w: _flat_read_kernel[(progs,)](w, flat_out, n_words, PER_PROG=per,
                                                                          BLOCK=1024, num_warps=4) for w in ws])
            rows.append(dict(K=K, N=N, layout="flat", BN=0, warps=4, split=0, grid=progs, us=round(us, 2),
                             GBps=round(nbytes / us / 1e3)))
            print(rows[-1], flush=True)
        if HAS_GLUON:
            for BN in (128, 256):
                for STAGES in (4, 8):
                    if STAGES * 16 * BN * 4 > 200 * 1024:
                        continue
                    for waves in (1, 2, 4):
                        split = max(1, min(K8 // 16, round(waves * sms * 2 / (N // BN))))
                        while (K8 // 16) % split:
                            split -= 1
                        out = torch.empty(split, N, device=dev, dtype=torch.int32)
                        try:
                            descs = [_tma_desc(w, BN) for w in ws]
                            us = _graph_time_us([lambda d=d: _tma_read_kernel[(N // BN, split)](
                                d, out, N, K8 // 16 // split, BN=BN, STAGES=STAGES, num_warps=4) for d in descs])
                        except Exception as e:  # keep the other rows
                            print("tma probe failed:", repr(e)[:400], flush=True)
                            continue
                        rows.append(dict(K=K, N=N, layout=f"tma s{STAGES}", BN=BN, warps=4, split=split,
                                         grid=N // BN * split, us=round(us, 2), GBps=round(nbytes / us / 1e3)))
                        print(rows[-1], flush=True)
        n_elems = nbytes // 2  # a bf16 weight of the same byte count
        kb = 4096 if n_elems % 4096 == 0 else 2048
        wb = [torch.randn(n_elems // kb, kb, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        xb = torch.randn(1, kb, device=dev, dtype=torch.bfloat16)
        us = _graph_time_us([lambda w=w: torch.nn.functional.linear(xb, w) for w in wb])
        rows.append(dict(K=kb, N=n_elems // kb, layout="cublas bf16 M=1", BN=0, warps=0, split=0, grid=0,
                         us=round(us, 2), GBps=round(nbytes / us / 1e3)))
        print(rows[-1], flush=True)
        del ws, wb
    # correctness of the two tile layouts against each other (same xor per column)
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (256, 1024), device=dev, dtype=torch.int32)
    o1 = torch.empty(1, 1024, device=dev, dtype=torch.int32)
    o2 = torch.empty_like(o1)
    p = w.reshape(256, 8, 128).permute(1, 0, 2).contiguous()
    _tile_read_kernel[(8, 1)](w, o1, 256, 1024, 256, w.stride(0), 0, BN=128, PANEL=False)
    _tile_read_kernel[(8, 1)](p, o2, 256, 1024, 256, p.stride(1), p.stride(0), BN=128, PANEL=True)
    ref = w[0].clone()
    for r in range(1, 256):
        ref ^= w[r]
    assert torch.equal(o1[0], ref) and torch.equal(o2[0], ref), "probe kernels disagree"
    if HAS_GLUON:
        o3 = torch.empty(2, 1024, device=dev, dtype=torch.int32)
        _tma_read_kernel[(8, 2)](_tma_desc(w, 128), o3, 1024, 8, BN=128, STAGES=4, num_warps=4)
        ref2 = w[128].clone()
        for r in range(129, 256):
            ref2 ^= w[r]
        ref1 = w[0].clone()
        for r in range(1, 128):
            ref1 ^= w[r]
        assert torch.equal(o3[0], ref1) and torch.equal(o3[1], ref2), "tma probe disagrees"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "w4a16_layout_probe.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "w4a16_layout_probe.md"), "w") as f:
            f.write("# Packed-weight read rate by layout (benchmarks/w4a16_layout_probe.py)\n\n")
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n\n")
            f.write("| K | N | layout | BN | warps | split | grid | us | GB/s |\n|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['K']} | {r['N']} | {r['layout']} | {r['BN']} | {r['warps']} | {r['split']} | "
                        f"{r['grid']} | {r['us']} | {r['GBps']} |\n")


if __name__ == "__main__":
    main()
