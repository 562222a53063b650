#!/usr/bin/env bash
# A local two-node Ray cluster on loopback, with the Serve app deployed onto it.
#
#   cluster/local_cluster.sh start [SERVE_CONFIG]   # default deployments/app.yaml; then http://127.0.0.1:8000
#   cluster/local_cluster.sh status
#   cluster/local_cluster.sh stop
#
# Node 1 (head) and node 2 each get their own logical CPUs and a custom resource (node_head / node_worker), so a
# config can pin actors to a node, e.g. `target_resources: {num_cpus: 1, resources: {node_worker: 1}}`. With the
# default app.yaml the replica's placement group (router 0.5 + draft 0.5 CPU, target 1 CPU) does not fit on one
# node of 1 CPU, so PACK spreads it: router and draft on the head, the target on node 2.
# Environment: HEAD_CPUS, WORKER_CPUS (logical CPUs per node, default 1), HEAD_PORT (GCS, default 6390),
# DASHBOARD_PORT (default 8265), VENV (default .venv of this repo).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
RAY="$VENV/bin/ray"
SERVE="$VENV/bin/serve"
HEAD_PORT="${HEAD_PORT:-6390}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
HEAD_CPUS="${HEAD_CPUS:-1}"
WORKER_CPUS="${WORKER_CPUS:-1}"
ADDRESS="127.0.0.1:$HEAD_PORT"
# workers import `deployments` (and `specserve`, if not installed) from the checkout
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# token authentication for every node and client (the token lives in ~/.ray/auth_token)
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

start() {
  local config
  config="$(realpath -m "${1:-$REPO/deployments/app.yaml}")" # the caller's relative path, before the cd below
  if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && ! -s "$HOME/.ray/auth_token" ]]; then
    "$RAY" get-auth-token --generate >/dev/null
  fi
  "$RAY" start --head --node-ip-address=127.0.0.1 --port="$HEAD_PORT" --num-cpus="$HEAD_CPUS" --num-gpus=0 \
    --resources='{"node_head": 1}' --include-dashboard=true --dashboard-host=127.0.0.1 \
    --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats
  # a second raylet on the same host: it needs its own agent ports
  "$RAY" start --address="$ADDRESS" --node-ip-address=127.0.0.1 --num-cpus="$WORKER_CPUS" --num-gpus=0 \
    --resources='{"node_worker": 1}' --dashboard-agent-listen-port=52366 --disable-usage-stats
  (cd "$REPO" && "$SERVE" deploy "$config" --address "http://127.0.0.1:$DASHBOARD_PORT")
  echo "deploying $config; progress: $0 status; then: curl http://127.0.0.1:8000/health"
}

status() {
  "$RAY" status --address="$ADDRESS"
  "$SERVE" status --address "http://127.0.0.1:$DASHBOARD_PORT"
}

stop() {
  "$SERVE" shutdown --yes --address "http://127.0.0.1:$DASHBOARD_PORT" || true
  "$RAY" stop
}

case "${1:-}" in
  start) shift; start "$@" ;;
  status) status ;;
  stop) stop ;;
  *) echo "usage: $0 start [SERVE_CONFIG] | status | stop" >&2; exit 2 ;;
esac
