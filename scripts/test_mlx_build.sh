#!/usr/bin/env bash
# Tests scripts/mlx_build.sh's choice of MLX build for every case, this machine's GPU or not.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./mlx_build.sh
failed=0
expect() { # expect WANT OS DRIVER DEVICE
  local want=$1 got
  shift
  got=$(mlx_build "$@" 2>/dev/null) || got=error
  if [[ $got != "$want" ]]; then
    echo "mlx_build $* gave $got, expected $want" >&2
    failed=1
  fi
}
expect metal Darwin "" ""
expect cpu Darwin "" cpu
expect cpu Linux "" ""
expect cuda13 Linux 580.65.06 ""
expect cuda13 Linux 590.10 gpu
expect cuda12 Linux 575.57.08 ""
expect cuda12 Linux 525.60.13 ""
expect cpu Linux 470.256.02 ""
expect cpu Linux 590.10 cpu
expect error Linux "" gpu
expect error Linux 470.1 gpu
expect error Linux "" fast
expect error Linux "N/A" ""
expect error FreeBSD "" ""
[[ $(mlx_requirement cuda13 0.32.4) == "mlx[cuda13]==0.32.4" ]] || { echo "requirement cuda13" >&2; failed=1; }
[[ $(mlx_requirement cpu 0.32.4) == "mlx[cpu]==0.32.4" ]] || { echo "requirement cpu" >&2; failed=1; }
[[ $(mlx_requirement metal 0.32.4) == "mlx==0.32.4" ]] || { echo "requirement metal" >&2; failed=1; }
msg=$(mlx_build Linux "" gpu 2>&1 >/dev/null) || true
[[ $msg == *"no NVIDIA driver"* ]] || { echo "gpu without a driver says: $msg" >&2; failed=1; }
((failed == 0)) && echo "mlx_build: all cases pass"
exit $failed
