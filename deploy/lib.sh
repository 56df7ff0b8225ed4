# Shell helpers shared by deploy/demo.sh and tests/run.sh. Source it; it defines functions only.
# shellcheck shell=bash

# Repository root: the parent of the folder holding this file.
GW_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Debian's interpreter: the python3 first on PATH may be another one. Used by the sourcing scripts.
# shellcheck disable=SC2034
GW_PYTHON=/usr/bin/python3

gw_log() {
  printf '[%s] %s\n' "$(basename "$0")" "$*" >&2
}

gw_die() {
  gw_log "error: $*"
  exit 1
}

# Prints the package names listed in the given files (comments and blank lines skipped).
gw_read_packages() {
  local file
  for file in "$@"; do
    [[ -r "$file" ]] || gw_die "cannot read package list $file"
    sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$file"
  done
}

# Prints, one per line, those of the named packages that are not installed.
gw_missing_packages() {
  local pkg
  for pkg in "$@"; do
    if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
      printf '%s\n' "$pkg"
    fi
  done
}

# Installs whatever the given package lists name and the machine lacks. Runs `apt-get update` only
# when something is missing; needs root only then.
gw_ensure_packages() {
  local -a wanted missing
  mapfile -t wanted < <(gw_read_packages "$@")
  mapfile -t missing < <(gw_missing_packages "${wanted[@]}")
  if ((${#missing[@]} == 0)); then
    gw_log "all ${#wanted[@]} required Debian packages are installed"
    return 0
  fi
  gw_log "missing Debian packages: ${missing[*]}"
  if [[ "$(id -u)" != 0 ]]; then
    gw_die "run as root, or install them first: apt-get install -y ${missing[*]}"
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
}

# Configures (Ninja, unless the build folder already uses another generator) and builds every
# target, or only those named in GW_BUILD_TARGETS (space-separated) when it is set.
# Usage: gw_build BUILD_DIR BUILD_TYPE [extra cmake -D options...]
gw_build() {
  local build_dir="$1" build_type="$2"
  shift 2
  local -a generator=()
  if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
    generator=(-G Ninja)
  fi
  gw_log "configuring $build_dir ($build_type)"
  cmake -S "$GW_REPO_ROOT" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type" "$@"
  gw_log "building with $(nproc) jobs"
  local -a targets=()
  if [[ -n "${GW_BUILD_TARGETS:-}" ]]; then
    read -r -a targets <<<"$GW_BUILD_TARGETS"
    targets=(--target "${targets[@]}")
  fi
  cmake --build "$build_dir" --parallel "$(nproc)" "${targets[@]}"
}

# Configures a clang-14 sanitizer build of everything, tests included (tests/run.sh,
# tests/fuzz/run.sh). Usage: gw_configure_sanitized BUILD_DIR SANITIZERS [extra cmake -D options...]
# SANITIZERS: "address,undefined" or "thread". -O1 with line tables only: the stack traces name
# lines, and the builds stay much faster than -O2 -g.
gw_configure_sanitized() {
  local build_dir="$1" sanitizers="$2"
  shift 2
  local -a generator=()
  if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
    generator=(-G Ninja)
  fi
  gw_log "configuring $build_dir (clang-14, -fsanitize=$sanitizers, -Wthread-safety)"
  cmake -S "$GW_REPO_ROOT" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" -DCMAKE_CXX_COMPILER=clang++-14 \
    -DGRADWATCH_SANITIZE="$sanitizers" -DGRADWATCH_BUILD_TESTS=ON "$@"
}
