"""Data-parallel load balancing: a per-sample cost model and a (rank, micro-batch) planner.

With variable-length samples, attention cost grows with the square of the length, so equal token
counts per data-parallel rank still leave ranks unbalanced. :class:`CostModel` turns lengths into
costs (fitted from measured step times with :func:`fit_cost_model`) and :func:`plan` assigns a global
batch to ranks and micro-batches so the most loaded rank is as cheap as possible. :class:`DataBalancer`
applies both to a run, step by step (``data.balance``).
"""

from loong.core.balance.balancer import DataBalancer, StepPlan
from loong.core.balance.cost import CostModel, fit_cost_model, rank_features
from loong.core.balance.planner import Plan, plan

__all__ = ["CostModel", "DataBalancer", "Plan", "StepPlan", "fit_cost_model", "plan", "rank_features"]
