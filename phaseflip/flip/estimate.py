"""A number with its provenance (law 5): the flip policy's estimates and how they combine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MEASURED, HALF, SEED, UNMEASURED = "measured", "half-measured", "seed", "unmeasured"


@dataclass(frozen=True)
class Estimate:
    """A number with its provenance; `value` None exactly when nothing measured or seeded it.
    `provisional`: measured from too little to act on (a rate from too few steps); reported
    'half-measured' with a note, and no flip is decided on it."""

    value: float | None
    provenance: str = UNMEASURED
    samples: int = 0
    note: str = ""
    provisional: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: an infinite value (N when P ≤ X) is the string "inf", never null (null
        means unmeasured, law 5)."""
        v = self.value
        value = v if v is None or math.isfinite(v) else "inf" if v > 0 else "-inf"
        d: dict[str, Any] = {"value": value,
                             "provenance": self.provenance, "samples": self.samples}
        if self.note:
            d["note"] = self.note
        return d


def combine(value: float | None, *parts: Estimate, note: str = "") -> Estimate:
    """An estimate computed from `parts`: unmeasured if any is, measured only if all are."""
    if value is None or any(p.value is None for p in parts):
        return Estimate(None, UNMEASURED, note=note)
    kinds = {p.provenance for p in parts}
    prov = MEASURED if kinds == {MEASURED} else SEED if kinds == {SEED} else HALF
    measured = [p.samples for p in parts if p.provenance != SEED]
    return Estimate(value, prov, min(measured, default=0), note)
