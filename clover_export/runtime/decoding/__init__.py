"""The decoding modes, one `Strategy` each (runtime/decoding/base.py), by name: the one list of modes the
runtime, the CLI and the server take (docs/runtime.md "Decoding strategies")."""

from __future__ import annotations

from clover_export.core import generation
from clover_export.core.errors import CloverError
from clover_export.runtime.decoding.ar import Ar
from clover_export.runtime.decoding.base import Strategy
from clover_export.runtime.decoding.low_confidence import LowConfidence
from clover_export.runtime.decoding.self_spec import SelfSpec

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (LowConfidence(), Ar(), SelfSpec())}
MODES = tuple(STRATEGIES)
DEFAULT = LowConfidence.name
generation.register_decoding_modes(MODES)  # the request parameter table's accepted values (core.generation)


def strategy(name: str) -> Strategy:
    """The registered strategy of a mode name; a CloverError naming the modes otherwise."""
    found = STRATEGIES.get(name) if isinstance(name, str) else None
    if found is None:
        raise CloverError("generate", f"parameter 'decoding' must be one of {', '.join(MODES)}, got {name!r}")
    return found
