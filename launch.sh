#!/usr/bin/env bash
# A thin wrapper over torchrun: it fills in defaults, prints the real command, then runs it.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    cat <<EOF
Usage: ./launch.sh [--emulate-nodes N [--link-rate RATE] [--loopback]] [SCRIPT [ARGS...]]

Runs SCRIPT (default: tutorials/03_bucketing.py) under torchrun, one process per rank.

Options, to try a multi-node job on this one machine:
  --emulate-nodes N  run SCRIPT as an N-node job: one torchrun agent per node, NPROC processes
                     each, meeting through c10d rendezvous. As root where 'ip netns' works, 2
                     nodes each get a network namespace (10.213.7.1 and 10.213.7.2) joined by a
                     veth pair; otherwise the agents share loopback, and it says so. Namespaces
                     are removed on exit, Ctrl-C included. NNODES, NODE_RANK, MASTER_* are
                     ignored. How it works: scripts/emulate_nodes.sh
  --link-rate RATE   cap the link between the nodes with tc, e.g. 100mbit or 1gbit (namespaces
                     only: loopback is shared with everything else on the machine)
  --loopback         use loopback even where namespaces would work

Environment (all optional):
  NPROC            processes on this node          (default 2)
  NNODES           nodes in the job                (default 1)
  NODE_RANK        this node's index, 0..NNODES-1  (default 0)
  MASTER_ADDR      host of node 0, for multi-node  (default 127.0.0.1)
  MASTER_PORT      port on node 0                  (default: a free one on one node, else 29500)
  OMP_NUM_THREADS  compute threads per rank        (default 1 on CPU)
  MAX_RESTARTS     torchrun --max-restarts: restart every worker after a failure, up to this
                   many times (default 0; the script must resume from its checkpoint)

Examples:
  ./launch.sh
  NPROC=4 ./launch.sh tutorials/02_naive_ddp.py
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh train.py   # then NODE_RANK=1 on node 1
  MAX_RESTARTS=2 ./launch.sh tutorials/06_failover.py --crash-at-step 7
  ./launch.sh --emulate-nodes 2 tutorials/07_multinode.py
  ./launch.sh --emulate-nodes 2 --link-rate 100mbit tutorials/07_multinode.py
EOF
}

fail_usage() { echo "launch.sh: $*; see ./launch.sh --help" >&2; exit 2; }

EMULATE_NODES=""
LINK_RATE=""
NETWORK=namespaces
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --emulate-nodes) EMULATE_NODES="${2:-}"; shift 2 || fail_usage "--emulate-nodes needs N" ;;
        --link-rate) LINK_RATE="${2:-}"; shift 2 || fail_usage "--link-rate needs a rate" ;;
        --loopback) NETWORK=loopback; shift ;;
        -*) fail_usage "unknown option $1" ;;
        *) break ;;  # the script and its own arguments
    esac
done
if [[ -n "$EMULATE_NODES" ]] && ! [[ "$EMULATE_NODES" =~ ^[0-9]+$ && "$EMULATE_NODES" -ge 2 ]]; then
    fail_usage "--emulate-nodes takes a number of nodes, 2 or more"
fi
if [[ -z "$EMULATE_NODES" && ( -n "$LINK_RATE" || "$NETWORK" == loopback ) ]]; then
    fail_usage "--link-rate and --loopback go with --emulate-nodes"
fi
# Every setting is checked here, at once: torchrun takes seconds to refuse a bad one, in a bare
# AssertionError, and a missing script only after starting every worker, in a ChildFailedError.
NPROC="${NPROC:-2}"
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    fail_usage "NPROC is the number of processes per node, a positive integer (got '$NPROC')"
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
if [[ -z "$EMULATE_NODES" ]]; then  # else ignored: the emulation sets them for each node
    if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
        fail_usage "NNODES is the number of nodes in the job, a positive integer (got '$NNODES')"
    fi
    if ! [[ "$NODE_RANK" =~ ^(0|[1-9][0-9]*)$ && "$NODE_RANK" -lt "$NNODES" ]]; then
        fail_usage "NODE_RANK is this node's index, 0 to $((NNODES - 1)) with NNODES=$NNODES" \
            "(got '$NODE_RANK')"
    fi
fi
if [[ -n "${MAX_RESTARTS:-}" ]] && ! [[ "$MAX_RESTARTS" =~ ^(0|[1-9][0-9]*)$ ]]; then
    fail_usage "MAX_RESTARTS is how many times torchrun may restart the workers, a whole" \
        "number >= 0 (got '$MAX_RESTARTS')"
fi
if [[ $# -eq 0 ]]; then set -- "$REPO_DIR/tutorials/03_bucketing.py"; fi
if [[ ! -f "$1" ]]; then
    what=$([[ -d "$1" ]] && echo "'$1' is a folder" || echo "there is no file '$1'")
    fail_usage "$what (looked in $PWD); give the path of a Python script, e.g." \
        "tutorials/02_naive_ddp.py"
fi

# Check from / so the current directory, which `python -c` puts on sys.path and torchrun's
# workers do not, cannot hide a missing install. find_spec finds a package without importing it:
# importing torch here would cost every launch ~2 s before torchrun has even started.
FIND='import importlib.util, sys; sys.exit(not importlib.util.find_spec(sys.argv[1]))'
if ! (cd / && python3 -c "$FIND" torch); then
    echo "launch.sh: torch is not installed; run: pip install torch==2.13.0" >&2
    exit 1
fi
if ! (cd / && python3 -c "$FIND" miniddp); then
    echo "launch.sh: miniddp is not installed; in $REPO_DIR run: pip install -e ." >&2
    exit 1
fi

# Two compute threads per rank on 2 cores made a DDP step ~15x slower: the ranks fight over the
# cores. torchrun sets 1 itself only when NPROC > 1, and with a warning; we say it up front.
# A GPU shows as a device file (/dev/nvidia0, or /dev/kfd for AMD's): without one, ranks are on
# the CPU.
if ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && [[ ! -e /dev/kfd ]]; then ON_CPU=1; fi
if [[ -n "${ON_CPU:-}" && -z "${OMP_NUM_THREADS:-}" ]]; then export OMP_NUM_THREADS=1; fi

# A chapter's simulated link (its --link, else $MINIDDP_LINK) is read here, once: read by every
# rank, a bad one was explained once per rank, after their start-up. Only chapters that take one
# (tutorials/common.py's add_link_option) are asked: another script's --link is its own business.
CHECK_LINKS='import sys
from miniddp.observe.link import BadLink, Link
for source, text in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        Link.parse(text)
    except BadLink as error:
        sys.exit(f"launch.sh: {source}: {error}")'
if grep -q "add_link_option" "$1"; then
    LINKS=()
    for (( i = 2; i <= $#; i++ )); do
        if [[ "${!i}" == --link ]]; then
            next=$((i + 1))
            LINKS+=(--link "${!next:-}")
        elif [[ "${!i}" == --link=* ]]; then
            LINKS+=(--link "${!i#--link=}")
        fi
    done
    if [[ ${#LINKS[@]} -eq 0 && -n "${MINIDDP_LINK:-}" ]]; then
        LINKS=('$MINIDDP_LINK' "$MINIDDP_LINK")
    fi
    if [[ ${#LINKS[@]} -gt 0 ]] && ! python3 -c "$CHECK_LINKS" "${LINKS[@]}"; then exit 2; fi
fi

if [[ -n "$EMULATE_NODES" ]]; then
    export NPROC LINK_RATE NETWORK
    exec "$REPO_DIR/scripts/emulate_nodes.sh" "$EMULATE_NODES" "$@"
fi

# Each node's agent counts its own restarts, so with several nodes init_distributed() cannot key
# each attempt's process group apart by that count (see miniddp/job/env.py); instead every attempt
# gets a fresh store, not the agents' shared one.
if [[ "$NNODES" != 1 ]]; then export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; fi
if [[ "$NNODES" == 1 && -z "${MASTER_PORT:-}" ]]; then
    RENDEZVOUS=(--standalone)  # torchrun starts its own rendezvous on a free local port
else
    RENDEZVOUS=(--nnodes="$NNODES" --node_rank="$NODE_RANK"
        --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}")
fi

COMMAND=(torchrun "${RENDEZVOUS[@]}" --nproc_per_node="$NPROC"
    ${MAX_RESTARTS:+--max-restarts="$MAX_RESTARTS"} "$@")
SHOWN_ENV="${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }"
SHOWN_ENV+="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:+TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 }"
echo "+ $SHOWN_ENV${COMMAND[*]}"
exec "${COMMAND[@]}"
