"""The persistent Gluon forward's unmasked key-block loop unrolled by two (``attention_gluon._UNROLL2_DIMS``,
opt-in, ``FXOPT_ATTN_GLUON_UNROLL2=64``), checked on the sm_90 SASS of offline builds (no GPU): the unrolled loop
holds two steps (2 x 66 MUFU.EX2), costs fewer instructions per step than the rolled loop of the build with the
switch off, and spills nothing; persistent3 keeps its rolled loop."""
import json
import os
import subprocess
import sys

import pytest

G = pytest.importorskip("fxopt.kernels.attention_gluon")
if G._GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"Gluon unavailable: {G._GLUON_IMPORT_ERROR}", allow_module_level=True)

_LOOPS = r'''
import json, re, sys
from fxopt.kernels import attention_gluon as G

def step_loops(D, variant, causal):
    c = G.compile_offline(D, causal, "bf16", variant=variant)
    sass = G._tool("nvdisasm", c.asm["cubin"], ".cubin", "-c")
    insts, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(insts)
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*;)", line)
        if m:
            insts.append(m.group(1))
    loops = []
    for j, t in enumerate(insts):  # a loop = a branch back to an earlier label; keep the key-block step loops
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", t)
        if m and m.group(1) in labels and labels[m.group(1)] <= j:
            body = insts[labels[m.group(1)]:j + 1]
            ex2 = sum("MUFU.EX2" in b for b in body)
            if ex2 in (66, 132) and len(body) < 1200:
                loops.append((len(body), ex2))
    return loops, G.sass_summary(c)["spill_bytes"]

print(json.dumps({f"{D} {v} {int(c)}": step_loops(D, v, c) for D, v in ((64, "persistent"), (64, "persistent3"))
                  for c in (True,)}))
'''


def _offline(code: str, **switches: str) -> dict:
    """Run ``code`` (prints one JSON line) in a fresh process with the import-time switches set: the module reads
    them once, at import."""
    env = dict(os.environ, **switches)
    env.pop("TRITON_INTERPRET", None)  # a real sm_90 build (the interpreter would wrap the kernels)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loops(unroll: str) -> dict:
    # both sides with P cast by p.to(dtype): the unrolled build never takes the packed cast (on by default), so
    # the rolled side of the comparison is the build the unroll was measured against
    return _offline(_LOOPS, FXOPT_ATTN_GLUON_UNROLL2=unroll, FXOPT_ATTN_GLUON_CAST_LATE="0")


def test_unrolled_step_loop_is_cheaper_and_spill_free():
    on, off = _loops("64"), _loops("")
    for causal in (1,):
        (rolled, spill_off), (unrolled, spill_on) = off[f"64 persistent {causal}"], on[f"64 persistent {causal}"]
        assert spill_on == spill_off == 0
        per_step_rolled = min(n for n, ex2 in rolled if ex2 == 66)  # the unmasked step (the masked one is longer)
        pairs = [n for n, ex2 in unrolled if ex2 == 132]
        assert pairs and not [n for n, ex2 in rolled if ex2 == 132], (rolled, unrolled)
        assert max(pairs) / 2 < per_step_rolled - 10, (pairs, per_step_rolled)  # 431.5 against 455 offline
        # persistent3 (160 registers) is never unrolled: the same loops either way
        assert on[f"64 persistent3 {causal}"] == off[f"64 persistent3 {causal}"]
        assert not [n for n, ex2 in on[f"64 persistent3 {causal}"][0] if ex2 == 132]


_CAST_LATE = r'''
import json, re
from fxopt.kernels import attention_gluon as G

c = G.compile_offline(64, False, "bf16", variant="persistent3")
sass = G._tool("nvdisasm", c.asm["cubin"], ".cubin", "-c")
print(json.dumps({"prmt": sass.count("PRMT"), "f2fp": sass.count("F2FP"), "spill": G.sass_summary(c)["spill_bytes"],
                  "n": len(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+\S", sass, re.M))}))
'''


def _cast_late_build(flag: str) -> dict:
    return _offline(_CAST_LATE, FXOPT_ATTN_GLUON_CAST_LATE=flag)


def test_persistent_cast_late_drops_the_p_half_swaps():
    """``FXOPT_ATTN_GLUON_CAST_LATE=1`` (on by default, chosen by an A/B on the H200): the persistent builds cast P with
    ``_fa_p16`` (packed cvt, inline PTX), so the per-step PRMT half-swaps of P go (persistent3, d = 64: 452 -> 419
    instructions per unmasked step offline), with no spill and a smaller kernel."""
    on, off = _cast_late_build("1"), _cast_late_build("0")
    assert on["spill"] == off["spill"] == 0
    assert on["prmt"] < off["prmt"] - 64 and on["n"] < off["n"], (on, off)
