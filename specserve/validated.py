"""The base of every settings object: a copy with changed fields is checked like a constructed one."""

from __future__ import annotations

import types
from collections import abc
from collections.abc import Mapping
from typing import Annotated, Any, Self, Union, get_args, get_origin

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
        if info.field_name and (found := _bool_for_a_number(cls.model_fields[info.field_name].annotation, value)):
            raise ValueError(f"a number, not {found[0]}")
        return value

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return self.model_validate({**fields, **update})


def _bool_for_a_number(kind: Any, value: Any) -> tuple[bool] | None:
    """(the boolean,) where ``value`` holds one in a place ``kind`` takes an int or a float and no boolean: the
    value itself (``int | None`` takes none; ``bool | int`` does), or an item of a tuple, list or set, or a key or
    value of a mapping (``tuple[int, ...]`` read YAML's ``yes`` as 1); None where it holds none."""
    while get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    kinds = get_args(kind) if get_origin(kind) in (Union, types.UnionType) else (kind,)
    if isinstance(value, bool | np.bool_):
        return (bool(value),) if bool not in kinds and any(k in (int, float) for k in kinds) else None
    for k in kinds:
        origin, args = get_origin(k), get_args(k)
        if origin in (tuple, list, set, frozenset, abc.Sequence, abc.Set) and isinstance(value, list | tuple | set):
            items = args if origin is tuple and args and args[-1] is not Ellipsis else args[:1] * len(value)
            for item_kind, item in zip(items, value, strict=False):
                if found := _bool_for_a_number(item_kind, item):
                    return found
        elif origin in (dict, abc.Mapping) and isinstance(value, dict) and len(args) == 2:
            for key, item in value.items():
                if found := _bool_for_a_number(args[0], key) or _bool_for_a_number(args[1], item):
                    return found
    return None
