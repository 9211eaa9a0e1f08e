#!/usr/bin/env bash
# A thin wrapper over torchrun: it fills in defaults, prints the real command, then runs it.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    cat <<EOF
Usage: ./launch.sh [SCRIPT [ARGS...]]

Runs SCRIPT (default: tutorials/03_bucketing.py) under torchrun, one process per rank.

Environment (all optional):
  NPROC            processes on this node          (default 2)
  NNODES           nodes in the job                (default 1)
  NODE_RANK        this node's index, 0..NNODES-1  (default 0)
  MASTER_ADDR      host of node 0, for multi-node  (default 127.0.0.1)
  MASTER_PORT      port on node 0                  (default: a free one on one node, else 29500)
  OMP_NUM_THREADS  compute threads per rank        (default 1 on CPU)

Examples:
  ./launch.sh
  NPROC=4 ./launch.sh tutorials/02_naive_ddp.py
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh train.py   # then NODE_RANK=1 on node 1
EOF
}

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi

# Check from / so the current directory, which `python -c` puts on sys.path and torchrun's
# workers do not, cannot hide a missing install. find_spec finds miniddp without importing torch
# a second time (~1.5 s).
TORCH_DEVICE='import torch; print("gpu" if torch.cuda.is_available() else "cpu")'
FIND_MINIDDP='import importlib.util, sys; sys.exit(not importlib.util.find_spec("miniddp"))'
if ! DEVICE=$(cd / && python3 -c "$TORCH_DEVICE" 2>/dev/null); then
    echo "launch.sh: torch is not installed; run: pip install torch==2.13.0" >&2
    exit 1
fi
if ! (cd / && python3 -c "$FIND_MINIDDP"); then
    echo "launch.sh: miniddp is not installed; in $REPO_DIR run: pip install -e ." >&2
    exit 1
fi

# Two compute threads per rank on 2 cores made a DDP step ~15x slower: the ranks fight over the
# cores. torchrun sets 1 itself only when NPROC > 1, and with a warning; we say it up front.
if [[ "$DEVICE" == cpu && -z "${OMP_NUM_THREADS:-}" ]]; then export OMP_NUM_THREADS=1; fi

NPROC="${NPROC:-2}"
NNODES="${NNODES:-1}"
if [[ "$NNODES" == 1 && -z "${MASTER_PORT:-}" ]]; then
    RENDEZVOUS=(--standalone)  # torchrun starts its own rendezvous on a free local port
else
    RENDEZVOUS=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}"
        --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}")
fi

if [[ $# -eq 0 ]]; then set -- "$REPO_DIR/tutorials/03_bucketing.py"; fi

COMMAND=(torchrun "${RENDEZVOUS[@]}" --nproc_per_node="$NPROC" "$@")
echo "+ ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }${COMMAND[*]}"
exec "${COMMAND[@]}"
