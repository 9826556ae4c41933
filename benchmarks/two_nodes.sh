#!/usr/bin/env bash
# The README's many-machine recipe, on one machine: two `ray start` nodes (1 CPU each, token
# authentication), `python -m engine cluster --address auto` on them, 16 concurrent chat
# requests through it; prints which replica served each and which node runs each replica.
# Run from the repository root in an environment with the cluster extra:
#   ROUTER=prefix bash benchmarks/two_nodes.sh      (ROUTER: prefix, session or pow2)
set -u
OUT=$(mktemp -d)
ray stop --force >/dev/null 2>&1
export RAY_TMPDIR="$OUT/ray" RAY_AUTH_MODE=token
[ -f ~/.ray/auth_token ] || ray get-auth-token --generate >/dev/null
ray start --head --port 6380 --num-cpus 1 --disable-usage-stats --include-dashboard false 2>&1 | tail -3
ray start --address 127.0.0.1:6380 --num-cpus 1 --node-manager-port 6700 --object-manager-port 6701 \
  --min-worker-port 12000 --max-worker-port 12999 --metrics-export-port 6702 \
  --dashboard-agent-listen-port 6703 --dashboard-agent-grpc-port 6704 --runtime-env-agent-port 6705 2>&1 | tail -3
python - <<'PY'
import ray; ray.init(address="127.0.0.1:6380", logging_level="ERROR")
print("nodes:", [(n["NodeID"][:8], n["Resources"].get("CPU")) for n in ray.nodes() if n["Alive"]])
PY
t0=$(date +%s.%N)
RAY_ADDRESS=127.0.0.1:6380 python -m engine cluster --address auto --replicas 2 --port 8123 --router ${ROUTER:-prefix} > "$OUT/cluster.log" 2>&1 &
CPID=$!
for i in $(seq 1 120); do curl -sf localhost:8123/health >/dev/null && break; sleep 0.5; done
echo "health after $(python -c "print(round($(date +%s.%N)-$t0,1))") s"
MODEL=$(curl -s localhost:8123/v1/models | python -c "import json,sys;print(json.load(sys.stdin)['data'][0]['id'])")
echo "model: $MODEL"
PIDS=""; for i in $(seq 1 16); do
  (curl -s -D - -o "$OUT/body.$i" localhost:8123/v1/chat/completions -H 'content-type: application/json' -H "x-session-id: s$i" \
    -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"Question $i: name a colour.\"}],\"max_tokens\":96}" \
    | grep -i -E "^HTTP|x-engine-replica" | tr -d '\r' | tr '\n' ' '; echo) & PIDS="$PIDS $!"
done; wait $PIDS
python - <<'PY'
import ray; ray.init(address="127.0.0.1:6380", logging_level="ERROR")
from ray._private.state import actors
for a in actors().values():
    if a["State"] == "ALIVE" and "ServeReplica" in a["ActorClassName"]:
        print(a["ActorClassName"], a.get("Name", "")[-30:], "pid", a["Pid"], "node", a["Address"]["NodeID"][:8])
PY
t1=$(date +%s.%N); kill -TERM $CPID; wait $CPID; echo "cluster exited $? after $(python -c "print(round($(date +%s.%N)-$t1,1))") s"; ray stop --force >/dev/null 2>&1; echo "stopped (logs: $OUT)"
