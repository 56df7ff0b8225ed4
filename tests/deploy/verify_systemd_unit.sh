#!/usr/bin/env bash
# systemd-analyze verify on deploy/systemd/gradwatchd.service, with ExecStart pointed at the built
# gradwatchd (verify checks that the binary exists). Fails on a non-zero exit and on any line about
# the unit: systemd reports a bad directive's value as a warning and still exits 0.
# Usage: verify_systemd_unit.sh UNIT GRADWATCHD
set -euo pipefail
unit="$1"
binary="$2"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
sed "s|/usr/local/bin/gradwatchd|$binary|g" "$unit" > "$dir/gradwatchd.service"
status=0
output=$(systemd-analyze verify "$dir/gradwatchd.service" 2>&1) || status=$?
printf '%s\n' "$output"
if ((status != 0)) || grep -q 'gradwatchd.service' <<<"$output"; then
  echo "systemd-analyze verify found problems in $unit (exit $status)" >&2
  exit 1
fi
echo "systemd-analyze verify: $unit is clean"
