"""Gluon attention backward at d = 64 / 128 with FA3's dQ path: dQ through shared memory, global reductions by a
reducer warp.

The op's default backward build at d = 64 / 128 ("variant 6": ``gluon_attention_bwd_dqw(..., tma=True)``, the
reducer warp's reductions done by the TMA unit, one ``cp.reduce.async.bulk.tensor`` per dQ half-tile).
This module holds no Gluon code: the kernel is ``attention_gluon_bwd._fa3_bwd_kernel_v1`` with the constexpr
switches ``DQW`` / ``DQ_TMA``; here are its host wrapper, its configs and its offline step census. Why it pays: in
the previous build the consumers issued their own ``red.global.add`` dQ reductions, which held their issue slots;
moving dQ to a shared-memory tile that one extra warp reduces frees the consumers. The tile order, the barrier
protocol and the measured step counts are in ``docs/kernels.md``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import attention_gluon_bwd as GB
from .attention_gluon_bwd import (  # noqa: F401 - re-exported (the kernel and its helpers live there)
    BLOCK_M, BLOCK_N, DQ_BUFFERS, DQW_VARIANT, LOG2E, REDUCER_WARPS, WG_KEYS, _GLUON_IMPORT_ERROR, _bwd_dq_convert,
    _bwd_dq_reducer, _bwd_preprocess, _bwd_producer, _fa3_bwd_kernel_v1, _red_add_v4, gluon_bwd_supported)

logger = logging.getLogger(__name__)

HEAD_DIM = GB.DQW_HEAD_DIM      # 128: the routed head dim (the default of config_dqw / compile_offline)
HEAD_DIMS = GB.DQW_HEAD_DIMS    # (64, 128): head dims the kernel builds for (d = 64:, GPU-checked)
REDUCER_REGS = GB._PRODUCER_REGS  # 24: setmaxnreg of warpgroup 2 (producer + reducer), as variant 3's producer
SMEM_LIMIT = 232_448    # bytes per CTA on sm_90


def config_dqw(head_dim: int = HEAD_DIM) -> dict:
    """``attention_gluon_bwd.config_for(head_dim, 5)``: variant 3's meta-parameters plus NB / REDUCER_WARPS."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"config_dqw: head dim {head_dim} not supported (only {HEAD_DIMS})")
    return GB.config_for(head_dim, DQW_VARIANT)


def gluon_dqw_supported(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_bwd_dqw`` can run these inputs, else a one-line reason."""
    reason = gluon_bwd_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is None and q.shape[-1] not in HEAD_DIMS:
        reason = f"head dim {q.shape[-1]} not supported by the dQ-through-smem kernel (only {HEAD_DIMS})"
    return reason


def gluon_attention_bwd_dqw(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
                            checked: bool = False, grads_like_inputs: bool = False, tma: bool = False):
    """Variant 3 of ``gluon_attention_bwd`` with FA3's dQ path (dQ -> shared memory -> reducer warp -> vector
    reductions) -> (dq, dk, dv), contiguous, dtypes of q / k / v. d = 64 or 128. Raises ValueError when unsupported
    (``gluon_dqw_supported`` gives the reason). The op's backward at d = 64 / 128 (``_GLUON_BWD_DQW_DIMS``).
    Same launches as ``gluon_attention_bwd(..., variant=5)``, which it calls; ``tma=True``: variant 6, the same
    kernel with the reducer's global reductions done by the TMA unit (``cp.reduce.async.bulk.tensor``)."""
    reason = None if checked else gluon_dqw_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is not None:
        raise ValueError(f"gluon_attention_bwd_dqw: {reason}")
    return GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, scale=scale, checked=True,
                                  variant=GB.DQ_TMA_VARIANT if tma else DQW_VARIANT,
                                  grads_like_inputs=grads_like_inputs)


def compile_offline(causal: bool, dtype_str: str = "bf16", arch: int = 90, head_dim: int = HEAD_DIM):
    """Offline sm_<arch> build of the dQ-through-smem kernel (``_fa3_bwd_kernel_v1`` with DQW; no GPU) -> triton
    CompiledKernel. = ``attention_gluon_bwd.compile_offline(head_dim, causal, dtype_str, arch, variant=5)``."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"compile_offline: head dim {head_dim} not supported (only {HEAD_DIMS})")
    return GB.compile_offline(head_dim, causal, dtype_str, arch, variant=DQW_VARIANT)


# ----------------------------------------------------------------------------------------------------------------
# CPU model of the barrier protocol (no GPU): python -c "import fxopt.kernels.attention_gluon_bwd_dqw as D;
# print(D.check_dqw_protocol())"
# ----------------------------------------------------------------------------------------------------------------

DQW_BUGS = ("reducer_no_wait", "consumer_no_empty_wait", "parity_nb1", "full_count_1", "reducer_early_release",
            "reducer_stops_early")


def dqw_protocol_model(n_steps: int, stages: int = 2, nb: int = 2, seed: int = 0, tma_delay: int = 3,
                       max_ticks: int = 10 ** 6, bug: str = "") -> int:
    """One CTA of variant 5 (``_fa3_bwd_kernel_v1`` with DQW) at the level of barriers and buffer accesses: the
    producer (K / V once, then Q / dO of ``n_steps`` query blocks into ring slot it % stages after the release of the
    slot's previous use), the two consumer warpgroups (``_bwd_step_v1`` with DQW: q_ready / do_ready waits, S^T /
    dP^T / dV / dK reading Q, dO, K_w, V_w; dS^T into ds[p][w], arrive ds_bar[p]; wait(0), Q / dO released; ds_bar
    wait; dQ reading both dS^T tiles and K_0, K_1; then wait dq_empty[b] (parity (u & 1) ^ 1), write dQ tile (b, w),
    arrive dq_full[b]), the end_bar meeting and the dK / dV staging into K_w / V_w, and the reducer (wait dq_full[b]
    with parity u & 1, read both tiles of buffer b over several ticks, reduce, arrive dq_empty[b]).

    mbarriers are modelled with completed-phase counts. The ring, ds_bar and end_bar waits are checked by use
    number (as in ``attention_gluon_bwd.v4_protocol_model``). The dq_full / dq_empty waits are modelled as the
    hardware does them, by PARITY (``try_wait.parity P`` passes once a phase of parity P has completed: completed
    count % 2 == (P + 1) % 2; on a fresh barrier P = 1 passes), and when such a wait passes, the number of completed
    phases must be the one the protocol intends (use + 1): otherwise a phase was skipped or the wait passed early
    (AssertionError). A random scheduler with skewed per-agent speeds runs one runnable agent per tick; TMA loads
    land 0..tma_delay ticks after issue. Raises AssertionError on deadlock, such a parity mismatch, a skipped phase,
    a write into a buffer another agent reads, a reducer read of a dQ tile that does not hold this step's values, a
    tile overwritten while it is reduced, and a lost or
    doubled dQ contribution (every step's two tiles must be reduced exactly once). ``bug``: one of ``DQW_BUGS``."""
    import random

    assert bug in ("",) + DQW_BUGS, bug
    rng = random.Random(seed)
    st = GB.ProtocolState(rng)
    init, arrive, passed, read, unread, write = st.init, st.arrive, st.passed, st.read, st.unread, st.write
    done = st.done
    tile_ver = {}          # (b, w) -> step whose dQ the tile holds
    reduced = []           # (step, w) reduced by the reducer

    def parity_wait_ok(bar, parity, use):
        """hardware parity wait: passes iff the phase with this parity, most recent, has completed, i.e. the
        number of completed phases has parity (parity + 1) & 1 (a fresh barrier: parity 1 passes). The protocol
        intends it to pass exactly when ``use + 1`` phases (for a 'full' wait) have completed: check that."""
        ok = done[bar] % 2 == (parity + 1) % 2
        if ok:
            assert done[bar] == use + 1, (f"parity wait on {bar} passed with {done[bar]} phases completed, "
                                          f"intended use {use} (phase skipped or passed early)")
        return ok

    init("kv", 1)
    init("end", 2)
    for i in range(stages):
        for kind in ("q_ready", "do_ready"):
            init((kind, i), 1)
        for kind in ("q_empty", "do_empty"):
            init((kind, i), 2)
    for i in range(2):
        init(("ds", i), 2)
    for i in range(nb):
        init(("dq_full", i), 1 if bug == "full_count_1" else 2)
        init(("dq_empty", i), 1)

    def consumer(w):
        me = f"wg{w}"
        while not passed("kv", 0):
            yield
        for it in range(n_steps):
            s, u = it % stages, it // stages
            p, du = it % 2, it // 2
            for kind in ("q", "do"):
                while not passed((kind + "_ready", s), u):
                    yield
            for buf in (("q", s), ("do", s), f"K{w}", f"V{w}"):
                read(buf, me)
            yield
            unread(f"K{w}", me)
            unread(f"V{w}", me)
            write(("dst", p, w), me)
            arrive(("ds", p))
            yield
            unread(("q", s), me)
            unread(("do", s), me)
            arrive(("q_empty", s))
            arrive(("do_empty", s))
            while not passed(("ds", p), du):
                yield
            for buf in (("dst", p, 0), ("dst", p, 1), "K0", "K1"):
                read(buf, me)
            yield
            for buf in (("dst", p, 0), ("dst", p, 1), "K0", "K1"):
                unread(buf, me)
            # ---- dQ_w -> smem tile (b, w)
            b, bu = it % nb, it // nb
            if bug != "consumer_no_empty_wait":
                if bug == "parity_nb1":   # the NB = 1 parity formula with NB = 2 buffers
                    par, use = (it & 1) ^ 1, bu - 1
                else:
                    par, use = (bu & 1) ^ 1, bu - 1
                # use -1 (the first use of the buffer) passes at once on a fresh barrier: parity 1
                while not (use < 0 and par == 1 and done[("dq_empty", b)] == 0) and \
                        not (done[("dq_empty", b)] > 0 and parity_wait_ok(("dq_empty", b), par, use)):
                    yield
            write(("dqt", b, w), me)
            tile_ver[(b, w)] = it
            yield
            arrive(("dq_full", b))
            yield
        arrive("end")
        while not passed("end", 0):
            yield
        write(f"K{w}", me)
        write(f"V{w}", me)

    def reducer():
        last = n_steps - 1 if bug == "reducer_stops_early" else n_steps
        for it in range(last):
            b, bu = it % nb, it // nb
            if bug != "reducer_no_wait":
                while not (done[("dq_full", b)] > 0 and parity_wait_ok(("dq_full", b), bu & 1, bu)):
                    yield
            if bug == "reducer_early_release":
                arrive(("dq_empty", b))
            for w in (0, 1):
                read(("dqt", b, w), "reducer")
                assert tile_ver.get((b, w)) == it, \
                    f"reducer reads dQ tile {(b, w)} for step {it}, it holds step {tile_ver.get((b, w))}"
                yield                               # LDS slices + reductions over several ticks
                assert tile_ver.get((b, w)) == it, f"dQ tile {(b, w)} overwritten while reduced (step {it})"
                reduced.append((it, w))
                unread(("dqt", b, w), "reducer")
            if bug != "reducer_early_release":
                arrive(("dq_empty", b))
            yield

    agents = {"producer": GB.ring_producer(st, n_steps, stages, tma_delay), "wg0": consumer(0), "wg1": consumer(1),
              "reducer": reducer()}
    speed = {name: rng.choice((1, 2, 6, 20)) for name in agents}   # skewed agent speeds: slow reducers etc.
    tick = st.run(agents, max_ticks, progress=lambda: (len(reduced), dict(tile_ver)), speed=speed)
    assert sorted(reduced) == [(it, w) for it in range(n_steps) for w in (0, 1)], \
        f"dQ contributions lost or doubled: reduced {len(reduced)} tiles of {2 * n_steps}"
    assert done["end"] == 1
    return tick


def check_dqw_protocol(trials: int = 300, seed: int = 0) -> str:
    """``dqw_protocol_model`` over random interleavings: 0-9 query blocks, 1-4 ring stages (d = 128 runs 2, d = 64
    runs 4), 1-2 dQ buffers, TMA delays 0-6."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        dqw_protocol_model(rng.randint(0, 9), 1 + k % 4, nb=1 + (k // 4) % 2, seed=k, tma_delay=rng.randint(0, 6))
    return (f"dQ-through-smem protocol: {trials} random interleavings without deadlock, parity mismatch, buffer "
            f"hazard or lost dQ contribution")


# ----------------------------------------------------------------------------------------------------------------
# Step census and cycle model from offline SASS (``attention_gluon_bwd.sass_step_loops`` / ``bwd_step_model``)
# ----------------------------------------------------------------------------------------------------------------


def dqw_step_model(sass: str, tflops: Optional[float] = None) -> dict:
    """Census of the step loops of a variant-5 (DQW) build (``sass``: cuobjdump text) and the cycles per CTA
    step of ``attention_gluon_bwd.bwd_step_model`` on the two unmasked consumer loops, corrected for this kernel:

    * the consumer's 16 STS.64 per warp (the dQ tile) move 256 B per warp instruction, not the 512 B of an STSM
      that ``bwd_step_model`` charges per "sts";
    * the reducer's LDS.128 (512 B per warp instruction) are added to the shared-memory port;
    * the reducer warp's loop shares an SM sub-partition with one consumer warp of each warpgroup: ``issue`` is the
      larger of (consumers + producer) and (consumers + reducer).

    Returns dict(consumer=[loops], reducer=loop, producer=loop, model=bwd_step_model result with the corrected
    ``smem`` / ``issue`` and the extra keys ``reducer_lds`` / ``reducer_red``)."""
    loops = GB.sass_step_loops(sass)
    cons = [lp for lp in loops if lp["hgmma"]]
    rest = [lp for lp in loops if not lp["hgmma"]]
    red = [lp for lp in rest if lp["classes"].get("redg")]
    prod = [lp for lp in rest if not lp["classes"].get("redg")]
    assert len(red) == 1 and len(prod) == 1, [lp["n"] for lp in loops]
    unmasked = [lp for lp in cons if not lp["classes"].get("fsel_fsetp")]
    assert len(unmasked) == 2, [lp["n"] for lp in cons]
    model = GB.bwd_step_model(unmasked, prod[0]["n"], tflops=tflops)
    warps = 4
    sts_all = sum(lp["classes"].get("sts", 0) for lp in unmasked)
    sts64 = sts_all - 4 * len(unmasked)          # minus the 4 STSM (dS^T) per consumer warp and step
    rc = red[0]["classes"]
    smem = model["smem"] - sts64 * warps * (512 - 256) / 128 + rc.get("lds", 0) * 512 / 128
    issue = max(model["issue"], model["issue_consumers"] + red[0]["n"])
    model.update(smem=smem, issue=issue, reducer_lds=rc.get("lds", 0), reducer_red=rc.get("redg", 0),
                 red_bytes=rc.get("redg", 0) * 32 * 16)
    if tflops:
        for key in ("smem", "issue"):
            model[f"{key}_share"] = model[key] / model["measured"]
        model["red_tb_per_s"] = model["red_bytes"] * 132 / (model["measured"] / 1.83e9) / 1e12
    return dict(consumer=cons, reducer=red[0], producer=prod[0], model=model)
