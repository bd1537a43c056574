"""Communication scheduling: profiles, cost models and planners (pure; no tensors are moved).

A planner turns a per-layer :class:`ModelProfile` and a :class:`ClusterSpec` into a :class:`Plan`
— groups of gradients, their order and their PS shards — that the simulator (``gradsum.sim``) and
a runtime firing sends from autograd hooks both execute.
"""

from .cluster import ClusterSpec
from .costs import AllReduceCost, AlphaBeta, PSCost, fit_alpha_beta
from .plan import Group, Part, Plan
from .planners import PLANNER_NAMES, make_planner, parse_scheduler
from .profile import LayerProfile, ModelProfile, uniform_profile

__all__ = [
    "PLANNER_NAMES",
    "AllReduceCost",
    "AlphaBeta",
    "ClusterSpec",
    "Group",
    "LayerProfile",
    "ModelProfile",
    "PSCost",
    "Part",
    "Plan",
    "fit_alpha_beta",
    "make_planner",
    "parse_scheduler",
    "uniform_profile",
]
