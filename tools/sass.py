"""Offline sm_90 SASS checks for Gluon kernels built without a GPU (``triton.compile`` for ``GPUTarget("cuda", 90,
32)`` with the ptxas / cuobjdump shipped with Triton): ``sass_of`` dumps a compiled kernel's SASS,
``wgmma_sass_hazards`` lists instructions that touch registers an in-flight async wgmma still reads or writes.
Not imported by fxopt; tests of the attention kernels use it.
"""
from __future__ import annotations


def sass_of(compiled) -> str:
    """SASS text (``cuobjdump -sass``, the copy shipped with Triton) of a ``compile_offline`` result."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def wgmma_sass_hazards(sass: str) -> list[tuple[str, str, str]]:
    """CPU-side check of async-wgmma register ordering in sm_90 SASS: (address, instruction, kind) for every
    instruction that touches an in-flight HGMMA group's accumulator registers ("acc") or overwrites its register A
    operand ("A"). Model: a group is the HGMMAs up to one carrying ``gsb0``; ``WARPGROUP.DEPBAR.LE gsb0, n``
    retires all but the n most recent groups. The code is walked in address order (fall-through: a DEPBAR skipped
    by a forward predicated branch counts as executed, right for the DRAIN_IN_LOOP wait, whose skip branch tests
    the back edge's condition, i != n_iter - 1), and each innermost loop (backward branch over HGMMAs) again, from
    the groups in flight at its back edge, with such conditional DEPBARs counted as NOT executed (the iterations
    that loop back); a conditional region without a branch inside is there checked as executed from its start
    (its DEPBARs retire groups for the instructions after them in the region) and then skipped. Not modelled:
    other control flow, shared-memory (ring) ordering."""
    import re

    # HGMMA (16-bit) and QGMMA (8-bit): both have 4 A-operand registers per thread and N / 2 accumulators
    hg = re.compile(r"[HQ]GMMA\.(\d+)x(\d+)x(\d+)\.F32(?:\.\w+)* R(\d+), (?:R(\d+)|gdesc)")
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", sass)]

    def regs(text):
        return [int(r) for r in re.findall(r"\bR(\d+)\b", text)]

    index = {a: i for i, (a, _) in enumerate(ins)}

    def local(lo, hi):  # no HGMMA or EXIT in ins[lo:hi] (not a partition dispatch, not an out-of-line retry stub)
        return not any(("GMMA" in x or "EXIT" in x) for _, x in ins[lo:hi])

    conditional = set()  # instructions a short forward predicated branch may skip
    region = {}  # straight-line such regions (no branch inside): instruction -> first instruction of its region
    for i, (addr, op) in enumerate(ins):
        m = re.match(r"@!?U?P\d+ BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) > addr and int(m.group(1), 16) in index:
            end = index[int(m.group(1), 16)]
            if local(i + 1, end):
                conditional.update(range(i + 1, end))
                if not any("BRA" in x for _, x in ins[i + 1:end]):
                    region.update((k, i + 1) for k in range(i + 1, end) if k not in region)

    def walk(lo, hi, pending, out, skip_conditional=False):
        acc_now, a_now = set(), set()
        for k in range(lo, hi):
            addr, op = ins[k]
            if skip_conditional and k in region:
                # a straight-line region the looping iterations skip (e.g. the last tile's drain + fold of the
                # small-M consumer): checked as executed from its start, its DEPBARs included, on a copy of the
                # state; the state after it is the skipped path's (regions hold no HGMMA)
                if region[k] == k:
                    r_pending = list(pending)
                r_pending = walk(k, k + 1, r_pending, out)
                continue
            m = hg.search(op)
            if m:
                base = int(m.group(4))
                acc_now |= set(range(base, base + int(m.group(2)) // 2))
                if m.group(5):
                    a_now |= set(range(int(m.group(5)), int(m.group(5)) + 4))
                if "gsb0" in op:
                    pending, acc_now, a_now = pending + [(acc_now, a_now)], set(), set()
                continue
            m = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", op)
            if m and skip_conditional and k in conditional:
                continue
            if m:
                keep = int(m.group(1))
                pending = pending[len(pending) - keep:] if keep else []
                continue
            if not pending:
                continue
            body = op.split(None, 1)[1] if op.startswith("@") else op
            rs = regs(body)
            stores = body.startswith(("ST", "SYNCS", "RED", "BAR", "BRA", "WARPGROUP"))
            dst = set() if stores or not rs else {rs[0]}
            if dst and re.match(r"\S*\.64\b", body):
                dst.add(rs[0] + 1)
            if dst and re.match(r"\S*\.128\b", body):
                dst |= {rs[0] + 1, rs[0] + 2, rs[0] + 3}
            acc = set().union(*(p[0] for p in pending))
            a_ops = set().union(*(p[1] for p in pending))
            if set(rs) & acc:
                out.append((hex(addr), op, "acc"))
            elif dst & a_ops:
                out.append((hex(addr), op, "A"))
        return pending

    out: list = []
    walk(0, len(ins), [], out)
    loops = []  # (first, back edge) of backward branches over HGMMAs, without EXIT (not a retry stub)
    for i, (addr, op) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            t = index[int(m.group(1), 16)]
            if not local(t, i + 1) and not any("EXIT" in x for _, x in ins[t:i + 1]):
                loops.append((t, i))
    for t, i in loops:  # innermost only (the warp-specialize dispatch loop encloses whole partitions)
        if not any(t <= t2 and i2 < i for t2, i2 in loops if (t2, i2) != (t, i)):
            walk(t, i + 1, walk(t, i + 1, [], [], True), out, True)
    seen, uniq = set(), []
    for h in out:
        if h[0] not in seen:
            seen.add(h[0])
            uniq.append(h)
    return uniq
