"""The oneDNN convolutions under vmap (clients side by side): XLA's loop over the clients, one
FFI call each (``vmap_method="sequential"``, the package before) against one call for all the
clients that loops over them on slices of the stacked buffers (``"expand_dims"``, now), in
MOON's Table 1 setting cut to one local epoch, one fresh process per call: the seconds of two
rounds after compiling.

    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip python \\
        experiments/small_model_speed/batched_conv_calls.py {sequential,batched} ALGORITHM \\
        [KEY=VALUE ...]     # e.g. fedavg model=cnn clients_in_parallel=10
"""

import json
import sys

from fedjax_rcl.nn import onednn


def main(setting: str, algorithm: str, overrides: list[str]) -> None:
    from layout_moon_setting import time_rounds  # this folder's script

    if setting == "sequential":  # the convolutions' calls as before: one per client
        call = onednn.call

        def sequential(target, *args, vmap_method="sequential", **kwargs):
            if target in onednn.TARGETS:
                vmap_method = "sequential"
            return call(target, *args, vmap_method=vmap_method, **kwargs)

        onednn.call = sequential
    exp, _, times = time_rounds(algorithm, overrides)
    print(json.dumps({"setting": setting, "algorithm": algorithm, "overrides": overrides,
                      "layout": exp.layout, "round_s": times}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
