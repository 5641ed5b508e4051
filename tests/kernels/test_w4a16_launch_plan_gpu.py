"""W4A16 with launch plans (``ops._LAUNCH_PLANS``, on by default; FXOPT_LAUNCH_PLANS=0 turns them off): a replayed call
gives what the ordinary path gives on fresh activations, for every listed config of a few shapes (the methods the tuner
can pick: swapx / swapd, gemv1, mma, gluon; dequant + cuBLAS keeps the ordinary path), and the plan follows the zero
points' integrality (a fact about their values, not their metadata) and the active routes."""
import pytest
import torch

from fxopt.kernels import launch_plan as LP
from fxopt.kernels import w4a16 as K4
from fxopt.kernels.w4a16 import common, ops

from w4a16_helpers import make_packed

pytestmark = pytest.mark.gpu

REPLAYABLE = ("swapx", "swapd", "gemv1", "mma", "gluon")


def _weights(K, N, G, integer_zeros=True, seed=0):
    qweight, scales, zeros, _ = make_packed(K, N, G, torch.bfloat16, "cuda", seed)  # row 0 of zeros: x.5
    return qweight, scales, zeros.round() if integer_zeros else zeros


def _close(a, b):
    # split-K partial sums may be added in another order (atomics, counters): last bits only
    err = (a.float() - b.float()).abs().max().item()
    assert err <= 1e-2 * b.float().abs().max().item() + 1e-3, err


@pytest.fixture
def plans_on(monkeypatch):
    monkeypatch.setattr(ops, "_LAUNCH_PLANS", True)
    LP.clear_plans()
    yield
    LP.clear_plans()


@pytest.mark.parametrize("M", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("K,N", [(4096, 4096), (2048, 5632)])
def test_replay_matches_ordinary_for_every_listed_config(plans_on, M, K, N):
    qw, sc, zr = _weights(K, N, 128)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    cands = K4.candidate_configs(M, N, K, 128, common.num_sms(torch.device("cuda")), integer_zeros=True,
                                 dtype=torch.bfloat16, device=torch.device("cuda"))
    for cfg in cands:
        for seed in (0, 1):  # ordinary, then recorded
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            K4.w4a16_matmul(x, qw, sc, zr, 128, bias, config=cfg)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        before = LP.stats["replayed"]
        y = K4.w4a16_matmul(x, qw, sc, zr, 128, bias, config=cfg)
        ref = K4.w4a16_matmul.__wrapped__(x, qw, sc, zr, 128, bias, config=cfg)
        _close(y, ref)
        assert y.shape == ref.shape and y.stride() == ref.stride()
        plan = LP.plan_for(K4.w4a16_matmul, x, qw, sc, zr, 128, bias, config=cfg)
        if cfg.method in REPLAYABLE:
            assert isinstance(plan, LP.Plan), (cfg, plan)
            assert LP.stats["replayed"] == before + 1
        print(M, K, N, cfg.label() if hasattr(cfg, "label") else cfg,
              "plan" if isinstance(plan, LP.Plan) else plan)


def test_tuned_path_3d_input_and_zero_points_in_the_key(plans_on):
    K, N = 4096, 4096
    qw, sc, zr = _weights(K, N, 128)
    _, _, zf = _weights(K, N, 128, integer_zeros=False)
    for M in (1, 16):
        for zeros in (zr, zf):
            for _ in range(3):
                x = torch.randn(2, M, K, device="cuda", dtype=torch.bfloat16)
                y = K4.w4a16_matmul(x, qw, sc, zeros, 128)
            ref = K4.w4a16_matmul.__wrapped__(x, qw, sc, zeros, 128)
            _close(y, ref)
            assert y.shape == (2, M, N)
    # same metadata, different integrality: two keys, never one plan for both
    x = torch.randn(2, 16, K, device="cuda", dtype=torch.bfloat16)
    state = ops._plan_state(x, qw, sc, zr)
    assert state != ops._plan_state(x, qw, sc, zf)
    with K4.routes(gluon=False):  # other routes: another key
        assert ops._plan_state(x, qw, sc, zr) != state


def test_op_under_cuda_graph_capture_with_plans(plans_on):
    K, N = 4096, 4096
    qw, sc, zr = _weights(K, N, 128)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.ops.fxopt.w4a16_linear(x, qw, sc, zr, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.fxopt.w4a16_linear(x, qw, sc, zr, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _close(y, K4.w4a16_matmul.__wrapped__(x, qw, sc, zr, 128))
