"""Host-to-device copies that never wait for the step in flight.

CUDA synchronizes the stream before a copy from pageable host memory starts, so with a step in flight
(async scheduling) such a copy would hold the host until the GPU caught up.  From pinned memory the copy is
queued and the host goes on; PyTorch's pinned allocator keeps the block until the copies reading it have
run, so a temporary pinned tensor may be dropped at once.
"""

import numpy as np
import torch


def staged(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` as a CPU tensor a ``non_blocking`` copy to ``device`` reads without waiting (pinned for a GPU)."""
    tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    return tensor.pin_memory() if device.type == "cuda" else tensor


def upload(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, queued behind the work already there (the host does not wait)."""
    return staged(host, device).to(device, non_blocking=True)
