#!/usr/bin/env bash
# Longer runs of the property tests ("fuzzing" of issue 12; `cargo fuzz` needs a nightly
# toolchain, which the project does not use). scripts/test.sh runs each target with its
# default number of cases; this runs them with MLXD_FUZZ_CASES (default 20000) cases each:
# request JSON and the config parser (tests/tests/fuzz.rs), the SSE splitter
# (ipc/src/sse.rs), the control-channel frame decoder (ipc/src/frame.rs), and the GGUF and
# safetensors header parsers (engine/tests/engine/fuzz_headers.rs).
#
#     scripts/fuzz.sh [CASES]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export MLXD_FUZZ_CASES=${1:-${MLXD_FUZZ_CASES:-20000}}
echo "== $MLXD_FUZZ_CASES cases per property"
cargo test -p mlxd-ipc --lib proptests
cargo test -p mlxd-tests --test fuzz
cargo test -p mlxd-engine --test engine fuzz_headers::
