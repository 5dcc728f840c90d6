//! Start-up checks on the libmlx this process loaded, and the choice of the device it computes
//! on (`MLXD_DEVICE`).
use std::ffi::CStr;

use mlxd_protocol::control::{Backend, Device, DeviceKind};

use crate::cache::DeviceMemory;

/// The version string of the libmlx loaded at run time.
pub fn loaded_mlx_version() -> String {
    // SAFETY: mlx_string_new/mlx_version/mlx_string_data/mlx_string_free are used as mlx-c
    // documents: the string is created, filled, read while alive, then freed.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        mlx_sys::mlx_version(&mut s);
        let text = CStr::from_ptr(mlx_sys::mlx_string_data(s))
            .to_string_lossy()
            .into_owned();
        mlx_sys::mlx_string_free(s);
        text
    }
}

/// Fails unless the loaded libmlx is the version this binary was built against: libmlx has no
/// ABI stability across patch releases, so a mismatch would crash later in obscure ways.
pub fn check_mlx_version() -> Result<(), String> {
    let loaded = loaded_mlx_version();
    let built = mlx_sys::MLX_BUILD_VERSION;
    if loaded == built {
        Ok(())
    } else {
        Err(format!(
            "this mlxd-engine was built against MLX {built} but loaded libmlx {loaded}; \
             install MLX {built} (scripts/setup.sh) or point LD_LIBRARY_PATH at it"
        ))
    }
}

/// The environment variable that picks the device: `cpu`, `gpu`, or unset.
pub const DEVICE_ENV: &str = "MLXD_DEVICE";

/// What `MLXD_DEVICE` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    /// Unset: the GPU when this MLX build has a usable one, else the CPU.
    Auto,
    Cpu,
    /// The GPU or a load failure; never a silent fall back to the CPU.
    Gpu,
}

/// Reads `MLXD_DEVICE` (case-insensitive); anything but `cpu`, `gpu` or empty is refused.
pub fn parse_device_request(value: Option<&str>) -> Result<DeviceRequest, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(DeviceRequest::Auto),
        Some(v) if v.eq_ignore_ascii_case("cpu") => Ok(DeviceRequest::Cpu),
        Some(v) if v.eq_ignore_ascii_case("gpu") => Ok(DeviceRequest::Gpu),
        Some(other) => Err(format!(
            "{DEVICE_ENV}={other:?} is not a device: expected cpu or gpu (unset: the GPU when \
             this MLX build has one, else the CPU)"
        )),
    }
}

/// `MLXD_DEVICE` from the environment.
pub fn device_request_from_env() -> Result<DeviceRequest, String> {
    let value = std::env::var_os(DEVICE_ENV).map(|v| v.to_string_lossy().into_owned());
    parse_device_request(value.as_deref())
}

/// The device for `request`, given the GPU backend the loaded libmlx can use (`None`: a CPU
/// build, or no GPU visible). Pure: [`select_device`] asks MLX and applies the answer.
pub fn choose_device(
    request: DeviceRequest,
    gpu: Option<Backend>,
    mlx_version: &str,
) -> Result<Device, String> {
    let cpu = Device {
        kind: DeviceKind::Cpu,
        backend: Backend::Cpu,
    };
    match (request, gpu) {
        (DeviceRequest::Cpu, _) | (DeviceRequest::Auto, None) => Ok(cpu),
        (DeviceRequest::Gpu | DeviceRequest::Auto, Some(backend)) => Ok(Device {
            kind: DeviceKind::Gpu,
            backend,
        }),
        (DeviceRequest::Gpu, None) => Err(format!(
            "{DEVICE_ENV}=gpu, but the libmlx this engine loaded (MLX {mlx_version}) has no usable \
             GPU: it is MLX's CPU build, or no GPU is visible. On Linux with an NVIDIA driver, \
             `MLXD_DEVICE=gpu scripts/setup.sh` installs the CUDA build (or says why it cannot); \
             set {DEVICE_ENV}=cpu or unset it to run on the CPU"
        )),
    }
}

/// The GPU backend of the loaded libmlx, if it has one and a GPU is available to it.
pub fn gpu_backend() -> Option<Backend> {
    let mut available = false;
    // SAFETY: mlx_device_new_type returns an owned device that is freed below;
    // mlx_device_is_available only writes the bool it is given.
    let gpu_usable = unsafe {
        let gpu = mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0);
        let rc = mlx_sys::mlx_device_is_available(&mut available, gpu);
        mlx_sys::mlx_device_free(gpu);
        rc == 0 && available
    };
    if !gpu_usable {
        return None;
    }
    let mut metal = false;
    // SAFETY: mlx_metal_is_available only writes the bool it is given.
    let metal_rc = unsafe { mlx_sys::mlx_metal_is_available(&mut metal) };
    // MLX has two GPU backends: Metal (macOS) and CUDA (Linux).
    Some(if metal_rc == 0 && metal {
        Backend::Metal
    } else {
        Backend::Cuda
    })
}

/// Chooses the device for `request` and makes it MLX's default (process-wide), so that every
/// array the engine creates afterwards, on any thread, lives there.
pub fn select_device(request: DeviceRequest) -> Result<Device, String> {
    let device = choose_device(request, gpu_backend(), &loaded_mlx_version())?;
    let kind = match device.kind {
        DeviceKind::Cpu => mlx_rs::DeviceType::Cpu,
        DeviceKind::Gpu => mlx_rs::DeviceType::Gpu,
    };
    mlx_rs::Device::set_default(&mlx_rs::Device::new(kind, 0));
    let now = mlx_rs::Device::try_default()
        .and_then(|d| d.get_type())
        .map_err(|e| format!("reading MLX's default device: {e}"))?;
    let matches = matches!(
        (now, device.kind),
        (mlx_rs::DeviceType::Cpu, DeviceKind::Cpu) | (mlx_rs::DeviceType::Gpu, DeviceKind::Gpu)
    );
    if !matches {
        return Err(format!(
            "MLX kept its default device after being asked for the {}",
            device.kind.name()
        ));
    }
    Ok(device)
}

/// The default device's memory as MLX reports it: on CUDA, `free_memory` (system-wide, through
/// NVML when the driver has it) and `total_memory`. `None` on a device that does not report
/// its free memory (the CPU; Metal, whose memory is the system's). Read on the MLX thread once
/// the weights are loaded, so that what they hold is no longer free.
pub fn device_memory() -> Result<Option<DeviceMemory>, String> {
    let failed = |what: &str| format!("reading the device's memory: {what} failed");
    // SAFETY: mlx-c's device and device-info objects are created, filled, read while alive
    // and freed exactly once, as mlx-c documents; the keys are NUL-terminated literals.
    unsafe {
        let mut device = mlx_sys::mlx_device_new();
        if mlx_sys::mlx_get_default_device(&mut device) != 0 {
            mlx_sys::mlx_device_free(device);
            return Err(failed("mlx_get_default_device"));
        }
        let mut info = mlx_sys::mlx_device_info_new();
        let read = mlx_sys::mlx_device_info_get(&mut info, device);
        mlx_sys::mlx_device_free(device);
        if read != 0 {
            mlx_sys::mlx_device_info_free(info);
            return Err(failed("mlx_device_info_get"));
        }
        let size = |key: &CStr| -> Result<Option<u64>, String> {
            let mut exists = false;
            if mlx_sys::mlx_device_info_has_key(&mut exists, info, key.as_ptr()) != 0 {
                return Err(failed("mlx_device_info_has_key"));
            }
            if !exists {
                return Ok(None);
            }
            let mut value = 0usize;
            match mlx_sys::mlx_device_info_get_size(&mut value, info, key.as_ptr()) {
                0 => Ok(Some(value as u64)),
                _ => Err(format!(
                    "reading the device's memory: {} is not a size",
                    key.to_string_lossy()
                )),
            }
        };
        let memory = size(c"free_memory").and_then(|free| {
            Ok(match (free, size(c"total_memory")?) {
                (Some(free), Some(total)) => Some(DeviceMemory { free, total }),
                _ => None,
            })
        });
        mlx_sys::mlx_device_info_free(info);
        memory
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_requests() {
        assert_eq!(parse_device_request(None), Ok(DeviceRequest::Auto));
        assert_eq!(parse_device_request(Some(" ")), Ok(DeviceRequest::Auto));
        assert_eq!(parse_device_request(Some("CPU")), Ok(DeviceRequest::Cpu));
        assert_eq!(parse_device_request(Some("gpu")), Ok(DeviceRequest::Gpu));
        let e = parse_device_request(Some("cuda")).unwrap_err();
        assert!(
            e.contains("MLXD_DEVICE=\"cuda\"") && e.contains("cpu or gpu"),
            "{e}"
        );
    }

    #[test]
    fn device_choice() {
        let gpu = |backend| Device {
            kind: DeviceKind::Gpu,
            backend,
        };
        let cpu = Device {
            kind: DeviceKind::Cpu,
            backend: Backend::Cpu,
        };
        let cuda = Some(Backend::Cuda);
        assert_eq!(
            choose_device(DeviceRequest::Auto, cuda, "x"),
            Ok(gpu(Backend::Cuda))
        );
        assert_eq!(
            choose_device(DeviceRequest::Auto, None, "x"),
            Ok(cpu.clone())
        );
        assert_eq!(
            choose_device(DeviceRequest::Cpu, cuda, "x"),
            Ok(cpu.clone())
        );
        assert_eq!(
            choose_device(DeviceRequest::Gpu, Some(Backend::Metal), "x"),
            Ok(gpu(Backend::Metal))
        );
        let e = choose_device(DeviceRequest::Gpu, None, "0.32.4").unwrap_err();
        assert!(
            e.contains("MLXD_DEVICE=gpu") && e.contains("MLX 0.32.4"),
            "{e}"
        );
    }
}
