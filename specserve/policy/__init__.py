"""Speculation-length policies: DSDE's per-sequence state and maths, the KLD signal, and the one planner
(``planner.py``) that turns them into each step's draft depths (docs/algorithms.md §4, §5). Host-side and pure."""

from specserve.policy.dsde import (
    DSDEConfig,
    FlatKLD,
    SequenceDSDE,
    ShortWindow,
    SLMinRule,
    SLState,
    apply_cap,
    calibrate,
    kld_nodes,
    kld_positions,
    predict_sl,
    scale_factor,
    short_window_size,
    sl_cap,
    verified_positions,
    weighted_variance,
    wvir,
)
from specserve.policy.kld import PROB_FLOOR, SparseTail, dense_from_sparse, kld_exact, kld_sparse, sparse_topk_q

__all__ = [
    "PROB_FLOOR",
    "DSDEConfig",
    "FlatKLD",
    "SLMinRule",
    "SLState",
    "SequenceDSDE",
    "ShortWindow",
    "SparseTail",
    "apply_cap",
    "calibrate",
    "dense_from_sparse",
    "kld_exact",
    "kld_nodes",
    "kld_positions",
    "kld_sparse",
    "predict_sl",
    "scale_factor",
    "short_window_size",
    "sl_cap",
    "sparse_topk_q",
    "verified_positions",
    "weighted_variance",
    "wvir",
]
