//! Custom CUDA kernels through MLX (`mx.fast.cuda_kernel`): MLX writes the signature from the
//! input and output names, compiles the body with NVRTC on first use per source, and runs it
//! as one op of the lazy graph.
//!
//! The engine's kernels ([`crate::models::delta_kernel`], [`crate::models::decode_attention`],
//! [`crate::adapters::lora_kernel`]) each hold their [`CudaKernel`]s per thread and call
//! [`CudaKernel::apply`] once per site per pass: a decode step over four adapters makes 128
//! such calls. MLX's call path rebuilds the kernel's whole source for every call (the
//! template arguments formatted into it, a buffer of the source's size plus 8 KB) and hashes
//! that source again at evaluation; on an H100 the adapters' calls cost the host about 8 µs
//! each to build and 5 µs to evaluate, a millisecond of a 32-row step (BENCHMARKS.md, session
//! 46). So a kernel here is specialised once per set of template arguments, their values
//! written into its body as constants (an MLX kernel without template arguments skips the
//! formatting), its body stripped of comments and indentation (less to copy and hash each
//! call), and each launch's MLX configuration (output shapes, grid) is made once and reused.
//! This module owns the C handles and their lifetimes, so the kernels hold only their source
//! and arguments.
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::fmt::Write as _;
use std::rc::Rc;

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
/// at the top of the body).
pub struct Launch<'a> {
    pub grid: (i32, i32, i32),
    pub block: (i32, i32, i32),
    pub dtypes: &'a [(&'static str, Dtype)],
    pub ints: &'a [(&'static str, i32)],
}

/// A kernel's template arguments: what makes one specialisation.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Template {
    dtypes: Vec<(&'static str, Dtype)>,
    ints: Vec<(&'static str, i32)>,
}

/// Everything MLX's configuration of one call holds: its template arguments, output shapes
/// and dtypes, grid and block.
#[derive(PartialEq, Eq, Hash)]
struct CallKey {
    template: Template,
    outputs: Vec<(Vec<i32>, Dtype)>,
    grid: (i32, i32, i32),
    block: (i32, i32, i32),
}

/// The most launch configurations a kernel keeps: a decode step's are a few per row count
/// (and, for attention, per span count of the context); past this many the cache starts over.
const MAX_CONFIGS: usize = 4096;

/// A custom kernel: its body and signature names, and its specialisations and launch
/// configurations, made on first use (per thread, as the kernels are).
pub struct CudaKernel {
    name: String,
    inputs: Vec<CString>,
    outputs: Vec<CString>,
    body: String,
    row_contiguous: bool,
    specialised: RefCell<HashMap<Template, Rc<Handle>>>,
    configs: RefCell<HashMap<CallKey, (Rc<Handle>, Config)>>,
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
        let names = |list: &[&str]| -> Result<Vec<CString>, Exception> {
            list.iter().map(|s| c_string(s)).collect()
        };
        Ok(Self {
            name: name.to_string(),
            inputs: names(inputs)?,
            outputs: names(outputs)?,
            body: compact(source),
            row_contiguous,
            specialised: RefCell::new(HashMap::new()),
            configs: RefCell::new(HashMap::new()),
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
        let key = CallKey {
            template: Template {
                dtypes: launch.dtypes.to_vec(),
                ints: launch.ints.to_vec(),
            },
            outputs: outputs.iter().map(|o| (o.shape.clone(), o.dtype)).collect(),
            grid: launch.grid,
            block: launch.block,
        };
        let mut configs = self.configs.borrow_mut();
        if configs.len() >= MAX_CONFIGS && !configs.contains_key(&key) {
            configs.clear();
        }
        let (handle, config) = match configs.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let handle = self.specialisation(&e.key().template)?;
                let config = Config::new(outputs, launch.grid, launch.block)?;
                e.insert((handle, config))
            }
        };
        let outputs = outputs.len();
        let raw: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
        let stream = Stream::thread_local_or_default();
        // SAFETY: every handle passed is live for the call (the arrays through `inputs`, the
        // kernel and configuration through `self`, the vectors until freed below); `result` is
        // filled by MLX with owned arrays that are taken out before the vector is freed.
        let (status, taken) = unsafe {
            let input_vec = mlx_sys::mlx_vector_array_new_data(raw.as_ptr(), raw.len());
            let mut result = mlx_sys::mlx_vector_array_new();
            let status = mlx_sys::mlx_fast_cuda_kernel_apply(
                &mut result,
                handle.0,
                input_vec,
                config.0,
                stream.as_ref().as_ptr(),
            );
            let mut taken = Vec::with_capacity(outputs);
            if status == 0 {
                for i in 0..mlx_sys::mlx_vector_array_size(result) {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, result, i);
                    taken.push(Array::from_ptr(a));
                }
            }
            mlx_sys::mlx_vector_array_free(result);
            mlx_sys::mlx_vector_array_free(input_vec);
            (status, taken)
        };
        if status != 0 {
            return Err(Exception::custom(format!(
                "MLX could not run the {} kernel",
                self.name
            )));
        }
        if taken.len() != outputs {
            return Err(Exception::custom(format!(
                "the {} kernel gave {} outputs, not {outputs}",
                self.name,
                taken.len(),
            )));
        }
        Ok(taken)
    }

    /// The MLX kernel for `template`: the body with the arguments written in as constants,
    /// under a name that says them.
    fn specialisation(&self, template: &Template) -> Result<Rc<Handle>, Exception> {
        if let Some(h) = self.specialised.borrow().get(template) {
            return Ok(h.clone());
        }
        let name = specialised_name(&self.name, template);
        let source = format!("{}{}", constants(template)?, self.body);
        let handle = Rc::new(Handle::new(
            &name,
            &self.inputs,
            &self.outputs,
            &source,
            self.row_contiguous,
        )?);
        self.specialised
            .borrow_mut()
            .insert(template.clone(), handle.clone());
        Ok(handle)
    }
}

/// `source` without comment lines, blank lines and indentation (lines kept: the preprocessor's
/// directives end at theirs).
fn compact(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    for line in source.lines().map(str::trim) {
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The CUDA type MLX declares for an array of `dtype` (its `dtype_to_cuda_type`).
fn cuda_type(dtype: Dtype) -> Result<&'static str, Exception> {
    Ok(match dtype {
        Dtype::Bool => "bool",
        Dtype::Int8 => "int8_t",
        Dtype::Int16 => "int16_t",
        Dtype::Int32 => "int32_t",
        Dtype::Int64 => "int64_t",
        Dtype::Uint8 => "uint8_t",
        Dtype::Uint16 => "uint16_t",
        Dtype::Uint32 => "uint32_t",
        Dtype::Uint64 => "uint64_t",
        Dtype::Float16 => "__half",
        Dtype::Bfloat16 => "__nv_bfloat16",
        Dtype::Float32 => "float",
        Dtype::Float64 => "double",
        other => {
            return Err(Exception::custom(format!(
                "no CUDA kernel template argument of dtype {other:?}"
            )))
        }
    })
}

/// The template arguments as the body's first lines, as MLX would write them.
fn constants(template: &Template) -> Result<String, Exception> {
    let mut out = String::new();
    for (name, dtype) in &template.dtypes {
        let _ = writeln!(out, "using {name} = {};", cuda_type(*dtype)?);
    }
    for (name, value) in &template.ints {
        let _ = writeln!(out, "constexpr int {name} = {value};");
    }
    Ok(out)
}

/// `name` followed by the template arguments' values (an identifier: a minus sign as `m`).
fn specialised_name(name: &str, template: &Template) -> String {
    let mut out = name.to_string();
    for (_, dtype) in &template.dtypes {
        let short = match dtype {
            Dtype::Bfloat16 => "bf16".to_string(),
            Dtype::Float16 => "f16".to_string(),
            Dtype::Float32 => "f32".to_string(),
            other => format!("{other:?}").to_lowercase(),
        };
        out.push('_');
        out.push_str(&short);
    }
    for (_, value) in &template.ints {
        let _ = write!(out, "_{}", value.to_string().replace('-', "m"));
    }
    out
}

/// An MLX custom kernel handle.
struct Handle(mlx_sys::mlx_fast_cuda_kernel);

impl Handle {
    fn new(
        name: &str,
        inputs: &[CString],
        outputs: &[CString],
        source: &str,
        row_contiguous: bool,
    ) -> Result<Self, Exception> {
        let c_name = c_string(name)?;
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
        Ok(Self(handle))
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is owned here and freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

/// One call's MLX configuration: output shapes and dtypes, grid and block (no template
/// arguments: the specialisation holds them).
struct Config(mlx_sys::mlx_fast_cuda_kernel_config);

impl Config {
    fn new(
        outputs: &[OutputSpec],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
    ) -> Result<Self, Exception> {
        // SAFETY: the configuration is owned by the result (freed on drop, also when a step
        // below fails); the shapes are read during each call.
        let config = Self(unsafe { mlx_sys::mlx_fast_cuda_kernel_config_new() });
        let mut status = 0;
        unsafe {
            for out in outputs {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config.0,
                    out.shape.as_ptr(),
                    out.shape.len(),
                    out.dtype as mlx_sys::mlx_dtype,
                );
            }
            status |=
                mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config.0, grid.0, grid.1, grid.2);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(
                config.0, block.0, block.1, block.2,
            );
        }
        if status != 0 {
            return Err(Exception::custom(
                "MLX could not configure a CUDA kernel's launch",
            ));
        }
        Ok(config)
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: the configuration is owned here and freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_config_free(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_loses_comments_blank_lines_and_indentation_but_keeps_its_lines() {
        let body = "  // a comment\n  const int n = 3;\n\n#pragma unroll 4\n  for (;;) {}  \n";
        assert_eq!(
            compact(body),
            "const int n = 3;\n#pragma unroll 4\nfor (;;) {}\n"
        );
    }

    #[test]
    fn template_arguments_become_the_bodys_first_lines_and_the_kernels_name() {
        let t = Template {
            dtypes: vec![("XT", Dtype::Bfloat16), ("FT", Dtype::Float32)],
            ints: vec![("SPAN", 128), ("SCALE_BITS", -7)],
        };
        assert_eq!(
            constants(&t).unwrap(),
            "using XT = __nv_bfloat16;\nusing FT = float;\nconstexpr int SPAN = 128;\n\
             constexpr int SCALE_BITS = -7;\n"
        );
        assert_eq!(specialised_name("mlxd_k", &t), "mlxd_k_bf16_f32_128_m7");
        let none = Template {
            dtypes: vec![],
            ints: vec![],
        };
        assert_eq!(constants(&none).unwrap(), "");
        assert_eq!(specialised_name("mlxd_k", &none), "mlxd_k");
        let bad = Template {
            dtypes: vec![("T", Dtype::Complex64)],
            ints: vec![],
        };
        assert!(constants(&bad).is_err());
    }
}
