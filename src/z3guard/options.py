"""User-facing options, each with the reason it exists."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuardOptions:
    warn: bool = True
    """Log one warning per distinct trace divergence (rank 0). Records are kept either way; turn the
    warnings off where a dynamic model diverges by design and the summary is enough."""
