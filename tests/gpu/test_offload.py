"""CPU KV offload's hot-buffer resolver compiled on the GPU, held to the same rules as on the CPU interpreter
(the interpreter does not specialize arguments, so a kernel that only compiles there passes the CPU suite)."""

import torch

from tests.engine.offload.test_resolver import check_kernel_follows_the_rules


def test_resolver_kernel_follows_the_rules_compiled():
    check_kernel_follows_the_rules(torch.device("cuda"))
