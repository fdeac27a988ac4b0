"""How one engine spreads over processes (``--tensor-parallel``, ``--expert-parallel``, the multi-node rendezvous).

Torch-free: the CLI builds and checks it before paying for the torch import.
"""

from dataclasses import dataclass

# Every process an engine starts keeps NVLink SHARP / multicast off: multicast objects are not available on
# every machine the engine runs on (shared hosts, some MIG or VM setups), and NCCL fails hard when it tries.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel: int = 1  # ranks of one engine (all GPUs of all its nodes)
    expert_parallel: bool = False  # MoE layers: whole experts per rank instead of a slice of every expert
    nnodes: int = 1  # nodes (pods) of one engine; tensor_parallel / nnodes ranks run on each
    node_rank: int = 0  # 0 on the leader (scheduler, gRPC); 1.. on workers
    master_addr: str = "127.0.0.1"  # the leader's address (LeaderWorkerSet: LWS_LEADER_ADDRESS)
    master_port: int = 0  # rendezvous port on the leader; 0: a free port (one node only)

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.nnodes < 1 or self.tensor_parallel % self.nnodes:
            raise ValueError(
                f"--tensor-parallel {self.tensor_parallel} must be a multiple of --nnodes {self.nnodes} "
                "(the same number of GPUs on every node)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node engine needs a fixed --master-port that every node uses")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a port")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel // self.nnodes

    @property
    def first_rank(self) -> int:
        """Global rank of this node's first process."""
        return self.node_rank * self.ranks_per_node

    @property
    def is_parallel(self) -> bool:
        return self.tensor_parallel > 1
