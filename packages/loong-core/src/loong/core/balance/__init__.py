"""Data-parallel load balancing: a per-sample cost model and a (rank, micro-batch) planner.

With variable-length samples, attention cost grows with the square of the length, so equal token
counts per data-parallel rank still leave ranks unbalanced. :class:`CostModel` turns lengths into
costs (fitted from measured step times with :func:`fit_cost_model`) and :func:`plan` assigns a global
batch to ranks and micro-batches so the most loaded rank is as cheap as possible.
"""

from loong.core.balance.cost import CostModel, fit_cost_model, rank_features
from loong.core.balance.planner import Plan, plan

__all__ = ["CostModel", "Plan", "fit_cost_model", "plan", "rank_features"]
