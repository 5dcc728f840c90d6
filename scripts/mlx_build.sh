# Which MLX build setup.sh installs: sourced by scripts/setup.sh and by its test,
# scripts/test_mlx_build.sh. Pure: the answer depends only on the arguments.
#
# mlx_build OS DRIVER DEVICE
#   OS      `uname -s` (Darwin, Linux, ...)
#   DRIVER  the NVIDIA driver version (`nvidia-smi --query-gpu=driver_version`), empty if none
#   DEVICE  $MLXD_DEVICE: empty (choose), `cpu` (force the CPU build), `gpu` (fail without one)
# prints one of: metal, cuda13, cuda12, cpu; or, on stderr, why not, returning 1.
#
# CUDA 13 needs driver 580 or newer, CUDA 12 (minor-version compatible from 12.0) 525 or newer
# (NVIDIA's CUDA toolkit release notes, table 3); an older driver gets the CPU build.
mlx_build() {
  local os=$1 driver=$2 device=$3
  case $device in
    "" | cpu | gpu) ;;
    *) echo "MLXD_DEVICE=$device: expected cpu or gpu" >&2; return 1 ;;
  esac
  if [[ $os == Darwin ]]; then
    [[ $device == cpu ]] && { echo cpu; return; }
    echo metal
    return
  fi
  if [[ $os != Linux ]]; then
    echo "MLX has no build for $os" >&2
    return 1
  fi
  [[ $device == cpu ]] && { echo cpu; return; }
  local major=${driver%%.*}
  if [[ -n $driver && ! $major =~ ^[0-9]+$ ]]; then
    echo "cannot read the NVIDIA driver version ${driver@Q}" >&2
    return 1
  fi
  if [[ -n $driver ]] && ((major >= 580)); then
    echo cuda13
  elif [[ -n $driver ]] && ((major >= 525)); then
    echo cuda12
  elif [[ $device == gpu ]]; then
    if [[ -z $driver ]]; then
      echo "MLXD_DEVICE=gpu, but no NVIDIA driver was found (nvidia-smi)" >&2
    else
      echo "MLXD_DEVICE=gpu, but NVIDIA driver $driver is older than 525, the oldest CUDA 12 supports" >&2
    fi
    return 1
  else
    echo cpu
  fi
}

# The pip requirement for a build and an MLX version.
mlx_requirement() {
  local build=$1 version=$2
  case $build in
    metal) echo "mlx==$version" ;;
    cpu) echo "mlx[cpu]==$version" ;;
    cuda13 | cuda12) echo "mlx[$build]==$version" ;;
  esac
}

# The NVIDIA driver version of the first GPU, or nothing.
nvidia_driver_version() {
  command -v nvidia-smi >/dev/null || return 0
  nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' '
}
