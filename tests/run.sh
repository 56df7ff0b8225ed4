#!/usr/bin/env bash
# Builds gradwatch with its tests and runs every test: what CI runs (.ci/run).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tests/run.sh [--no-sanitizers] [--no-asan] [--no-tsan] [--no-fuzz] [--budget SECONDS] [--help]
                    [-- CTEST_ARGS...]

Installs the Debian packages listed in deploy/packages.txt and deploy/packages-test.txt that are
missing (needs root then), then runs these phases, printing the time each took:
  format         every tracked .cc and .h file is as clang-format-14 formats it with the
                 repository's .clang-format (fix: clang-format-14 -i $(git ls-files '*.cc' '*.h'))
  build          gradwatch and its tests (gcc, RelWithDebInfo with -g1, Ninja, one job per core)
                 into build/
  test           ctest --test-dir build -j2 --output-on-failure --timeout 300, while the asan
                 build compiles in the background at nice 19
  asan build     everything and the tests again with clang-14, ASan and UBSan, into build-fuzz/
                 (the fuzzers' build, which also checks the lock annotations with -Wthread-safety)
  asan test      ctest -j2 on that build, while the tsan build compiles in the background;
                 any ASan, UBSan or LeakSanitizer report fails it
  fuzz           tests/fuzz/run.sh: the libFuzzer targets from that same build, each run for
                 $GRADWATCH_FUZZ_SECONDS seconds (default 20)
  tsan build     everything and the tests with clang-14 and TSan into build-tsan/, but the unit
                 tests of modules that run one thread (core, alerts, analytics)
  tsan test      ctest -j2 on that build; any ThreadSanitizer report fails it
The sanitizer runs stretch the tests' waits and time bounds (tests/support/time_scale.h) and use
the suppressions in tests/sanitizers/ (third-party libraries only). Their reports are written to
<build>/sanitizer-logs/ and printed at the end. Fails if any phase fails; later phases still run.
The summary at the end names every test that failed, with the last 40 lines of its output.

  --no-sanitizers  skip the asan, fuzz and tsan phases (CI runs them all)
  --no-asan        skip the asan build and test (and the fuzzers, which use that build)
  --no-tsan        skip the tsan build and test
  --no-fuzz        skip the fuzzers
  --budget SECONDS the time the whole run may take (.ci/run: CI's 5400 s). When the tsan build is
                   not done by the time the tsan tests (about 1000 s) would no longer fit with 300 s
                   to spare, it is stopped and the tsan phases are skipped, loudly (a line in the
                   phase times), rather than the run outliving its budget with nothing reported
Arguments after `--` go to every ctest run, e.g. `tests/run.sh -- -L unit`.
USAGE
}

asan=1 tsan=1 fuzz=1 budget=0
# What the tsan tests take (812 s on 2026-12-02, on a slow day of this 2-core machine), and what a
# budgeted run keeps to spare.
tsan_test_estimate=1000 budget_margin=300
ctest_args=()
while (($# > 0)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --no-sanitizers) asan=0 tsan=0 fuzz=0; shift ;;
    --no-asan) asan=0 fuzz=0; shift ;;
    --no-tsan) tsan=0; shift ;;
    --no-fuzz) fuzz=0; shift ;;
    --budget)
      [[ "${2:-}" =~ ^[0-9]+$ ]] || { printf -- '--budget needs a number of seconds\n' >&2; exit 2; }
      budget="$2"
      shift 2
      ;;
    --) shift; ctest_args=("$@"); break ;;
    *) printf 'unknown argument: %s\n\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
done

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../deploy/lib.sh"
cd "$GW_REPO_ROOT"

gw_ensure_packages deploy/packages.txt deploy/packages-test.txt

status=0
failed=()
timings=()
started_all=$SECONDS

# Runs one phase: phase NAME COMMAND...; records its time and whether it failed.
phase() {
  local name="$1" start=$SECONDS rc=0
  shift
  gw_log "=== $name"
  "$@" || rc=$?
  timings+=("$(printf '%-11s %4d s%s' "$name" $((SECONDS - start)) "$( ((rc == 0)) || echo '  FAILED')")")
  if ((rc != 0)); then
    failed+=("$name")
    status=1
  fi
  return 0
}

# The tests that failed in a ctest run, each with the tail of its output, kept for the summary at
# the end: --output-on-failure prints a failure where it happens, hundreds of lines above what a
# CI page shows. Usage: ctest_failures PHASE BUILD
failure_report=()
ctest_failures() {
  local phase="$1" build="$2" failed_list="$2/Testing/Temporary/LastTestsFailed.log"
  local log="$2/Testing/Temporary/LastTest.log" name
  [[ -s "$failed_list" ]] || return 0
  while IFS= read -r name; do
    name="${name#*:}"
    failure_report+=("--- $phase: $name")
    if [[ -f "$log" ]]; then
      failure_report+=("$(awk -v want="$name" '
        $0 ~ /^[0-9]+\/[0-9]+ Test: / { sub(/^[0-9]+\/[0-9]+ Test: /, ""); cur = $0; if (cur == want) n = 0; next }
        cur == want && /^<end of output>$/ { grab = 0; next }
        cur == want && grab { lines[n++ % 40] = $0 }
        cur == want && /^Output:$/ { grab = 1; getline; next }
        cur == want && /^Test (Failed|Passed|.*Timeout|.*Exception)/ { status = $0 }
        END { for (i = (n > 40 ? n - 40 : 0); i < n; i++) print "    " lines[i % 40]; if (status != "") print "    " status }
      ' "$log")")
    fi
  done < "$failed_list"
}
# ctest_phase PHASE BUILD CTEST_ARGS...: ctest on BUILD, its failures kept for the summary.
# Tests ctest reports as skipped (a test that exits with its SKIP_RETURN_CODE, e.g. the container
# test where no Docker daemon can run) are listed by name in the summary: skipped is never passed.
skipped_report=()
ctest_phase() {
  local phase="$1" build="$2" rc=0 name
  shift 2
  rm -f "$build/Testing/Temporary/LastTestsFailed.log"
  { "$@" 2>&1 | tee "$build/ctest-output.log"; } || rc=$?
  ((rc == 0)) || ctest_failures "$phase" "$build"
  while IFS= read -r name; do
    skipped_report+=("--- $phase: $name")
  done < <(sed -n -E 's/^[[:space:]]+[0-9]+ - (.*) \(Skipped\)$/\1/p' "$build/ctest-output.log")
  return "$rc"
}

# Runs ctest on a sanitizer build with the runtime options below, then fails if any process
# (a test binary, the daemon, the CLI) wrote a sanitizer report. Usage: sanitized_ctest DIR KIND
# KIND: asan (ASan, UBSan and LeakSanitizer) or tsan. A suite built with -fsanitize=thread needs
# the kernel's mmap layout TSan expects; without ASLR (setarch -R) it works on kernels whose
# vm.mmap_rnd_bits are too high for clang 14's TSan.
sanitized_ctest() {
  local build="$1" kind="$2" logs="$1/sanitizer-logs" rc=0
  rm -rf "$logs"
  mkdir -p "$logs"
  local -a env=() wrapper=()
  if [[ "$kind" == asan ]]; then
    env=("ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:log_path=$PWD/$logs/asan"
         "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$PWD/$logs/ubsan"
)
  else
    env=("TSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/tsan.supp:second_deadlock_stack=1:log_path=$PWD/$logs/tsan")
    if setarch "$(uname -m)" -R true 2>/dev/null; then
      wrapper=(setarch "$(uname -m)" -R)
    fi
  fi
  # -j2: the tests use ephemeral ports and their own data directories; the time scale of the
  # sanitizer builds leaves room for two at once on 2 cores.
  ctest_phase "$kind test" "$build" env "${env[@]}" "${wrapper[@]}" ctest --test-dir "$build" \
    --output-on-failure --timeout 2400 --no-tests=error -j2 "${ctest_args[@]}" || rc=$?
  local reports
  reports=$(find "$logs" -type f -size +0 | sort)
  if [[ -n "$reports" ]]; then
    gw_log "$kind: sanitizer reports in $logs:"
    while IFS= read -r report; do
      printf '%s\n' "--- $report" >&2
      head -n 80 "$report" >&2
    done <<< "$reports"
    rc=1
  fi
  return "$rc"
}

# The sources as clang-format-14 writes them with .clang-format: a difference fails the phase and
# names the file and line.
check_format() {
  local -a files
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    mapfile -t files < <(git ls-files '*.cc' '*.h')
  else
    mapfile -t files < <(find alerts client server tests \( -name '*.cc' -o -name '*.h' \) | sort)
  fi
  gw_log "format: ${#files[@]} files"
  clang-format-14 --dry-run --Werror "${files[@]}"
}

phase format check_format
# -g1: line tables, enough for the stack traces of a failing test; full -g made a quarter of the
# build's time. The tests' own code is built at -O1 (tests/CMakeLists.txt).
phase build gw_build "$GW_REPO_ROOT/build" RelWithDebInfo -DGRADWATCH_BUILD_TESTS=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"

# Each sanitizer build compiles in the background, at the lowest CPU priority, while the tests of
# the build before it run: the build takes what CPU the tests leave and never slows them. On
# 2026-12-02 the gcc tests left the asan build little (12 of 180 steps in their 5 minutes); the
# tsan build overlaps the asan tests and the fuzzers. Order: gcc build; gcc tests while the asan
# build compiles; asan tests and the fuzzers while the tsan build compiles; tsan tests.
asan_build() {
  gw_configure_sanitized build-fuzz address,undefined -DGRADWATCH_FUZZ=ON &&
    cmake --build build-fuzz --parallel "$(nproc)"
}
tsan_build() {
  gw_configure_sanitized build-tsan thread && cmake --build build-tsan --parallel "$(nproc)"
}
# background_build NAME DIR FUNCTION: starts FUNCTION at nice 19, its output in DIR/build.log.
declare -A bg_pid=() bg_start=()
background_build() {
  local name="$1" dir="$2" fn="$3"
  mkdir -p "$dir"
  bg_start[$name]=$SECONDS
  (renice -n 19 -p "$BASHPID" > /dev/null && "$fn") > "$dir/build.log" 2>&1 &
  bg_pid[$name]=$!
  gw_log "building $dir in the background at nice 19 (log: $dir/build.log)"
}
# wait_build NAME DIR: waits for a background build and records it as a phase; returns non-zero
# if it failed (its log's tail is printed).
wait_build() {
  local name="$1" dir="$2" rc=0
  wait "${bg_pid[$name]}" || rc=$?
  timings+=("$(printf '%-11s %4d s (in the background)%s' "$name" $((SECONDS - bg_start[$name])) \
    "$( ((rc == 0)) || echo '  FAILED')")")
  if ((rc != 0)); then
    tail -n 60 "$dir/build.log" >&2
    failed+=("$name")
    status=1
  fi
  return "$rc"
}

((asan)) && background_build 'asan build' build-fuzz asan_build
# -j2: the tests use ephemeral ports and their own data directories.
phase test ctest_phase test build ctest --test-dir build --output-on-failure --timeout 300 \
  --no-tests=error -j2 "${ctest_args[@]}"
if ((asan)); then
  if wait_build 'asan build' build-fuzz; then
    ((tsan)) && background_build 'tsan build' build-tsan tsan_build
    phase 'asan test' sanitized_ctest build-fuzz asan
    ((fuzz)) && phase fuzz bash tests/fuzz/run.sh
  fi
fi
# kill_tree PID: stops a process and everything it started.
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2> /dev/null || true
}
# The seconds into the run by which the tsan tests must start to fit the budget; none without one.
tsan_start_limit=$((budget > 0 ? budget - budget_margin - tsan_test_estimate : 0))
tsan_fits() { ((budget == 0 || SECONDS - started_all <= tsan_start_limit)); }
skip_tsan() {
  timings+=("$(printf '%-11s SKIPPED: %d s of the %d s budget used, the tsan tests need about %d s' 'tsan' \
    $((SECONDS - started_all)) "$budget" "$tsan_test_estimate")")
  gw_log "WARNING: tsan skipped: $((SECONDS - started_all)) s of the ${budget} s budget are used"
}
if ((tsan)); then
  if [[ -n "${bg_pid['tsan build']:-}" ]]; then
    while kill -0 "${bg_pid['tsan build']}" 2> /dev/null && tsan_fits; do sleep 5; done
    if ! tsan_fits && kill -0 "${bg_pid['tsan build']}" 2> /dev/null; then
      kill_tree "${bg_pid['tsan build']}"
      wait "${bg_pid['tsan build']}" 2> /dev/null || true
      skip_tsan
      tsan=0
    else
      wait_build 'tsan build' build-tsan || true
    fi
  else
    phase 'tsan build' tsan_build
  fi
  if ((tsan)) && [[ " ${failed[*]} " != *" tsan build "* ]]; then
    if tsan_fits; then
      phase 'tsan test' sanitized_ctest build-tsan tsan
    else
      skip_tsan
    fi
  fi
fi

gw_log "phase times:"
printf '  %s\n' "${timings[@]}" >&2
gw_log "total $((SECONDS - started_all)) s"
if ((${#failure_report[@]} > 0)); then
  gw_log "failed tests, with the last lines of their output (all of it above, and in <build>/Testing/Temporary/LastTest.log):"
  printf '%s\n' "${failure_report[@]}" >&2
fi
if ((${#skipped_report[@]} > 0)); then
  gw_log "skipped tests (they did not run; each says why in its output above):"
  printf '%s\n' "${skipped_report[@]}" >&2
fi
if ((status != 0)); then
  gw_die "failed: ${failed[*]}"
fi
gw_log "all phases passed"
