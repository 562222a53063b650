"""The base of every settings object: a copy with changed fields is checked like a constructed one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict


class Validated(BaseModel):
    """``model_copy(update=...)`` re-runs validation (pydantic's own copy skips it: ``catch_up_window=0`` or
    ``budget=1`` would pass into a loop and fail there, far from the setting). No setting takes an infinite or NaN
    number: a range check alone lets infinity through (an ``alpha`` of inf ran, silently meaningless)."""

    model_config = ConfigDict(allow_inf_nan=False)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return self.model_validate({**fields, **update})
