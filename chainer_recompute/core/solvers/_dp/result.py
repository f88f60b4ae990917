"""What the DP returns: the chain of family rows it found, with its
retained time and memory and the work done."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class DPResult:
    """The chain found by :func:`run_dp` (row indices into the family) and
    its retained time and memory; ``chain`` is ``None`` when infeasible."""

    chain: Optional[List[int]]
    retained_time: float
    retained_bytes: int
    n_transitions: int
    n_states: int

