#!/usr/bin/env bash
# Every parallelism against torch's own on this machine's GPUs, in one prepared run that ends in
# a one-screen table: scripts/gpu_check.py says what runs, and why so.
#
#   scripts/gpu_check.sh             exit status 0 when everything passed
#   scripts/gpu_check.sh --dry-run   what it would run (--gpus N: on N GPUs); needs no GPU
#   scripts/gpu_check.sh --cpu       the same checks on the CPU, over gloo at W = 2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python3 scripts/gpu_check.py "$@"
