#!/usr/bin/env bash
# Builds the libFuzzer targets with clang-14 (ASan + UBSan, and the lock annotations checked by
# -Wthread-safety) into build-fuzz/, the build tests/run.sh also runs the ASan+UBSan tests from, and
# runs each on its seed corpus for a bounded time. Exits non-zero on a build error or on any crash,
# leak, sanitizer report or timeout; the input that caused it is written to build-fuzz/findings/
# (keep it in tests/fuzz/corpus/<target>/ once fixed).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tests/fuzz/run.sh [--seconds N] [--help] [TARGET...]

TARGET: stream, http, replay_parser, log_formats, config, rules, templates, step_block, page_recovery (default: all). Each runs for N seconds
(default $GRADWATCH_FUZZ_SECONDS, else 20), starting from tests/fuzz/corpus/<target>/; inputs it
finds that add coverage go to build-fuzz/corpus/<target>/, which later runs start from too.
For a longer local run: tests/fuzz/run.sh --seconds 3600 stream
USAGE
}

seconds="${GRADWATCH_FUZZ_SECONDS:-20}"
targets=()
while (($# > 0)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --seconds) seconds="$2"; shift 2 ;;
    -*) printf 'unknown argument: %s\n\n' "$1" >&2; usage >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
((${#targets[@]} > 0)) || targets=(stream http replay_parser log_formats config rules templates step_block page_recovery)

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../deploy/lib.sh"
cd "$GW_REPO_ROOT"
build=build-fuzz

# The same build as tests/run.sh's ASan+UBSan test run, which builds it with the tests first.
gw_configure_sanitized "$build" address,undefined -DGRADWATCH_FUZZ=ON
gw_log "building the fuzz targets with $(nproc) jobs"
cmake --build "$build" --target gradwatch_fuzzers --parallel "$(nproc)"

mkdir -p "$build/findings"
failed=()
for target in "${targets[@]}"; do
  seeds="tests/fuzz/corpus/$target"
  [[ -d "$seeds" ]] || gw_die "no seed corpus $seeds"
  mkdir -p "$build/corpus/$target"
  gw_log "fuzzing $target for ${seconds}s"
  # -rss_limit_mb: the stream target keeps a few runs with their series; 2 GiB means a leak.
  if ! "$build/tests/fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$build/findings/$target-" \
    "$build/corpus/$target" "$seeds" > "$build/fuzz_$target.log" 2>&1; then
    tail -n 60 "$build/fuzz_$target.log" >&2
    failed+=("$target")
  else
    grep -aE '^Done' "$build/fuzz_$target.log" | tr '\n' ' ' >&2
    echo >&2
  fi
done
if ((${#failed[@]} > 0)); then
  gw_die "fuzzing found a problem in: ${failed[*]} (inputs in $build/findings/, logs in $build/fuzz_*.log)"
fi
gw_log "fuzzing: ${#targets[@]} targets ran ${seconds}s each without a finding"
