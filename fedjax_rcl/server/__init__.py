"""Aggregation and server optimizers."""

from fedjax_rcl.server.aggregate import AGGREGATIONS, client_weights, weighted_mean
from fedjax_rcl.server.optimizers import SERVER_OPTIMIZERS, server_optimizer

__all__ = ["AGGREGATIONS", "SERVER_OPTIMIZERS", "client_weights", "server_optimizer",
           "weighted_mean"]
