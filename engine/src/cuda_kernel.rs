//! Custom CUDA kernels through MLX (`mx.fast.cuda_kernel`): MLX writes the signature from the
//! input and output names, compiles the body with NVRTC on first use per template arguments,
//! and runs it as one op of the lazy graph.
//!
//! The engine's kernels ([`crate::models::delta_kernel`], [`crate::models::decode_attention`],
//! [`crate::adapters::lora_kernel`]) each hold their [`CudaKernel`]s per thread and call
//! [`CudaKernel::apply`]; this module owns the C handles and their lifetimes, so the kernels
//! hold only their source and arguments.
use std::ffi::{c_char, CString};

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};
use mlxd_protocol::control::Backend;

use crate::device::gpu_backend;

/// Whether a custom kernel switched by the environment variable `switch` runs here: MLX's
/// default device is a CUDA GPU and `switch` is not `0` (the ops path it replaces, kept for
/// measuring). Read once per kernel by its caller.
pub fn wanted(switch: &str) -> bool {
    let on_gpu = mlx_rs::Device::try_default()
        .and_then(|d| d.get_type())
        .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu));
    let asked = std::env::var(switch).map_or(true, |v| v != "0");
    on_gpu && asked && gpu_backend() == Some(Backend::Cuda)
}

fn c_string(s: &str) -> Result<CString, Exception> {
    CString::new(s).map_err(|e| Exception::custom(e.to_string()))
}

/// One output of a call: its shape and dtype.
pub struct OutputSpec {
    pub shape: Vec<i32>,
    pub dtype: Dtype,
}

/// One call's launch: `grid` threads in all (MLX's convention: threads, not blocks), in
/// blocks of `block`; template arguments by name (`using T = …` and `constexpr int N = …`
/// in the body).
pub struct Launch<'a> {
    pub grid: (i32, i32, i32),
    pub block: (i32, i32, i32),
    pub dtypes: &'a [(&'a str, Dtype)],
    pub ints: &'a [(&'a str, i32)],
}

/// An MLX custom kernel handle.
pub struct CudaKernel {
    handle: mlx_sys::mlx_fast_cuda_kernel,
    name: String,
}

impl CudaKernel {
    /// A kernel named `name` with the body `source`. With `row_contiguous`, MLX copies an input
    /// that is not row-contiguous before the call; without it, the body reads `<input>_strides`
    /// (MLX passes shapes and strides of the inputs whose `_shape`/`_strides` the body names).
    pub fn new(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        row_contiguous: bool,
    ) -> Result<Self, Exception> {
        let c_name = c_string(name)?;
        let inputs: Vec<CString> = inputs
            .iter()
            .map(|s| c_string(s))
            .collect::<Result<_, _>>()?;
        let outputs: Vec<CString> = outputs
            .iter()
            .map(|s| c_string(s))
            .collect::<Result<_, _>>()?;
        let source = c_string(source)?;
        let header = c_string("")?;
        let mut input_ptrs: Vec<*const c_char> = inputs.iter().map(|s| s.as_ptr()).collect();
        let mut output_ptrs: Vec<*const c_char> = outputs.iter().map(|s| s.as_ptr()).collect();
        // SAFETY: every pointer is a live NUL-terminated string for the calls; the vectors
        // are copied by MLX and freed here; the kernel handle is owned by the result.
        let handle = unsafe {
            let input_names =
                mlx_sys::mlx_vector_string_new_data(input_ptrs.as_mut_ptr(), input_ptrs.len());
            let output_names =
                mlx_sys::mlx_vector_string_new_data(output_ptrs.as_mut_ptr(), output_ptrs.len());
            let kernel = mlx_sys::mlx_fast_cuda_kernel_new(
                c_name.as_ptr(),
                input_names,
                output_names,
                source.as_ptr(),
                header.as_ptr(),
                row_contiguous,
                0,
            );
            mlx_sys::mlx_vector_string_free(input_names);
            mlx_sys::mlx_vector_string_free(output_names);
            kernel
        };
        if handle.ctx.is_null() {
            return Err(Exception::custom(format!(
                "MLX could not make the {name} kernel"
            )));
        }
        Ok(Self {
            handle,
            name: name.to_string(),
        })
    }

    /// The kernel over `inputs` (in the order of the names given to [`CudaKernel::new`]),
    /// giving one array per output spec, on the thread's stream.
    pub fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[OutputSpec],
        launch: &Launch<'_>,
    ) -> Result<Vec<Array>, Exception> {
        let raw: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
        let dtype_names = launch
            .dtypes
            .iter()
            .map(|(n, d)| Ok((c_string(n)?, *d)))
            .collect::<Result<Vec<_>, Exception>>()?;
        let int_names = launch
            .ints
            .iter()
            .map(|(n, v)| Ok((c_string(n)?, *v)))
            .collect::<Result<Vec<_>, Exception>>()?;
        let stream = Stream::thread_local_or_default();
        // SAFETY: every handle passed is live for the calls (the arrays through `inputs`, the
        // config and vectors until freed below); `outputs` is filled by MLX with owned arrays
        // that are taken out before the vector is freed.
        let (status, taken) = unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut status = 0;
            for out in outputs {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    out.shape.as_ptr(),
                    out.shape.len(),
                    out.dtype as mlx_sys::mlx_dtype,
                );
            }
            let (g, b) = (launch.grid, launch.block);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, g.0, g.1, g.2);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, b.0, b.1, b.2);
            for (name, dtype) in &dtype_names {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                    config,
                    name.as_ptr(),
                    *dtype as mlx_sys::mlx_dtype,
                );
            }
            for (name, value) in &int_names {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                    config,
                    name.as_ptr(),
                    *value,
                );
            }
            let input_vec = mlx_sys::mlx_vector_array_new_data(raw.as_ptr(), raw.len());
            let mut result = mlx_sys::mlx_vector_array_new();
            if status == 0 {
                status = mlx_sys::mlx_fast_cuda_kernel_apply(
                    &mut result,
                    self.handle,
                    input_vec,
                    config,
                    stream.as_ref().as_ptr(),
                );
            }
            let mut taken = Vec::with_capacity(outputs.len());
            if status == 0 {
                for i in 0..mlx_sys::mlx_vector_array_size(result) {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, result, i);
                    taken.push(Array::from_ptr(a));
                }
            }
            mlx_sys::mlx_vector_array_free(result);
            mlx_sys::mlx_vector_array_free(input_vec);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            (status, taken)
        };
        if status != 0 {
            return Err(Exception::custom(format!(
                "MLX could not run the {} kernel",
                self.name
            )));
        }
        if taken.len() != outputs.len() {
            return Err(Exception::custom(format!(
                "the {} kernel gave {} outputs, not {}",
                self.name,
                taken.len(),
                outputs.len()
            )));
        }
        Ok(taken)
    }
}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        // SAFETY: the handle is owned here and freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.handle) };
    }
}
