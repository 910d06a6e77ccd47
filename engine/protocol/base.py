"""The base of every wire model: unknown fields refused, OpenAI's bookkeeping fields and
nulls accepted, floats finite."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# Request fields that change nothing kvfleet computes (OpenAI's bookkeeping): accepted and
# ignored. Every other field kvfleet does not implement is refused with 400 naming it, so a
# caller never gets prose where it asked for something else. (README: "Request fields".)
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls"})


class OpenAIBaseModel(BaseModel):
    # Floats must be finite (Python's JSON reader takes NaN and Infinity). A field sent as null
    # is absent (clients echo back the nulls of the messages they were answered with).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_absent_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if key in cls.model_fields or (value is not None and key not in IGNORED_FIELDS)
        }
