"""Runs a few rounds on a sharded mesh and prints the metrics as JSON (used by
test_sharding.py in subprocesses, since the device count is fixed when JAX starts).

    python tests/sharding_worker.py --devices 1 2 4 --algorithm moon [--process-id I
        --num-processes N --coordinator HOST:PORT]
"""

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from conftest import toy_dataset  # noqa: E402

from fedjax_rcl.config import Config  # noqa: E402
from fedjax_rcl.engine.sharding import initialize_distributed, to_host  # noqa: E402
from fedjax_rcl.experiment import build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, nargs="+", default=[1])
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--participation", type=float, default=0.5)
    ap.add_argument("--clients-in-parallel", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model name (default: the config's)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--coordinator", default=None)
    args = ap.parse_args()
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    ds = toy_dataset()
    for d in args.devices:
        cfg = Config(dataset="toy", algorithm=args.algorithm, num_clients=8,
                     participation=args.participation, partition="dirichlet", alpha=0.5,
                     balanced=False, local_epochs=1, batch_size=16, devices=d,
                     clients_in_parallel=args.clients_in_parallel, eval_every=args.rounds,
                     **({"model": args.model, "width": args.width} if args.model else {}))
        exp = build(cfg, ds)
        state, metrics = exp.compile_rounds()(exp.state, args.rounds)
        ev = to_host(exp.evaluate(state.params, state.model_state, exp.test))
        leaves = [np.asarray(x, np.float64) for x in to_host(jax.tree.leaves(state.params))]
        table = to_host(jax.tree.leaves(state.client_states))
        print(json.dumps({
            "devices": d, "process": jax.process_index(),
            "global_devices": jax.device_count(),
            "loss": metrics["loss"].tolist(), "client_loss": metrics["client_loss"].tolist(),
            "clients": metrics["clients"].tolist(),
            "accuracy": float(ev["accuracy"]), "test_loss": float(ev["loss"]),
            "param_sums": [float(x.sum()) for x in leaves],
            "table_sums": [float(np.asarray(x, np.float64).sum()) for x in table],
        }), flush=True)


if __name__ == "__main__":
    main()
