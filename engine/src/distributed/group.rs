//! An MLX distributed group from Rust: mlx-c's `mlx_distributed_*` (which mlx-sys binds and
//! mlx-rs 0.33 does not wrap) behind a safe, shareable handle.
//!
//! The group is what `mx.distributed.init(backend=...)` returns in Python: MLX reads the
//! backend's own environment (`MLX_RANK` and `MLX_HOSTFILE` for `ring`; `MLX_RANK`,
//! `MLX_IBV_DEVICES` and `MLX_JACCL_COORDINATOR` for `jaccl`, as `mlx.launch` sets them), so
//! an engine started by `mlx.launch` or by `mlxd` joins the same way.
//! Collectives are lazy MLX ops: they run when their result is evaluated, on every rank, in
//! the order each rank evaluates them.
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{mpsc, Arc, Mutex, Once};
use std::time::Duration;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

/// The backends MLX may be built with, by the names `mx.distributed.init` takes.
pub const BACKENDS: &[&str] = &["ring", "jaccl", "nccl"];

/// Why a group could not be formed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    #[error("unknown distributed backend {0:?} (known: ring, jaccl, nccl)")]
    UnknownBackend(String),
    #[error("this MLX build has no {0:?} distributed backend{needs}", needs = needs(.0))]
    Unavailable(String),
    #[error("the {backend} group did not form: {reason}")]
    Init { backend: String, reason: String },
    #[error(
        "the {backend} group did not form within {seconds} s: a rank did not start or a host \
         in the hostfile does not answer"
    )]
    Timeout { backend: String, seconds: u64 },
}

/// What a backend missing from this build needs, for its error message.
fn needs(backend: &str) -> &'static str {
    match backend {
        "jaccl" => " (jaccl is RDMA over Thunderbolt 5, in MLX's macOS builds only)",
        "nccl" => " (nccl is in MLX's CUDA builds only)",
        _ => "",
    }
}

/// An initialized group; clones share it (every sharded layer holds one).
#[derive(Clone)]
pub struct Group {
    inner: Arc<Raw>,
    rank: usize,
    size: usize,
}

struct Raw(mlx_sys::mlx_distributed_group);

// SAFETY: the handle owns a heap-allocated `mlx::core::distributed::Group` (a shared pointer to
// the backend), which MLX uses from whichever thread builds the collective ops; it is only
// freed on drop, when no clone is left.
unsafe impl Send for Raw {}
unsafe impl Sync for Raw {}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: the handle was filled by `mlx_distributed_init` and is freed once, here.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.0);
        }
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank, self.size)
    }
}

/// Whether this MLX build has `backend`.
pub fn is_available(backend: &str) -> bool {
    let Ok(name) = CString::new(backend) else {
        return false;
    };
    // SAFETY: `name` is a live NUL-terminated string for the call.
    unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
}

impl Group {
    /// Joins the group of `backend` as MLX's environment describes it, waiting at most
    /// `timeout` for the other ranks: the ring backend retries its connections for a long
    /// time when a peer is missing, and a load must fail with a reason instead of hanging.
    /// After a timeout the joining thread is left blocked; the caller is expected to exit.
    pub fn init(backend: &str, timeout: Duration) -> Result<Group, GroupError> {
        if !BACKENDS.contains(&backend) {
            return Err(GroupError::UnknownBackend(backend.to_owned()));
        }
        if !is_available(backend) {
            return Err(GroupError::Unavailable(backend.to_owned()));
        }
        capture_errors();
        let (tx, rx) = mpsc::channel();
        let name = backend.to_owned();
        std::thread::Builder::new()
            .name("mlx-group-init".into())
            .spawn(move || {
                let _ = tx.send(init_now(&name));
            })
            .map_err(|e| GroupError::Init {
                backend: backend.to_owned(),
                reason: format!("cannot start the joining thread: {e}"),
            })?;
        match rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(_) => Err(GroupError::Timeout {
                backend: backend.to_owned(),
                seconds: timeout.as_secs().max(1),
            }),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The element-wise sum of `x` over the ranks, on every rank.
    pub fn all_sum(&self, x: &Array) -> Result<Array, Exception> {
        self.collective("all_sum", x, mlx_sys::mlx_distributed_all_sum)
    }

    /// Every rank's `x` concatenated along the first axis, in rank order, on every rank.
    pub fn all_gather(&self, x: &Array) -> Result<Array, Exception> {
        self.collective("all_gather", x, mlx_sys::mlx_distributed_all_gather)
    }

    /// The sum over the ranks of `x`, split along the first axis: rank `r` gets part `r`.
    pub fn sum_scatter(&self, x: &Array) -> Result<Array, Exception> {
        self.collective("sum_scatter", x, mlx_sys::mlx_distributed_sum_scatter)
    }

    /// Sends `x` to rank `dst`; the returned array must be evaluated for the send to happen.
    pub fn send(&self, x: &Array, dst: usize) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        // SAFETY: `res` is fresh and filled by the op; the input, group and stream handles are
        // live for the call; ownership of `res` passes to the returned Array on success.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            let status = mlx_sys::mlx_distributed_send(
                &mut res,
                x.as_ptr(),
                dst as i32,
                self.inner.0,
                stream.as_ref().as_ptr(),
            );
            finish("send", status, res)
        }
    }

    /// An array of `shape` and `dtype` received from rank `src` (when evaluated).
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: usize) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        // SAFETY: as in `send`; `shape` outlives the call.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            let status = mlx_sys::mlx_distributed_recv(
                &mut res,
                shape.as_ptr(),
                shape.len(),
                dtype as mlx_sys::mlx_dtype,
                src as i32,
                self.inner.0,
                stream.as_ref().as_ptr(),
            );
            finish("recv", status, res)
        }
    }

    fn collective(&self, name: &str, x: &Array, op: Collective) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        // SAFETY: as in `send`.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            let status = op(&mut res, x.as_ptr(), self.inner.0, stream.as_ref().as_ptr());
            finish(name, status, res)
        }
    }
}

type Collective = unsafe extern "C" fn(
    *mut mlx_sys::mlx_array,
    mlx_sys::mlx_array,
    mlx_sys::mlx_distributed_group,
    mlx_sys::mlx_stream,
) -> std::os::raw::c_int;

/// The op's result, or its failure with MLX's message.
///
/// # Safety
/// `res` must be the handle the op was given; it is owned by the result or freed here.
unsafe fn finish(name: &str, status: i32, res: mlx_sys::mlx_array) -> Result<Array, Exception> {
    if status != 0 {
        mlx_sys::mlx_array_free(res);
        let reason = take_error().unwrap_or_else(|| "no message".into());
        return Err(Exception::custom(format!(
            "MLX distributed {name} failed: {reason}"
        )));
    }
    Ok(Array::from_ptr(res))
}

fn init_now(backend: &str) -> Result<Group, GroupError> {
    let failed = |reason: String| GroupError::Init {
        backend: backend.to_owned(),
        reason,
    };
    let name = CString::new(backend).map_err(|e| failed(e.to_string()))?;
    // SAFETY: `raw` is a fresh empty handle that init fills (or leaves empty on failure, when
    // it is freed by `Raw`'s drop); `name` is live for the call.
    let raw = Raw(unsafe { mlx_sys::mlx_distributed_group_new() });
    let mut handle = raw.0;
    let status = unsafe { mlx_sys::mlx_distributed_init(&mut handle, true, name.as_ptr()) };
    let raw = Raw(handle);
    if status != 0 {
        return Err(failed(take_error().unwrap_or_else(|| "no message".into())));
    }
    // SAFETY: the handle holds the group init made.
    let (rank, size) = unsafe {
        (
            mlx_sys::mlx_distributed_group_rank(raw.0),
            mlx_sys::mlx_distributed_group_size(raw.0),
        )
    };
    if rank < 0 || size < 1 || rank >= size {
        return Err(failed(format!("MLX reports rank {rank} of {size}")));
    }
    Ok(Group {
        inner: Arc::new(raw),
        rank: rank as usize,
        size: size as usize,
    })
}

// MLX reports an op's failure through one process-wide error handler; mlx-rs installs its own
// (keeping the message in a thread-local it reads back privately). Ours records the message
// where this module can read it, then hands it to mlx-rs's handler, so both keep working.
static CAPTURE: Once = Once::new();
static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

extern "C" {
    /// mlx-rs's handler (exported unmangled by mlx-rs 0.33's `error.rs`).
    fn default_mlx_error_handler(msg: *const c_char, data: *mut c_void);
}

extern "C" fn chained_error_handler(msg: *const c_char, data: *mut c_void) {
    if !msg.is_null() {
        // SAFETY: MLX passes a NUL-terminated message that lives for the call.
        let text = unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned();
        if let Ok(mut last) = LAST_ERROR.lock() {
            *last = Some(text);
        }
    }
    // SAFETY: the same arguments MLX gave us, to the handler mlx-rs registered.
    unsafe { default_mlx_error_handler(msg, data) }
}

fn capture_errors() {
    CAPTURE.call_once(|| {
        // Any mlx-rs op registers mlx-rs's handler first (once per process), so that ours,
        // registered after it, is the one left in place.
        let _ = mlx_rs::ops::add(Array::from_int(0), Array::from_int(0));
        // SAFETY: registers a handler that lives for the whole process, with no data.
        unsafe {
            mlx_sys::mlx_set_error_handler(Some(chained_error_handler), std::ptr::null_mut(), None);
        }
    });
}

fn take_error() -> Option<String> {
    LAST_ERROR.lock().ok().and_then(|mut last| last.take())
}
