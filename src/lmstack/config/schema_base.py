"""The base of the config sections: `Section` (extra keys refused with a suggestion) and the type
helpers its validators share."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def leaf_types(annotation: Any) -> list[Any]:
    """The plain types a field annotation accepts (through Union / Optional / Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return leaf_types(typing.get_args(annotation)[0])
    if origin is Literal:
        return []
    args = typing.get_args(annotation)
    if args and origin is not None and origin not in (dict, list, tuple):
        return [t for arg in args for t in leaf_types(arg)]
    return [annotation]


def _typed_strings(value: Any) -> Any:
    """Inside a mapping: "true"/"false" -> bool, "2" -> 2, "0.5" -> 0.5; anything else as it is."""
    if isinstance(value, dict):
        return {k: _typed_strings(v) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.isdigit():
        return int(value)
    if value.replace(".", "", 1).isdigit():
        return float(value)
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """`lora_rank: true` would validate as 1 (bool is an int subclass): refuse it for number fields."""
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            leaves = leaf_types(cls.model_fields[info.field_name].annotation)
            if bool not in leaves and (int in leaves or float in leaves):
                raise ValueError("a boolean is not a number; write a number")
        return value
