#!/usr/bin/env bash
# A two-node cluster on one machine: two network namespaces joined by a rate-limited veth pair,
# one torchrun node (--nproc-per-node processes, gloo) in each, talking across hosts only over
# the veth link (the processes of one node reach each other on the namespace's own addresses,
# which the kernel routes locally, off the rate-limited link).
#
#   sudo scripts/netns_cluster.sh [options] [-- example args...]
#
#   scripts/netns_cluster.sh --rate 1gbit -- --comm lossy --steps 200 --metrics-json m.json
#   scripts/netns_cluster.sh --measure           # only measure the link (TCP, 3 s) and exit
#
# Options (each also settable through the environment variable in brackets):
#   --rate R        tbf rate on both ends of the link [NETNS_RATE, default 1gbit]
#   --burst B       tbf burst [NETNS_BURST, default 256kb]
#   --latency L     tbf latency (queueing limit) [NETNS_LATENCY, default 50ms]
#   --delay D       one-way netem delay on both ends, e.g. 1ms (needs sch_netem in the kernel)
#                   [NETNS_DELAY, default 0: none]
#   --subnet S      first three octets of the private /24 [NETNS_SUBNET, default 10.231.7]
#   --port P        rendezvous port [NETNS_PORT, default 29577]
#   --nproc-per-node N  training processes per node, i.e. ranks per host (torchrun sets
#                   LOCAL_WORLD_SIZE=N) [NETNS_NPROC, default 1]
#   --script F      the training script [NETNS_SCRIPT, default examples/dlrm_criteo.py]
#   --torchrun T    torchrun binary [TORCHRUN, default .venv/bin/torchrun]
#   --log-dir D     where node 1's output goes [NETNS_LOG_DIR, default a temp folder]
#   --measure       measure the link's TCP throughput instead of training
#
# Extra torchrun flags (e.g. --max-restarts 1) go in TORCHRUN_ARGS. Node 0's output is this
# script's output; node 1's is in the log folder (printed if node 1 fails). NETNS_GRACE (60)
# is how long node 1 may outlive node 0 before it is stopped.
#
# Needs root and iproute2 (`apt-get update && apt-get install -y iproute2`). The namespaces and
# the veth pair are named after this script's PID, only those are ever touched, and they are
# deleted on exit, also when the job fails or is interrupted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RATE="${NETNS_RATE:-1gbit}"
BURST="${NETNS_BURST:-256kb}"
LATENCY="${NETNS_LATENCY:-50ms}"
DELAY="${NETNS_DELAY:-0}"
SUBNET="${NETNS_SUBNET:-10.231.7}"
PORT="${NETNS_PORT:-29577}"
NPROC="${NETNS_NPROC:-1}"
SCRIPT="${NETNS_SCRIPT:-examples/dlrm_criteo.py}"
TORCHRUN="${TORCHRUN:-$ROOT/.venv/bin/torchrun}"
LOG_DIR="${NETNS_LOG_DIR:-}"
MEASURE=0

die() {
  echo "netns_cluster: $*" >&2
  exit 2
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --rate) RATE="$2"; shift 2 ;;
    --burst) BURST="$2"; shift 2 ;;
    --latency) LATENCY="$2"; shift 2 ;;
    --delay) DELAY="$2"; shift 2 ;;
    --subnet) SUBNET="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --nproc-per-node) NPROC="$2"; shift 2 ;;
    --script) SCRIPT="$2"; shift 2 ;;
    --torchrun) TORCHRUN="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --measure) MEASURE=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

EXAMPLE_ARGS=("$@")
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node $NPROC: use a positive integer"

[[ "$(id -u)" -eq 0 ]] || die "needs root (network namespaces and tc)"
command -v ip >/dev/null || die "'ip' not found: apt-get update && apt-get install -y iproute2"
command -v tc >/dev/null || die "'tc' not found: apt-get update && apt-get install -y iproute2"
[[ -x "$TORCHRUN" ]] || die "torchrun not found at $TORCHRUN (set TORCHRUN)"
PYTHON="$(dirname "$TORCHRUN")/python"

TAG="trl$$"
NS0="${TAG}n0"
NS1="${TAG}n1"
VETH0="${TAG}v0"  # interface names stay under Linux's 15-character limit
VETH1="${TAG}v1"
ADDR0="${SUBNET}.1"
ADDR1="${SUBNET}.2"
if [[ -z "$LOG_DIR" ]]; then
  LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/netns_cluster.XXXXXX")"
fi
mkdir -p "$LOG_DIR"
PIDS=()

kill_ns() {  # kill_ns NS: stop every process inside one of our namespaces
  local pids
  pids="$(ip netns pids "$1" 2>/dev/null || true)"
  [[ -z "$pids" ]] && return 0
  # shellcheck disable=SC2086  # a list of PIDs
  kill -TERM $pids 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pids="$(ip netns pids "$1" 2>/dev/null || true)"
    [[ -z "$pids" ]] && return 0
    sleep 0.5
  done
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # Only processes inside the two namespaces this script created are touched.
  kill_ns "$NS0"
  kill_ns "$NS1"
  for pid in "${PIDS[@]:-}"; do
    [[ -n "$pid" ]] && wait "$pid" 2>/dev/null || true
  done
  # Deleting a namespace deletes the veth end inside it (and so the pair).
  ip netns del "$NS0" 2>/dev/null || true
  ip netns del "$NS1" 2>/dev/null || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

shape() {  # shape NS DEV: delay (optional) then the token bucket
  local ns="$1" dev="$2"
  if [[ "$DELAY" != "0" && -n "$DELAY" ]]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$DELAY" ||
      die "netem is not available in this kernel: leave --delay at 0"
    tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$RATE" burst "$BURST" \
      latency "$LATENCY"
  else
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
  fi
}

ip netns add "$NS0"
ip netns add "$NS1"
ip link add "$VETH0" type veth peer name "$VETH1"
ip link set "$VETH0" netns "$NS0"
ip link set "$VETH1" netns "$NS1"
ip -n "$NS0" addr add "$ADDR0/24" dev "$VETH0"
ip -n "$NS1" addr add "$ADDR1/24" dev "$VETH1"
for ns in "$NS0" "$NS1"; do
  ip -n "$ns" link set lo up
done
ip -n "$NS0" link set "$VETH0" up
ip -n "$NS1" link set "$VETH1" up
shape "$NS0" "$VETH0"
shape "$NS1" "$VETH1"
echo "netns_cluster: $NS0 ($ADDR0) <-> $NS1 ($ADDR1), tbf rate $RATE burst $BURST" \
  "latency $LATENCY, delay $DELAY, $NPROC process(es) per node; logs in $LOG_DIR" >&2

if [[ "$MEASURE" -eq 1 ]]; then
  # A plain TCP stream for 3 s, ns1 -> ns0, with the venv's Python (no iperf needed).
  ip netns exec "$NS0" "$PYTHON" - "$ADDR0" "$PORT" <<'PY' &
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
conn, _ = srv.accept(); n = 0; t0 = None
while True:
    b = conn.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.perf_counter(); n += len(b)
dt = time.perf_counter() - t0
print(f"netns_cluster: TCP {n * 8 / dt / 1e9:.3f} Gbit/s ({n / 1e6:.0f} MB in {dt:.2f} s)")
PY
  PIDS+=($!)
  sleep 1
  ip netns exec "$NS1" "$PYTHON" - "$ADDR0" "$PORT" <<'PY'
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"\0" * (1 << 20)
end = time.perf_counter() + 3.0
while time.perf_counter() < end:
    s.sendall(buf)
s.close()
PY
  wait "${PIDS[0]}"
  PIDS=()
  exit 0
fi

cd "$ROOT"
run_node() {  # run_node RANK NS DEV: one torchrun node inside its namespace
  local rank="$1" ns="$2" dev="$3"
  # shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
  ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "$TORCHRUN" --nnodes 2 --node-rank "$rank" --nproc-per-node "$NPROC" \
    --master-addr "$ADDR0" --master-port "$PORT" ${TORCHRUN_ARGS:-} \
    "$SCRIPT" "${EXAMPLE_ARGS[@]}"
}
# Both nodes run in the background (so that a signal reaches the trap at once); node 0's log is
# followed on this script's output, node 1's goes to its file.
run_node 1 "$NS1" "$VETH1" >"$LOG_DIR/node1.log" 2>&1 &
NODE1=$!
run_node 0 "$NS0" "$VETH0" >"$LOG_DIR/node0.log" 2>&1 &
NODE0=$!
PIDS+=("$NODE1" "$NODE0")
tail -n +1 -f --pid="$NODE0" "$LOG_DIR/node0.log" &
TAIL=$!
set +e
wait "$NODE0"
rc0=$?
wait "$TAIL" 2>/dev/null
# Node 1 normally ends with node 0; if it does not within the grace period (e.g. its agent
# waits for a rendezvous store that left with node 0), stop it.
grace="${NETNS_GRACE:-60}"
for ((i = 0; i < grace * 2; i++)); do
  kill -0 "$NODE1" 2>/dev/null || break
  sleep 0.5
done
if kill -0 "$NODE1" 2>/dev/null; then
  echo "netns_cluster: node 1 still running ${grace}s after node 0 ended; stopping it" >&2
  kill_ns "$NS1"
fi
wait "$NODE1"
rc1=$?
set -e
PIDS=()
if [[ $rc1 -ne 0 ]]; then
  echo "netns_cluster: node 1 failed (exit $rc1); its log ($LOG_DIR/node1.log) ends:" >&2
  tail -n 40 "$LOG_DIR/node1.log" >&2
fi
if [[ $rc0 -ne 0 ]]; then
  exit "$rc0"
fi
exit "$rc1"
