"""The GPU suite (run by bench/gpu_suite.py on the H200): it fails, never skips, without CUDA."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA GPU; CI runs the CPU suite only (scripts/test.sh ignores this folder)")


@pytest.fixture(scope="module")
def exact_float32():
    """TF32 off for the module: float32 comparisons on the GPU then hold to float32 precision."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
