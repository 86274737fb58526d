"""fedjax-rcl: federated learning simulated on accelerators in JAX."""
