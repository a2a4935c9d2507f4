"""`EngineField`: an `EngineConfig` as a field of a pydantic config (eval's, the serve benchmark's),
written as its JSON object and read back from one. A module of its own so that the engine itself
never imports pydantic: only the configs that hold an engine's settings do."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

from sparsetune.engine.config import EngineConfig


def _from_json(value: Any) -> Any:
    """An `EngineConfig` from its JSON object (unknown keys dropped); an instance as it is."""
    return EngineConfig.from_dict(value) if isinstance(value, dict) else value


# An `EngineConfig` as a field of a pydantic config (eval's, the serve benchmark's): written as its
# JSON object, read back from one. Not revalidated field by field: flow parameters may be typed
# values (Python) or --param strings.
EngineField = Annotated[EngineConfig, BeforeValidator(_from_json), PlainSerializer(asdict)]
