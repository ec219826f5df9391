#!/usr/bin/env bash
# Faults under load on `llmserve up` (docs/reliability.md): a soak at RATE req/s for DURATION s;
# the chat model's backend stub is SIGKILLed at KILL_STUB_AT s and tritonserver itself at
# KILL_SERVER_AT s. The soak's JSON counts every request by outcome; the watchdog's log lines
# give the recovery times.
# usage: scripts/reliability/kill_under_soak.sh OUT_PREFIX [RATE] [DURATION] [KILL_STUB_AT] [KILL_SERVER_AT]
set -euo pipefail
out=${1:?usage: $0 OUT_PREFIX [RATE] [DURATION] [KILL_STUB_AT] [KILL_SERVER_AT]}
rate=${2:-1.0}; duration=${3:-240}; stub_at=${4:-60}; server_at=${5:-150}
port=${PORT:-18180}; http=$((port + 1)); grpc=$((port + 2)); metrics=$((port + 3))
workdir=$(mktemp -d)
llmserve=${LLMSERVE:-.venv/bin/llmserve}
$llmserve up --port "$port" --triton-http-port $http --triton-grpc-port $grpc --triton-metrics-port $metrics \
    --workdir "$workdir" >"$out.up.log" 2>&1 &
up_pid=$!
trap 'kill -TERM $up_pid 2>/dev/null; wait $up_pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" | grep -q '"chat":{[^}]*true'; do sleep 1; done
echo "platform up (pid $up_pid)"
$llmserve bench soak --base-url "http://127.0.0.1:$port" --model chat --rate "$rate" --duration "$duration" \
    --window 30 --ttft-slo-ms 3000 --tpot-slo-ms 250 --pids $up_pid --output-json "$out.json" --plot "$out.png" &
soak=$!
sleep "$stub_at"
stub=$(pgrep -f "$workdir/model_repository/chat/1/model.py")
echo "$(date -u +%T) SIGKILL chat stub $stub"; kill -9 "$stub"
sleep $((server_at - stub_at))
server=$(pgrep -f "http-port=$http")
echo "$(date -u +%T) SIGKILL tritonserver $server"; kill -9 "$server"
wait $soak
grep -h "watchdog" "$out.up.log"
