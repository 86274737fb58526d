#!/usr/bin/env bash
# The authors' released FedRCL code (skynbe/FedRCL @378beb4) beside our runs, on the same images
# and the same split (issue 48 item 2): FedAvg and FedRCL (their default loss), Dirichlet 0.3,
# seeds 0-2, ResNet-10 width 16, 100 rounds, evaluated every round. One stream per algorithm,
# seeds round-robin in chunks of 25 rounds; every call resumes where the last one stopped.
#   AUTHORS_CHECKOUT=PATH/FedRCL AUTHORS_PYTHON=PATH/venv/bin/python \
#     bash experiments/authors_code/run.sh [ALGORITHM ...]
# Needs, once: this project's environment (for the export) and an environment with the authors'
# requirements (torch, torchvision, hydra-core, hydra-colorlog, omegaconf, coloredlogs, wandb,
# netcal, imageio, scikit-learn, tabulate, torchinfo, torchmetrics, umap-learn, matplotlib).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${AUTHORS_CHECKOUT:?a checkout of skynbe/FedRCL}"
: "${AUTHORS_PYTHON:?the python of an environment with the authors requirements}"
OURS=(experiments/runs/fidelity_cpu/fedavg-a0.3 experiments/runs/seeds_cpu/fedavg-a0.3-s1
      experiments/runs/seeds_cpu/fedavg-a0.3-s2)
for s in 0 1 2; do  # the images (our order) and each seed's split, as our runs drew them
  [ -f "runs/authors_data/s$s/export.json" ] ||
    python experiments/authors_code/authors_reference.py export "${OURS[$s]}" \
      --out "runs/authors_data/s$s"
done
ALGOS=("${@:-fedavg fedrcl}")
for rounds in 25 50 75 100; do
  for s in 0 1 2; do
    for algo in ${ALGOS[@]}; do
      "$AUTHORS_PYTHON" experiments/authors_code/authors_reference.py run \
        --checkout "$AUTHORS_CHECKOUT" --data "runs/authors_data/s$s" --algorithm "$algo" \
        --rounds "$rounds" --threads 1 --run-dir "experiments/runs/authors_code/$algo-a0.3-s$s" \
        2>/dev/null | grep -v "^resuming"
    done
  done
done
