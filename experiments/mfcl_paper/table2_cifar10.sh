#!/usr/bin/env bash
# MFCL Tables 2 / 14 at paper scale: xi in {0.01, 0.1, 0.5, 200} x M in {10, 100} x the client
# module's normalisation (TN, GN, BN). Each line is one run; each resumes with
# `fedjax-rcl resume RUN_DIR` if stopped. GPU-sized: not run on the project's CPUs.
set -euo pipefail
cd "$(dirname "$0")/../.."
for m in 10 100; do
  for xi in 0.01 0.1 0.5 200; do
    for norm in twin group batch; do
      fedjax-rcl mfcl experiments/mfcl/paper_cifar10.yaml num_clients=$m alpha=$xi norm=$norm \
        run_dir=experiments/runs/mfcl_paper/m$m-xi$xi-$norm
    done
  done
done
