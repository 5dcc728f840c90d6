#!/usr/bin/env bash
# The SDK conformance suite: starts one `mlxd` on the default model (smollm2-135m) and runs
# the official `openai` and `anthropic` Python packages (sdk_python.py), the `ollama` Python
# package (sdk_ollama.py, the Ollama API subset) and the `openai` npm package (sdk_node.mjs)
# against it. Needs `scripts/setup.sh --test` (the Python packages in
# .venv, the npm package in scripts/conformance/node_modules) and the debug binaries
# (`cargo build --workspace --bins`). MLXD_TEST_HOME and MLXD_SMOLLM2_GGUF as for the tests.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
here=scripts/conformance
for bin in target/debug/mlxd target/debug/mlxd-engine; do
  [[ -x $bin ]] || { echo "conformance: $bin is missing (cargo build --workspace --bins)" >&2; exit 1; }
done
[[ -d $here/node_modules/openai ]] || { echo "conformance: the openai npm package is missing (scripts/setup.sh --test)" >&2; exit 1; }
: "${MLXD_SMOLLM2_GGUF:?conformance: set MLXD_SMOLLM2_GGUF (see scripts/test.sh)}"
home=${MLXD_TEST_HOME:-$root/target/mlxd-test-home}

run_dir=$(mktemp -d)
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
MLXD_HOME=$home XDG_RUNTIME_DIR=$run_dir RUST_LOG=info \
  target/debug/mlxd serve --model smollm2-135m --host 127.0.0.1 --port "$port" \
  --engine-bin target/debug/mlxd-engine >"$run_dir/mlxd.log" 2>&1 </dev/null &
mlxd_pid=$!
cleanup() {
  kill "$mlxd_pid" 2>/dev/null || true
  wait "$mlxd_pid" 2>/dev/null || true
  rm -rf "$run_dir"
}
trap cleanup EXIT
for _ in $(seq 1 200); do
  .venv/bin/python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health/live', timeout=1)" 2>/dev/null && break
  kill -0 "$mlxd_pid" 2>/dev/null || { cat "$run_dir/mlxd.log" >&2; echo "conformance: mlxd exited" >&2; exit 1; }
  sleep 0.1
done
base="http://127.0.0.1:$port"
status=0
echo "== conformance: openai + anthropic (Python) against $base"
.venv/bin/python "$here/sdk_python.py" "$base" || status=1
echo "== conformance: ollama (Python) against $base"
.venv/bin/python "$here/sdk_ollama.py" "$base" || status=1
echo "== conformance: openai (npm) against $base"
node "$here/sdk_node.mjs" "$base" || status=1
if ((status)); then
  echo "conformance: failed; the last lines of the mlxd log:" >&2
  tail -n 40 "$run_dir/mlxd.log" >&2
fi
exit $status
