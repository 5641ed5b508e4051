"""The bubble of each pipeline schedule, from the order torch itself would run, and the choice ``schedule="auto"``.

Torch's own schedule class builds the per-rank action order from stand-in stages (nothing runs), and :func:`replay`
plays it as a list scheduler with unit costs; the method and its checks: docs/architecture.md, "Pipeline parallel".
"""
from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from .pipeline import V_SHAPED, stage_rank

log = logging.getLogger(__name__)

AUTO_ORDER = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


class _StandInStage:
    """What torch's multi-stage schedule classes read from a stage while they build their order: indices only."""

    def __init__(self, index: int, n_stages: int, rank: int, ranks: int):
        self.stage_index, self.num_stages = index, n_stages
        self.group_rank, self.group_size = rank, ranks
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = nn.Identity()
        self.has_backward = True
        self.dw_builder = None
        self.stage_index_to_group_rank: dict = {}


def torch_order(schedule: str, ranks: int, microbatches: int, v: int) -> dict:
    """``{rank: [(kind, stage, microbatch), ...]}``: the compute actions of torch's ``Schedule<schedule>`` in order.

    Raises ValueError when torch refuses these sizes (its message), RuntimeError when this torch lacks the class."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, "Schedule" + schedule, None)
    if cls is None:
        raise RuntimeError(f"this torch has no Schedule{schedule}")
    n = ranks * v
    out = {}
    for rank in range(ranks):
        stages = [_StandInStage(i, n, rank, ranks) for i in range(n) if stage_rank(i, ranks, schedule) == rank]
        order = cls(stages, microbatches, loss_fn=lambda *a: None).pipeline_order[rank]
        out[rank] = [a for act in order if act is not None for a in _compute(act)]
    return out


def _compute(action) -> list:
    kind = str(getattr(action.computation_type, "value", action.computation_type))
    if getattr(action, "sub_actions", None):  # an overlapped F;B pair counts as its two parts
        return [a for sub in action.sub_actions for a in _compute(sub)]
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(kind, kind)
    return [(kind, action.stage_index, action.microbatch_index)] if kind in COST else []


def replay(order: dict, n_stages: int, v: int, forward_only: bool = False) -> float:
    """Bubble of ``order`` (see the module docstring). Raises ValueError if the order cannot finish."""
    done: dict = {}
    free = {r: 0.0 for r in order}
    queue = {r: [a for a in acts if not forward_only or a[0] == "F"] for r, acts in order.items()}
    busy = 0.0
    while any(queue.values()):
        progressed = False
        for r, acts in queue.items():
            while acts:
                kind, s, mb = acts[0]
                deps = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
                if kind in ("I", "B"):
                    deps.append(("F", s, mb))
                    if s < n_stages - 1:
                        deps.append(("grad", s + 1, mb))
                if kind == "W":
                    deps.append(("grad", s, mb))
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                cost = COST[kind] / v
                free[r] = start + cost
                busy += cost
                done[(kind, s, mb)] = free[r]
                if kind in ("I", "B"):
                    done[("grad", s, mb)] = free[r]
                acts.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("the schedule's order waits on an action that never runs")
    makespan = max(free.values())
    return 1.0 - busy / (len(order) * makespan) if makespan else 0.0


def predicted_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1,
                     training: bool = True) -> float:
    """Idle fraction of a pipeline step of ``schedule`` on ``pp`` ranks (see the module docstring)."""
    if pp <= 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (microbatches + pp - 1)
    v = 2 if schedule in V_SHAPED else stages_per_rank
    order = torch_order(schedule, pp, microbatches, v)
    return replay(order, pp * v, v, forward_only=not training)


def choose_schedule(pp: int, microbatches: int, training: bool, layers: Optional[int] = None,
                    stages_per_rank: int = 2) -> tuple:
    """``(schedule, {schedule: bubble or the reason it was not a candidate})`` for ``schedule="auto"``."""
    table: dict = {}
    for name in AUTO_ORDER:
        v = 1 if name in ("GPipe", "1F1B") else (2 if name in V_SHAPED else stages_per_rank)
        if not training and name in V_SHAPED:
            table[name] = "training only"
            continue
        if layers is not None and pp * v > layers:
            table[name] = f"{pp * v} stages > {layers} layers"
            continue
        try:
            table[name] = predicted_bubble(name, pp, microbatches, v, training)
        except (ValueError, RuntimeError, TypeError, AttributeError, KeyError) as e:
            table[name] = f"not available: {e}"
    scored = [(b, AUTO_ORDER.index(n), n) for n, b in table.items() if isinstance(b, float)]
    if not scored:
        raise ValueError(f"no pipeline schedule fits pp={pp}, microbatches={microbatches}: {table}")
    best = min(scored)[2]
    log.debug("schedule auto: %s from %s", best, table)
    return best, table
