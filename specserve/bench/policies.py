"""The policies the batch benchmark, the straggler study (``load/straggler.py``) and the simulator
(``load/simulate.py``) compare: one typed table, keyed by ``PolicyName``."""

from __future__ import annotations

import argparse
from enum import Enum

from pydantic import ValidationError

from specserve.config import SLPolicyKind, SpecConfig, SpecMethod
from specserve.policy import DSDEConfig


class PolicyName(str, Enum):
    """A speculation setting under study: drafting (none, chain, DDD tree) x SL policy x SL_cap."""

    plain = "plain"
    static = "static"
    dsde_nocap = "dsde_nocap"
    dsde_cap = "dsde_cap"
    ddd = "ddd"
    dsde_ddd = "dsde_ddd"
    dsde_ddd_nocap = "dsde_ddd_nocap"  # not in the default sweeps; the tree SL_cap comparison

    @property
    def label(self) -> str:
        """The name in tables and plots."""
        return _LABELS[self]

    @property
    def is_chain(self) -> bool:
        return self in (PolicyName.static, PolicyName.dsde_nocap, PolicyName.dsde_cap)

    @property
    def is_tree(self) -> bool:
        return self in (PolicyName.ddd, PolicyName.dsde_ddd, PolicyName.dsde_ddd_nocap)

    @property
    def is_dsde(self) -> bool:
        return self in (PolicyName.dsde_nocap, PolicyName.dsde_cap, PolicyName.dsde_ddd, PolicyName.dsde_ddd_nocap)


_LABELS = {
    PolicyName.plain: "plain",
    PolicyName.static: "static SL",
    PolicyName.dsde_nocap: "DSDE no cap",
    PolicyName.dsde_cap: "DSDE + SL_cap",
    PolicyName.ddd: "DDD",
    PolicyName.dsde_ddd: "DSDE+DDD",
    PolicyName.dsde_ddd_nocap: "DSDE+DDD no cap",
}

STUDY_POLICIES = tuple(p for p in PolicyName if p != PolicyName.dsde_ddd_nocap)  # the default sweep's six
CAP_PAIRS = {  # drafting -> (DSDE with SL_cap, DSDE without)
    "chain": (PolicyName.dsde_cap, PolicyName.dsde_nocap),
    "tree (DDD)": (PolicyName.dsde_ddd, PolicyName.dsde_ddd_nocap),
}
CAP_LABELS = {drafting: (cap.label, nocap.label) for drafting, (cap, nocap) in CAP_PAIRS.items()}  # for tables


def policy_specs(
    *,
    static_sl: int = 4,
    beam_width: int = 4,
    budget: int = 16,
    ddd_check_steps: tuple[int, ...] | None = None,
    ddd_threshold: float | None = None,
) -> dict[PolicyName, SpecConfig]:
    """Every policy's speculation settings. Chains keep SpecConfig's ``chain_draft`` (greedy requests draft greedily
    whatever it is); trees use beam width ``beam_width``, verify budget ``budget`` and DDD's check steps and threshold x
    (None: the paper's)."""
    dsde, no_cap = SLPolicyKind.dsde, DSDEConfig(cap_enabled=False)
    paper = SpecConfig()
    ddd = SpecConfig(
        method=SpecMethod.ddd,
        beam_width=beam_width,
        budget=budget,
        ddd_check_steps=paper.ddd_check_steps if ddd_check_steps is None else ddd_check_steps,
        ddd_threshold=paper.ddd_threshold if ddd_threshold is None else ddd_threshold,
    )
    return {
        PolicyName.plain: SpecConfig(method=SpecMethod.none),
        PolicyName.static: SpecConfig(method=SpecMethod.chain, sl=static_sl),
        PolicyName.dsde_nocap: SpecConfig(method=SpecMethod.chain, policy=dsde, dsde=no_cap),
        PolicyName.dsde_cap: SpecConfig(method=SpecMethod.chain, policy=dsde),
        PolicyName.ddd: ddd,
        PolicyName.dsde_ddd: ddd.model_copy(update={"policy": dsde}),
        PolicyName.dsde_ddd_nocap: ddd.model_copy(update={"policy": dsde, "dsde": no_cap}),
    }


def check_steps_arg(text: str) -> tuple[int, ...]:
    """A command line's DDD check steps: comma-separated increasing forwards, e.g. 2,3,4 (SpecConfig's rule)."""
    try:
        steps = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"DDD check steps are comma-separated integers, got {text!r}") from None
    try:
        SpecConfig(method=SpecMethod.ddd, ddd_check_steps=steps)
    except ValidationError as e:
        raise argparse.ArgumentTypeError(e.errors()[0]["msg"]) from None
    return steps
