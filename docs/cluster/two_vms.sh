#!/usr/bin/env bash
# Run one node of a two-machine torchrun job. The same command on both VMs, each with its own
# NODE_RANK; docs/cluster.md says what to set up first (network, ports, storage).
#
#   on VM 0:  NODE_RANK=0 NODE0_ADDR=10.0.0.4 docs/cluster/two_vms.sh tutorials/08_template.py
#   on VM 1:  NODE_RANK=1 NODE0_ADDR=10.0.0.4 docs/cluster/two_vms.sh tutorials/08_template.py
#
# Environment:
#   NODE_RANK     0 on the VM that hosts the rendezvous, 1 on the other        (required)
#   NODE0_ADDR    VM 0's private address, the rendezvous endpoint's host        (required)
#   NPROC         processes on this VM: "gpu" = one per GPU, or a number        (default gpu)
#   RDZV_PORT     the rendezvous port on VM 0; open it between the VMs          (default 29400)
#   RDZV_ID       any name, the same on both VMs: it tells jobs apart           (default two-vms)
#   MAX_RESTARTS  restart every worker after a failure, this many times         (default 0)
#
# It works out this VM's private address (the one it uses to reach VM 0) and the interface that
# holds it, and tells torchrun, gloo and NCCL to use them: a VM's hostname often resolves to
# 127.0.1.1 (Debian and Ubuntu's /etc/hosts), and NCCL may pick a docker or VPN interface.
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK=0 on the first VM and NODE_RANK=1 on the second}"
: "${NODE0_ADDR:?set NODE0_ADDR to the private address of the first VM, e.g. 10.0.0.4}"
if [[ $# -eq 0 ]]; then
    echo "usage: NODE_RANK=0|1 NODE0_ADDR=ADDRESS $0 SCRIPT [ARGS...]" >&2
    exit 2
fi

if [[ "$NODE_RANK" == 0 ]]; then
    THIS_ADDR="$NODE0_ADDR"
    IS_HOST=true  # this node's agent runs the rendezvous store, at NODE0_ADDR:RDZV_PORT
else
    # The source address of the route towards VM 0: this VM's address on the shared network.
    THIS_ADDR=$(ip -4 route get "$NODE0_ADDR" | sed -n 's/.* src \([0-9.]*\).*/\1/p')
    IS_HOST=false
fi
IFNAME=$(ip -o -4 addr show | awk -v address="$THIS_ADDR" 'index($4, address "/") == 1 { print $2 }')
if [[ -z "$THIS_ADDR" || -z "$IFNAME" ]]; then
    echo "$0: no interface of this machine holds '$THIS_ADDR'; is NODE0_ADDR ($NODE0_ADDR)" \
        "right and reachable?" >&2
    exit 1
fi

export GLOO_SOCKET_IFNAME="$IFNAME" NCCL_SOCKET_IFNAME="$IFNAME"
# Every restart attempt gets a fresh store for the workers, not the agents' shared one, whose
# keys from the dead attempt would mislead the new process group (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

COMMAND=(torchrun --nnodes=2 --nproc_per_node="${NPROC:-gpu}"
    --rdzv_backend=c10d --rdzv_endpoint="$NODE0_ADDR:${RDZV_PORT:-29400}"
    --rdzv_id="${RDZV_ID:-two-vms}" --local_addr="$THIS_ADDR" --rdzv_conf=is_host="$IS_HOST"
    --max-restarts="${MAX_RESTARTS:-0}" "$@")
echo "+ GLOO_SOCKET_IFNAME=$IFNAME NCCL_SOCKET_IFNAME=$IFNAME ${COMMAND[*]}"
exec "${COMMAND[@]}"
