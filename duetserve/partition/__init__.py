"""SM partitioning: pairs of CUDA streams restricted to disjoint SM sets (docs/design.md section 5)."""
from duetserve.partition.base import (
    NoPartition,
    PartitionBackend,
    SelfTest,
    StreamPair,
    make_partition_backend,
)

__all__ = ["NoPartition", "PartitionBackend", "SelfTest", "StreamPair", "make_partition_backend"]
