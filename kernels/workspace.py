"""Arrival counters: the workspace of reductions that finish inside their launch.

A kernel that splits one output tile's work between programs (split-K in
`quant_linear.py`, split-KV in `attention.py`) has each program write its part,
then count itself in at the tile's counter (`tl.atomic_add(..., sem="acq_rel")`
after a barrier); the program that arrives last reads every part, combines them
in a fixed order (the same bits whichever program that is), writes the tile and
sets the counter back to 0. So no second launch and no memset: the counters are
zero between calls, and one buffer per device and stream serves every call (two
streams at once would race on it).
"""

from __future__ import annotations

import torch
from torch import Tensor

_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> Tensor:
    """At least `count` int32 counters on `device`, all 0, for the current stream.

    Allocated (zeroed) on the first call that needs more than the buffer holds,
    then reused: a kernel leaves each counter it used at 0.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters
