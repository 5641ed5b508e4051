"""Offline sm_90 builds of the Gluon attention kernels the routing table picks (no GPU needed).

    python tools/gluon_offline_builds.py [name,...]      # default: every build in BUILDS

Prints, per build, a hash of the cubin's machine code (.text sections only) and its shared memory:
two trees that print the same hash run the same kernel. Not imported by fxopt; run without TRITON_INTERPRET.
"""
import hashlib
import json
import struct
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

BUILDS = ("fwd_default_256", "fwd_persistent_128", "fwd_persistent_64", "fwd_persistent3_64", "bwd_128", "bwd_64",
          "bwd_256", "fp8_128", "fp8_64")


def text_sha(cubin: bytes) -> str:
    """sha256 (16 hex digits) over the .text sections of an ELF64 cubin: machine code only, not line info."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    h = hashlib.sha256()
    for s in secs:
        name = cubin[stro + s[0]: cubin.index(b"\0", stro + s[0])]
        if name.startswith(b".text."):
            h.update(cubin[s[4]: s[4] + s[5]])
    return h.hexdigest()[:16]

def td(dt, gdt, block, lay=None):
    """The signature string of a host TensorDescriptor with this block (default NVMMA layout)."""
    lay = lay or gl.NVMMASharedLayout.get_default_for(block, gdt)
    return f"tensordesc<{dt}[{', '.join(map(str, block))}],{lay!r}>"

def compile_build(name, causal=True):
    """Build ``name`` (one of ``BUILDS``) for sm_90 as the launchers specialize it (i32 ints, bf16)."""
    if name.startswith("fwd"):
        from fxopt.kernels.attention import gluon_fwd as G
        variant, D = name.split("_")[1], int(name.split("_")[2])
        cfg = G.config_for(D, variant)
        bn = cfg["BLOCK_N"]
        sig = {"q_desc": td("bf16", gl.bfloat16, [1, 1, 64, D]), "k_desc": td("bf16", gl.bfloat16, [1, 1, bn, D]),
               "v_desc": td("bf16", gl.bfloat16, [1, 1, bn, D]), "o_desc": td("bf16", gl.bfloat16, [1, 1, 64, D]),
               "lse_ptr": "*fp32", "qk_scale": "fp32", "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32",
               "NUM_M_BLOCKS": "i32"}
        ce = {"HEAD_DIM": D, "BLOCK_N": bn, "STAGES": cfg["STAGES"], "CAUSAL": causal,
              "CONSUMER_REGS": cfg["CONSUMER_REGS"], "PRODUCER_REGS": cfg["PRODUCER_REGS"]}
        if variant == "default":
            kern = G._fa3_fwd_kernel
        else:
            sig["NUM_BH"] = "i32"
            ce.update(SCHED=int(causal), WRITE_LSE=True, NUM_WG=cfg["NUM_WG"])
            kern = G._fa3_fwd_persistent_kernel
        for k in ce:
            sig[k] = "constexpr"
    elif name.startswith("bwd"):
        from fxopt.kernels.attention import gluon_bwd as GB
        D = int(name.split("_")[1])
        vd = td("fp32", gl.float32, [64])
        dqd = f"tensordesc<fp32[8, {D // 16}, 8, 8],{GB._dq_tma_layout()!r}>"
        if D == 256:
            t = lambda r: td("bf16", gl.bfloat16, [1, 1, r, 128])
            sig = {"q_desc": t(32), "k_desc": t(64), "v_desc": t(64), "do_desc": t(32), "dk_desc": t(64),
                   "dv_desc": t(64), "lse_desc": vd, "delta_desc": vd, "dq_desc": dqd, "qk_scale": "fp32",
                   "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "SQ_PAD": "i32"}
            ce = {"STAGES": 2, "CAUSAL": causal, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24}
            kern = GB._fa3_bwd_kernel_d256
        else:
            t = lambda r, lay=None: td("bf16", gl.bfloat16, [1, 1, r, D], lay)
            klay = GB._k_layout(D, gl.bfloat16, 4)
            sig = {"q_desc": t(64), "k_desc": t(64, klay), "v_desc": t(64), "do_desc": t(64), "dk_desc": t(64, klay),
                   "dv_desc": t(64), "lse_desc": vd, "delta_desc": vd, "dq_desc": dqd, "qk_scale": "fp32",
                   "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "SQ_PAD": "i32"}
            ce = {"HEAD_DIM": D, "STAGES": GB._STAGES[D], "CAUSAL": causal, "CONSUMER_REGS": 240,
                  "PRODUCER_REGS": 24, "NB": 2, "REDUCER_WARPS": 1}
            kern = GB._fa3_bwd_kernel
        for k in ce:
            sig[k] = "constexpr"
        cfg = dict(num_warps=4, maxnreg=168)
    else:
        from fxopt.kernels.fp8 import gluon_fwd as F
        D = int(name.split("_")[1])
        bn, st = F._CONFIGS[D]
        sig = {"q_desc": td("fp8e4nv", gl.float8e4nv, [1, 1, 64, D]),
               "k_desc": td("fp8e4nv", gl.float8e4nv, [bn // 16, 2, 4, 2, D]),
               "vt_desc": td("fp8e4nv", gl.float8e4nv, [1, 1, D, bn]), "o_desc": td("bf16", gl.bfloat16, [1, 1, 64, D]),
               "qs_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "lse_ptr": "*fp32", "sm_scale_log2": "fp32",
               "H": "i32", "GROUP": "i32", "H_KV": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "NQB": "i32", "NKB": "i32",
               "NUM_M_BLOCKS": "i32"}
        ce = {"HEAD_DIM": D, "BLOCK_N": bn, "STAGES": st, "CAUSAL": causal, "WRITE_LSE": False, "QB": 128,
              "CONSUMER_REGS": 240, "PRODUCER_REGS": 24}
        for k in ce:
            sig[k] = "constexpr"
        kern = F._fp8_fa3_fwd_kernel
        cfg = dict(num_warps=4, maxnreg=168)
    src = GluonASTSource(kern, signature=sig, constexprs=ce)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"],
                                                                          "maxnreg": cfg["maxnreg"]})


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else BUILDS
    out = {}
    for n in names:
        for causal in (False, True):
            c = compile_build(n, causal)
            out[f"{n}{'_causal' if causal else ''}"] = dict(sha=text_sha(c.asm["cubin"]), shared=c.metadata.shared)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
