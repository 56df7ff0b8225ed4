#!/usr/bin/env bash
# Benchmarks gradwatchd on loopback and prints one table (issue 10, point 6).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tests/bench/run.sh [--quick] [--json FILE] [--help]

Installs the Debian packages of deploy/packages.txt and deploy/packages-bench.txt that are missing
(needs root then), builds gradwatchd and the benchmark driver in Release into build-bench/, then:
  - build-bench/tests/bench/gradwatch_bench: the real gradwatchd (ingest at 1 x 1 x 1,000,
    1 x 64 x 1,000, 8 x 8 x 200 and 1 x 1 x 10,000 runs x ranks x params, journal and default
    alert rules on), CPU per sample at 10,000 against 1,000 parameters in pairs of runs back to
    back, the protobuf-parse and empty-handler gRPC ceilings, alert latency to the
    trainer's stream and to a webhook, /metrics at ~10,000 and ~100,000 series, ingest latency
    while scraping, RSS per series, journal bytes per sample, restart time;
  - tests/bench/pushgateway.py: Debian's prometheus-pushgateway fed one push per rank per step on
    the same workloads, scraped every second by a real prometheus;
and prints one table with the targets of issue 10 (pass/MISS). Everything runs on 127.0.0.1 with
free ports and temporary directories. Progress goes to stderr.

  --quick      smaller step counts: about 5 minutes on an idle 2-core machine (full: about 20)
  --json FILE  also write every figure as JSON to FILE (default: build-bench/bench.json)
USAGE
}

mode=()
json_out=""
while (($# > 0)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --quick) mode=(--quick) ;;
    --json) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; json_out="$2"; shift ;;
    *) printf 'unknown argument: %s\n\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../deploy/lib.sh"
cd "$GW_REPO_ROOT"
build_dir="$GW_REPO_ROOT/build-bench"
[[ -n "$json_out" ]] || json_out="$build_dir/bench.json"

gw_ensure_packages deploy/packages.txt deploy/packages-bench.txt
# The build's output goes to stderr with the progress: stdout carries only the table.
GW_BUILD_TARGETS="gradwatchd gradwatch_bench" gw_build "$build_dir" Release -DGRADWATCH_BUILD_TESTS=ON >&2

work="$(mktemp -d "${TMPDIR:-/tmp}/gradwatch-bench.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# Fewer steps for the Pushgateway than for gradwatchd: every push makes it gather every series it
# holds, and a scrape of 128,000 series outlives Prometheus's 1 s timeout, so the Pushgateway spends
# its CPU on scrapes that fail; each workload stops pushing at a time limit.
if ((${#mode[@]} > 0)); then
  pushgateway_workloads=(1x1x1000:200 1x64x1000:3 8x8x200:20)
  pushgateway_limit=30
else
  pushgateway_workloads=(1x1x1000:2000 1x64x1000:20 8x8x200:100)
  pushgateway_limit=180
fi

start=$SECONDS
gw_log "gradwatchd (${mode[*]:-full})"
"$build_dir/tests/bench/gradwatch_bench" "${mode[@]}" --json "$work/gradwatch.json"
gw_log "pushgateway"
"$GW_PYTHON" tests/bench/pushgateway.py --json "$work/pushgateway.json" --time-limit "$pushgateway_limit" \
  "${pushgateway_workloads[@]}"
"$GW_PYTHON" tests/bench/report.py "$work/gradwatch.json" "$work/pushgateway.json" "$json_out"
gw_log "done in $((SECONDS - start)) s; figures in $json_out"
