"""A term of the plan: a number, what it is, why, and which formula of the library it comes from.

Each term names its source: the library function that computes it and the chapter (or test)
that verifies that function against a measurement, or, where nothing here measures it,
`UNVERIFIED` and what is assumed instead. The CLI prints them; the JSON carries them.
"""

from __future__ import annotations

from dataclasses import dataclass

UNVERIFIED = "not verified by a chapter"


@dataclass(frozen=True)
class Term:
    """`value` in bytes (memory) or seconds (time); `exposed` is the part of a time term that
    no compute hides (= value for terms that are not overlapped)."""

    name: str
    value: float
    why: str
    source: str
    exposed: float | None = None

    @property
    def verified(self) -> bool:
        return not self.source.startswith(UNVERIFIED)

    def as_dict(self, unit: str) -> dict:
        scale = 1024**3 if unit == "gib" else 1.0
        entry = {unit: self.value / scale, "why": self.why, "source": self.source}
        if self.exposed is not None:
            entry["exposed_s"] = self.exposed
            entry["hidden_s"] = self.value - self.exposed
        return entry
