#!/usr/bin/env bash
# Runs SCRIPT as a NODES-node torchrun job on this one machine: `./launch.sh --emulate-nodes N`
# calls it after its own checks (see `./launch.sh --help`).
#
# Each "node" is one torchrun agent starting NPROC workers; the agents meet through c10d
# rendezvous, as on a cluster. As root, with `ip netns` working and 2 nodes, each node gets a
# network namespace of its own, joined to the other by a veth pair:
#
#     namespace mddp-<pid>-node0            namespace mddp-<pid>-node1
#     veth0 10.213.7.1/30  <---- veth ---->  veth1 10.213.7.2/30
#
# so each node has its own address and interface, and `tc` can slow the link between them.
# Otherwise (or with NETWORK=loopback) the agents share this machine's loopback, and it says so.
# The namespaces, and every process in them, are removed on exit, Ctrl-C included.
#
# Usage: scripts/emulate_nodes.sh NODES SCRIPT [ARGS...]
# Environment: NPROC (processes per node, default 2), LINK_RATE (e.g. 100mbit: cap the link with
# a tbf qdisc on both ends; namespaces only), NETWORK (namespaces or loopback).
set -euo pipefail

NODES="$1"
shift
NPROC="${NPROC:-2}"
NETWORK="${NETWORK:-namespaces}"
LINK_RATE="${LINK_RATE:-}"
PREFIX="mddp-$$"  # our namespaces, and the rendezvous id: unique per launch
SUBNET=10.213.7   # a private /30, used only inside the namespaces created here
RDZV_PORT=29500   # free in a fresh namespace; on loopback a free port is picked below

AGENTS=()      # process ids of the torchrun agents, one per node
declare -A NODE_OF=()  # agent's process id -> its node
STORE=()       # process id of the rendezvous store
NAMESPACES=()  # namespaces created so far, so cleanup removes exactly those

say() { echo "launch.sh: $*" >&2; }

why_not_namespaces() {
    if [[ "$NETWORK" == loopback ]]; then echo "--loopback was given"
    elif [[ "$NODES" != 2 ]]; then echo "namespaces here emulate exactly 2 nodes (one veth pair)"
    elif [[ "$EUID" -ne 0 ]]; then echo "network namespaces need root"
    elif ! command -v ip >/dev/null; then echo "the ip command (iproute2) is missing"
    elif ! ip netns add "$PREFIX-probe" 2>/dev/null; then echo "ip netns does not work here"
    else ip netns delete "$PREFIX-probe"; return 1
    fi
}

# tbf sends at most RATE on average, letting through bursts of up to BURST bytes. The burst must
# hold at least one whole packet, and veth hands over segments of up to 64 KiB; beyond that, 10 ms
# at full rate keeps the cap honest for the short bursts gradients come in.
tbf_burst() {
    if ! [[ "${LINK_RATE,,}" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]]; then
        say "--link-rate takes a whole number then kbit, mbit or gbit, e.g. 100mbit"
        exit 2
    fi
    local -A unit=([kbit]=1000 [mbit]=1000000 [gbit]=1000000000)
    local bytes=$(( BASH_REMATCH[1] * unit[${BASH_REMATCH[2]}] / 8 / 100 ))
    echo $(( bytes > 65536 ? bytes : 65536 ))
}

create_namespaces() {
    local node namespace
    for node in 0 1; do
        namespace="$PREFIX-node$node"
        NAMESPACES+=("$namespace")  # first, so an interrupt right after `add` still removes it
        ip netns add "$namespace"
        ip -n "$namespace" link set lo up
        # `ip netns exec` shows this file as the namespace's /etc/hosts. Without names for the
        # addresses (also as IPv6-mapped, which is how the store's sockets see them), torch warns
        # about every store connection: "The hostname of the client socket cannot be retrieved".
        mkdir -p "/etc/netns/$namespace"
        printf '%s\n' "127.0.0.1 localhost" "$SUBNET.1 node0" "$SUBNET.2 node1" \
            "::ffff:$SUBNET.1 node0" "::ffff:$SUBNET.2 node1" >"/etc/netns/$namespace/hosts"
    done
    # Both ends are created straight inside the namespaces: nothing touches the host's network.
    ip link add veth0 netns "$PREFIX-node0" type veth peer name veth1 netns "$PREFIX-node1"
    for node in 0 1; do
        namespace="$PREFIX-node$node"
        ip -n "$namespace" addr add "$SUBNET.$((node + 1))/30" dev "veth$node"
        ip -n "$namespace" link set "veth$node" up
        if [[ -n "$LINK_RATE" ]]; then  # each end shapes what it sends: both directions capped
            tc -n "$namespace" qdisc add dev "veth$node" root tbf rate "$LINK_RATE" \
                burst "$(tbf_burst)" latency 100ms
        fi
    done
}

# Stop what this launch started: agents first (torchrun stops its workers on SIGTERM), then
# anything left in our namespaces, then the namespaces (the veth pair goes with them).
cleanup() {
    trap - EXIT INT TERM
    local pid namespace waited=0
    for pid in "${AGENTS[@]}" "${STORE[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    while (( waited < 50 )) && any_alive; do sleep 0.2; waited=$((waited + 1)); done
    for pid in "${AGENTS[@]}" "${STORE[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    for namespace in "${NAMESPACES[@]}"; do
        for pid in $(ip netns pids "$namespace" 2>/dev/null); do kill -KILL "$pid" || true; done
        ip netns delete "$namespace" 2>/dev/null || true
        rm -rf "/etc/netns/$namespace"
    done
    rmdir /etc/netns 2>/dev/null || true  # only if no other namespace has files there
}

any_alive() {
    local pid
    for pid in "${AGENTS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then return 0; fi
    done
    return 1
}

trap cleanup EXIT
trap 'say "interrupted: stopping the nodes"; exit 130' INT
trap 'say "terminated: stopping the nodes"; exit 143' TERM

if reason=$(why_not_namespaces); then
    say "emulating $NODES nodes on loopback, without network namespaces ($reason)"
    if [[ -n "$LINK_RATE" ]]; then
        say "--link-rate $LINK_RATE ignored: loopback is shared with every program on this" \
            "machine, so it is not slowed down"
        LINK_RATE=""
    fi
    NETWORK=loopback
    RDZV_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
    HOST_ADDR=127.0.0.1
else
    NETWORK=namespaces
    [[ -n "$LINK_RATE" ]] && tbf_burst >/dev/null  # a bad rate stops us before anything exists
    create_namespaces
    say "emulating 2 nodes in network namespaces $PREFIX-node0 ($SUBNET.1) and" \
        "$PREFIX-node1 ($SUBNET.2), joined by a veth pair${LINK_RATE:+ capped at $LINK_RATE}"
    HOST_ADDR="$SUBNET.1"
fi
export MINIDDP_LINK_RATE="$LINK_RATE"  # lets the script say what link it ran on

# How each node's commands start: in its namespace, or here with loopback. Every attempt gets a
# fresh store, not the agents' shared one: each agent counts its own restarts, so the nodes could
# not agree on a per-attempt key prefix (see miniddp/job/env.py).
enter_node() {
    if [[ "$NETWORK" == namespaces ]]; then
        # gloo picks its interface by the hostname, which resolves to 127.0.0.1: name the veth.
        ENTER=(ip netns exec "$PREFIX-node$1" env "GLOO_SOCKET_IFNAME=veth$1")
        ADDRESS="$SUBNET.$(($1 + 1))"
    else
        ENTER=(env GLOO_SOCKET_IFNAME=lo)
        ADDRESS=127.0.0.1
    fi
    ENTER+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
}

# The rendezvous store, where agents meet and workers find each other, runs on node 0 as a
# process of its own for the whole job, like etcd on a cluster. torchrun's alternative, node 0's
# agent hosting it (is_host=true), takes it away as soon as node 0 finishes, and the other agents
# then print a long "failed to shutdown the rendezvous" traceback.
enter_node 0
STORE_SERVER='import signal, sys
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)
signal.pause()'
setsid "${ENTER[@]}" python3 -c "$STORE_SERVER" "$HOST_ADDR" "$RDZV_PORT" &
STORE=("$!")
disown  # stopped by cleanup; no "Terminated" notice from bash

for (( node = 0; node < NODES; node++ )); do
    enter_node "$node"
    command=("${ENTER[@]}" torchrun --nnodes="$NODES" --nproc_per_node="$NPROC"
        --rdzv_backend=c10d --rdzv_endpoint="$HOST_ADDR:$RDZV_PORT" --rdzv_id="$PREFIX"
        --local_addr="$ADDRESS" --rdzv_conf=is_host=false "$@")
    echo "+ ${command[*]}"
    # setsid: the agent and its workers form a group of their own, stopped together by cleanup.
    # Node 0's output (where rank 0 prints) goes straight through; other nodes' lines are tagged.
    if (( node == 0 )); then
        setsid "${command[@]}" &
    else
        setsid "${command[@]}" > >(sed -u "s/^/[node $node] /") 2>&1 &
    fi
    AGENTS+=("$!")
    NODE_OF[$!]="$node"
done

# When a node fails, the others get FAILED_NODE_GRACE_S to end on their own, as on a cluster where
# nothing would stop them: their ranks notice and say what they saw (MiniDDP names the missing
# rank). Whatever still runs after that is stopped: it could wait for the lost node until its
# timeout.
FAILED_NODE_GRACE_S=10
status=0
running=("${AGENTS[@]}")
while (( ${#running[@]} > 0 )); do
    finished=""
    wait -n -p finished "${running[@]}" || status=$?
    still_running=()
    for pid in "${running[@]}"; do
        if [[ "$pid" != "$finished" ]]; then still_running+=("$pid"); fi
    done
    running=("${still_running[@]}")
    if (( status != 0 )); then
        say "node ${NODE_OF[$finished]}'s torchrun exited with status $status; the other nodes" \
            "get ${FAILED_NODE_GRACE_S} s to end on their own"
        for (( tick = 0; tick < FAILED_NODE_GRACE_S * 5; tick++ )); do
            any_alive || break
            sleep 0.2
        done
        break
    fi
done
exit "$status"
