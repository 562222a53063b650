"""The base of every settings object: a copy with changed fields is checked like a constructed one."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Self, Union, get_args, get_origin

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Validated(BaseModel):
    """``model_copy(update=...)`` re-runs validation (pydantic's own copy skips it: ``catch_up_window=0`` or
    ``budget=1`` would pass into a loop and fail there, far from the setting). No setting takes an infinite or NaN
    number: a range check alone lets infinity through (an ``alpha`` of inf ran, silently meaningless). Nor a
    boolean for a number (pydantic reads True as 1: ``top_k=True`` made a sampled request greedy, and YAML's ``no``
    made ``max_queued_requests`` 0)."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool | np.bool_) and info.field_name and _numeric(cls.model_fields[info.field_name]):
            raise ValueError(f"a number, not {value}")
        return value

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return self.model_validate({**fields, **update})


def _numeric(field: Any) -> bool:
    """Whether a field takes an int or a float and no boolean (``int | None`` does; ``bool | int`` does not)."""
    kind = field.annotation
    kinds = get_args(kind) if get_origin(kind) in (Union, types.UnionType) else (kind,)
    return bool not in kinds and any(k in (int, float) for k in kinds)
