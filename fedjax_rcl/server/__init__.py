"""Aggregation and server optimizers (each registers itself; see ``fedjax_rcl.registry``)."""

from fedjax_rcl.server.aggregate import (
    AGGREGATIONS,
    client_weights,
    weighted_mean,
    weighted_sum,
)
from fedjax_rcl.server.fedacg import fedacg
from fedjax_rcl.server.optimizers import (
    ServerOptimizer,
    fedadam,
    fedavg,
    fedavgm,
    scale_by_fedadam,
    server_optimizer,
)

__all__ = ["AGGREGATIONS", "ServerOptimizer", "client_weights", "fedacg", "fedadam", "fedavg",
           "fedavgm", "scale_by_fedadam", "server_optimizer", "weighted_mean", "weighted_sum"]
