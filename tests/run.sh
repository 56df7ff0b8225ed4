#!/usr/bin/env bash
# Builds gradwatch with its tests and runs every test: what CI runs (.ci/run).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tests/run.sh [--help] [-- CTEST_ARGS...]

Installs the Debian packages listed in deploy/packages.txt and deploy/packages-test.txt that are
missing (needs root then), configures and builds gradwatch with its tests into build/
(RelWithDebInfo, Ninja, one job per core), and runs
  ctest --test-dir build --output-on-failure --timeout 300 --no-tests=error
then tests/fuzz/run.sh: the libFuzzer targets, built with clang-14 into build-fuzz/ (which also
checks the lock annotations), each run for $GRADWATCH_FUZZ_SECONDS seconds (default 20). Fails
if either fails. Arguments after `--` go to ctest, e.g.
`tests/run.sh -- -L unit`.
USAGE
}

ctest_args=()
while (($# > 0)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --) shift; ctest_args=("$@"); break ;;
    *) printf 'unknown argument: %s\n\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
done

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../deploy/lib.sh"
cd "$GW_REPO_ROOT"

gw_ensure_packages deploy/packages.txt deploy/packages-test.txt
gw_build "$GW_REPO_ROOT/build" RelWithDebInfo -DGRADWATCH_BUILD_TESTS=ON

status=0
ctest --test-dir build --output-on-failure --timeout 300 --no-tests=error "${ctest_args[@]}" || status=$?
bash tests/fuzz/run.sh || status=$?
exit "$status"
