#!/usr/bin/env bash
# gradwatch demo: installs what is missing, builds, runs the daemon on an incident-shaped run.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: deploy/demo.sh [--serve] [--keep] [--help]

Installs the Debian packages listed in deploy/packages.txt that are missing (needs root then),
builds gradwatch into build/ (Release), starts gradwatchd with deploy/gradwatchd.yaml, replays an
incident-shaped training run (deploy/examples/make_incident_run.py) into it, shows the run with the
`gradwatch` CLI, a few of its /metrics lines and its alerts, then lets the run go on untreated
until the total grad norm reaches 5 and the contingency pages (with its recommendation), replays
the run remedied instead at step 110,100 (weight decay 0.1 on final_norm.weight) and shows the
remedy checked against the what-if made then, and stops the daemon with SIGTERM.

Options:
  --serve   leave the daemon running at the end and print its PID and how to stop it
  --keep    keep the data of a previous demo in the data folder instead of starting afresh
  --help    show this help

Environment:
  GRADWATCH_DEMO_DIR   the daemon's data folder (default /tmp/gradwatch-demo); it must be empty,
                       absent, or a folder an earlier demo made (such a folder is emptied unless --keep)
EOF
}

serve=false
keep=false
for arg in "$@"; do
  case "$arg" in
    --serve) serve=true ;;
    --keep) keep=true ;;
    -h | --help) usage; exit 0 ;;
    *) printf 'unknown argument: %s\n\n' "$arg" >&2; usage >&2; exit 2 ;;
  esac
done

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$GW_REPO_ROOT"

readonly RUN_ID=moe-incident-demo
readonly BUILD_DIR="$GW_REPO_ROOT/build"
readonly DAEMON="$BUILD_DIR/server/gradwatchd"
readonly CLI="$BUILD_DIR/client/gradwatch"
readonly CONFIG="$GW_REPO_ROOT/deploy/gradwatchd.yaml"
readonly READY_TIMEOUT_SECONDS=30
readonly STOP_TIMEOUT_SECONDS=20
data_dir="${GRADWATCH_DEMO_DIR:-/tmp/gradwatch-demo}"
readonly MARKER=".gradwatch-demo"

daemon_pid=""
work_dir=""
cleanup() {
  local status=$?
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    gw_log "stopping gradwatchd (pid $daemon_pid) after a failure"
    kill -TERM "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$daemon_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$daemon_pid" 2>/dev/null || true
  fi
  if [[ -n "$work_dir" ]]; then
    rm -rf -- "$work_dir"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

show_log_tail() {
  if [[ -f "$data_dir/gradwatchd.log" ]]; then
    gw_log "last lines of $data_dir/gradwatchd.log:"
    tail -n 30 "$data_dir/gradwatchd.log" >&2 || true
  fi
}

# Prints the value of one key of the ready file, or fails while it is absent or incomplete.
ready_value() {
  "$GW_PYTHON" - "$data_dir/ready.json" "$1" <<'EOF' 2>/dev/null
import json, sys
with open(sys.argv[1], encoding="utf-8") as f:
    print(int(json.load(f)[sys.argv[2]]))
EOF
}

prepare_data_dir() {
  if [[ -f "$data_dir/ready.json" ]]; then
    local old_pid
    old_pid="$(ready_value pid || true)"
    if [[ -n "$old_pid" ]] && kill -0 "$old_pid" 2>/dev/null; then
      gw_die "a gradwatchd (pid $old_pid) is already running on $data_dir: stop it with 'kill $old_pid'"
    fi
  fi
  if [[ -d "$data_dir" && -n "$(ls -A "$data_dir")" ]]; then
    if [[ ! -f "$data_dir/$MARKER" ]]; then
      gw_die "$data_dir is not empty and was not made by this demo: set GRADWATCH_DEMO_DIR to another folder"
    fi
    if [[ "$keep" == false ]]; then
      gw_log "removing the previous demo's data in $data_dir (use --keep to keep it)"
      find "$data_dir" -mindepth 1 -delete
    fi
  fi
  mkdir -p "$data_dir"
  touch "$data_dir/$MARKER"
  rm -f "$data_dir/ready.json"
}

gw_ensure_packages "$GW_REPO_ROOT/deploy/packages.txt"
gw_build "$BUILD_DIR" Release -DGRADWATCH_BUILD_TESTS=OFF
[[ -x "$DAEMON" ]] || gw_die "build did not produce $DAEMON"
[[ -x "$CLI" ]] || gw_die "build did not produce $CLI"

work_dir="$(mktemp -d -t gradwatch-demo-run.XXXXXX)"
run_file="$work_dir/$RUN_ID.jsonl"
"$GW_PYTHON" "$GW_REPO_ROOT/deploy/examples/make_incident_run.py" --out "$run_file"
gw_log "generated $run_file ($(wc -l <"$run_file") lines)"
later_file="$work_dir/$RUN_ID-untreated.jsonl"
"$GW_PYTHON" "$GW_REPO_ROOT/deploy/examples/make_incident_run.py" --out "$later_file" \
  --from-step 110100 --to-step 600000 --every 100
gw_log "generated $later_file ($(wc -l <"$later_file") lines)"
remedied_file="$work_dir/$RUN_ID-remedied.jsonl"
"$GW_PYTHON" "$GW_REPO_ROOT/deploy/examples/make_incident_run.py" --out "$remedied_file" \
  --from-step 110100 --to-step 200000 --every 100 --remedy-weight-decay 0.1
gw_log "generated $remedied_file ($(wc -l <"$remedied_file") lines)"

prepare_data_dir
gw_log "starting gradwatchd on $data_dir (log: $data_dir/gradwatchd.log)"
daemon_args=(--config "$CONFIG" --data-dir "$data_dir" --ready-file "$data_dir/ready.json")
if [[ "$serve" == true ]]; then
  # Its own session, so it outlives this script and the terminal.
  setsid "$DAEMON" "${daemon_args[@]}" </dev/null >>"$data_dir/gradwatchd.log" 2>&1 &
else
  "$DAEMON" "${daemon_args[@]}" </dev/null >>"$data_dir/gradwatchd.log" 2>&1 &
fi
daemon_pid=$!

deadline=$((SECONDS + READY_TIMEOUT_SECONDS))
until grpc_port="$(ready_value grpc_port)" && metrics_port="$(ready_value metrics_port)"; do
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    show_log_tail
    gw_die "gradwatchd exited before it was ready"
  fi
  if ((SECONDS >= deadline)); then
    show_log_tail
    gw_die "gradwatchd was not ready within ${READY_TIMEOUT_SECONDS}s"
  fi
  sleep 0.1
done
gw_log "gradwatchd (pid $daemon_pid) is ready: gRPC on 127.0.0.1:$grpc_port, /metrics on 127.0.0.1:$metrics_port"
# The CLI defaults to 127.0.0.1:7390 (the config's port); say where the daemon really is.
export GRADWATCH_ADDR="127.0.0.1:$grpc_port"

echo
echo "\$ gradwatch replay $RUN_ID.jsonl --max"
"$CLI" replay "$run_file" --max
echo
echo "\$ gradwatch runs"
"$CLI" runs
echo
echo "\$ gradwatch show $RUN_ID"
"$CLI" show "$RUN_ID"
echo
metrics_url="http://127.0.0.1:$metrics_port/metrics"
echo "\$ curl -s $metrics_url | grep $RUN_ID | head"
metrics="$(curl -fsS --max-time 10 "$metrics_url")"
awk -v run="$RUN_ID" 'index($0, run) && n < 12 { print; n++ }' <<<"$metrics"
echo
echo "Prometheus metrics: $metrics_url (scrape it, or curl it as above)"
echo "Run view (charts, alerts; what alerts link to): http://127.0.0.1:$metrics_port/runs/$RUN_ID"
echo "Incident report: $CLI --addr 127.0.0.1:$grpc_port report $RUN_ID -o $RUN_ID-report/"
echo
echo "\$ gradwatch alerts $RUN_ID"
"$CLI" alerts "$RUN_ID"
echo
echo "If nothing is done, the run goes on to step 600,000 (a report every 100 steps):"
echo "\$ gradwatch replay $RUN_ID-untreated.jsonl --max"
"$CLI" replay "$later_file" --max
echo
echo "\$ gradwatch alerts $RUN_ID"
"$CLI" alerts "$RUN_ID"
echo
echo "The same run remedied instead at step 110,100: weight decay 0.1 on final_norm.weight (a params line,"
echo "as gradwatch.torch.Watch sends it when the optimizer's param groups change), to step 200,000:"
echo "\$ gradwatch replay $RUN_ID.jsonl --run $RUN_ID-remedied --max"
"$CLI" replay "$run_file" --run "$RUN_ID-remedied" --max >/dev/null
echo "\$ gradwatch replay $RUN_ID-remedied.jsonl --run $RUN_ID-remedied --max"
"$CLI" replay "$remedied_file" --run "$RUN_ID-remedied" --max
echo
echo "\$ gradwatch show $RUN_ID-remedied | grep remediation"
"$CLI" show "$RUN_ID-remedied" | grep remediation
echo
echo "\$ gradwatch alerts $RUN_ID-remedied"
"$CLI" alerts "$RUN_ID-remedied"

if [[ "$serve" == true ]]; then
  echo "gradwatchd keeps running as pid $daemon_pid (data: $data_dir, log: $data_dir/gradwatchd.log)."
  echo "Try: $CLI --addr 127.0.0.1:$grpc_port series $RUN_ID grad/norm/total --max-points 20"
  echo "Stop it with: kill $daemon_pid"
  daemon_pid=""
  exit 0
fi

gw_log "stopping gradwatchd with SIGTERM"
kill -TERM "$daemon_pid"
deadline=$((SECONDS + STOP_TIMEOUT_SECONDS))
while kill -0 "$daemon_pid" 2>/dev/null && ((SECONDS < deadline)); do
  sleep 0.1
done
if kill -0 "$daemon_pid" 2>/dev/null; then
  show_log_tail
  gw_die "gradwatchd did not stop within ${STOP_TIMEOUT_SECONDS}s of SIGTERM"
fi
daemon_status=0
wait "$daemon_pid" || daemon_status=$?
daemon_pid=""
if ((daemon_status != 0)); then
  show_log_tail
  gw_die "gradwatchd exited with status $daemon_status (expected 0)"
fi
gw_log "gradwatchd stopped cleanly; its data stays in $data_dir"
