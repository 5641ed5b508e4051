"""Launch one kernel a few times so that Nsight Compute can profile the last launch (H200; no timing here).

``ncu --clock-control none -k regex:NAME --launch-skip 3 --launch-count 1 --section SpeedOfLight ...
python benchmarks/profile_kernels.py WHAT`` with WHAT one of:

* ``w4a16:M:K:N:METHOD:BM:BN:SPLIT:WARPS:STAGES`` — one W4A16 launch config (``fxopt.kernels.w4a16._launch``), bf16,
  group 128, random codes (e.g. ``w4a16:1:8192:8192:swapx:16:64:4:4:3``);
* ``w4gluon:M:K:N:BM:BN:PROBE`` — the Gluon W4A16 kernel (``gluon_w4a16_mm``, regs="async", KC 32, split-K as its
  default; PROBE 0 = the real kernel, 1 / 2 / 3 = its timing probes);
* ``w4fm:M:K:N:SPLIT`` — the fragment-major experiment kernel of ``benchmarks/w4a16_breakdown.py``;
* ``attn:B:H:S:D:CAUSAL`` — the bf16 FlashAttention forward (``flash_attention_triton``), e.g. ``attn:4:16:4096:128:0``;
* ``bwd:B:H:S:D:CAUSAL`` — the bf16 backward (``flash_attention_triton_bwd``: the Gluon one where it is routed);
* ``decode:B:H:S:D[:persistent]`` — one query token against S keys (the split-KV kernel and its combine; with
  ``persistent`` the opt-in stream-K kernel of ``attention_decode.py``);
* ``fp8:B:H:S:D:CAUSAL`` — ``fp8_gluon_attention`` (quantization launches and the Gluon fp8 forward).

A ``w4a16`` spec with METHOD ``gemv1`` launches the one-launch M <= 4 kernel (BM = M; STAGES is ignored).

``bash benchmarks/profile_kernels.sh`` runs the set used in docs/notes_w4a16.md and writes ncu's text to $OUT.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for fxopt

import torch  # noqa: E402

from fxopt.kernels import w4a16 as K4  # noqa: E402


def _w4_inputs(M: int, K: int, N: int):
    """Random bf16 activations and packed group-128 weights (integer zero points) on the GPU."""
    q = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.005).bfloat16()
    z = torch.randint(4, 12, (K // 128, N), device="cuda").bfloat16()
    return torch.randn(M, K, device="cuda", dtype=torch.bfloat16), q, s, z


def main(what: str):
    kind, *a = what.split(":")
    torch.manual_seed(0)
    if kind == "w4a16":
        M, K, N = int(a[0]), int(a[1]), int(a[2])
        method, bm, bn, split, warps, stages = a[3], int(a[4]), int(a[5]), int(a[6]), int(a[7]), int(a[8])
        x, q, s, z = _w4_inputs(M, K, N)
        bk = 256 if method == "gemv2" else 128
        cfg = K4.W4A16Config(bm, bn, bk, split, True, 8, warps, stages, method)
        if method == "gemv1":
            cfg = K4.W4A16Config(block_m=M, block_n=bn, block_k=128, split_k=split, num_warps=warps, num_stages=1,
                                 method="gemv1")
        for _ in range(4):
            K4._launch(x, q, s, z, 128, None, cfg)
    elif kind == "w4mma":  # session 16: the mma.sync kernel the tuner picks at M = 1-8 (w4a16_mma.py)
        M, K, N, bn, split, warps, pdl = (int(v) for v in a)
        x, q, s, z = _w4_inputs(M, K, N)
        cfg = K4.W4A16Config(block_m=M, block_n=bn, block_k=128, split_k=split, num_warps=warps, num_stages=1,
                             method="mma", pdl=bool(pdl))
        for _ in range(4):
            K4._launch(x, q, s, z, 128, None, cfg)
    elif kind == "w4gluon":  # session 18: the warp-specialized Gluon kernel (w4a16_gluon.py), regs="async", KC 32
        M, K, N, bm, bn, probe = (int(v) for v in a)
        from fxopt.kernels import w4a16_gluon as KG

        x, q, s, z = _w4_inputs(M, K, N)
        for _ in range(4):
            KG.gluon_w4a16_mm(x, q, s, z, 128, block_m=bm, block_n=bn, stages=KG._max_stages(bm, bn), kc=32,
                              regs="async", probe=probe)
    elif kind == "w4fm":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import w4a16_breakdown as WB

        M, K, N, split = (int(v) for v in a)
        x, q, s, z = _w4_inputs(M, K, N)
        qf = WB.to_fragment_major(q)
        for _ in range(4):
            WB.fm_call(x, qf, s, z, split)
    elif kind == "attn":
        from fxopt.kernels.attention import flash_attention_triton

        B, H, S, D, causal = (int(v) for v in a)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(4):
            flash_attention_triton(q, k, v, is_causal=bool(causal))
    elif kind == "bwd":
        from fxopt.kernels.attention import flash_attention_triton, flash_attention_triton_bwd

        B, H, S, D, causal = (int(v) for v in a)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = flash_attention_triton(q, k, v, is_causal=bool(causal), return_lse=True)
        do = torch.randn_like(out)
        for _ in range(4):
            flash_attention_triton_bwd(do, q, k, v, out, lse, is_causal=bool(causal))
    elif kind == "decode":
        B, H, S, D = (int(v) for v in a[:4])
        if a[4:] == ["persistent"]:
            os.environ["FXOPT_ATTN_DECODE_PERSISTENT"] = "1"  # read at import, below
        from fxopt.kernels.attention import flash_attention_triton

        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(6):
            flash_attention_triton(q, k, v)
    elif kind == "fp8":
        from fxopt.kernels.fp8_attention_gluon import fp8_gluon_attention

        B, H, S, D, causal = (int(v) for v in a)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(4):
            fp8_gluon_attention(q, k, v, is_causal=bool(causal))
    else:
        raise SystemExit(f"unknown WHAT {what!r}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
