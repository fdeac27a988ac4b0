"""The side stream: one CUDA stream a device for work that runs beside the main stream's, joined by an event.

The MoE's shared expert runs on it beside the router and the routed experts (``model.moe``).  Kernels that keep
per-device scratch state (``model.mxfp8_kernels.split_counters``) keep a second copy for it: launches on the main
stream run one after another, and so do launches on the side stream, but the two may overlap.
"""

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """``device``'s side stream (one for every caller: their work runs one after another on it)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def on_side_stream(device: torch.device) -> bool:
    """Whether work issued now for ``device`` goes to its side stream."""
    side = _SIDE_STREAMS.get(device)
    return side is not None and torch.cuda.current_stream(device) == side
