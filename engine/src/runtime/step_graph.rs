//! `MLXD_STEP_DOT=<file>`: the graph of one warm decode step (the 32nd a runtime runs) written
//! as Graphviz DOT, before it is queued: what a step asks of MLX, node by node, to set against
//! mlx-lm's own step (`scripts/bench/step_graph.py` writes and counts both). One row is
//! host-bound on a GPU (issue 21: 1.4 ms a step on an H100, a quarter of it building the graph
//! and most of the rest in `async_eval`); the count tells whether a step asks for more than
//! mlx-lm's does (session 54: a quarter fewer primitives, so not that).
use std::sync::atomic::{AtomicUsize, Ordering};

use mlx_rs::Array;

/// The step written (the first ones compile and warm caches).
const STEP: usize = 32;

/// Counts a decode step and writes `outputs`' graph when it is the [`STEP`]th and
/// `MLXD_STEP_DOT` names a file, after evaluating `pending` (the step before, still in
/// flight, whose graph would otherwise be written with this one's). A failure is logged: the
/// step runs either way.
pub(super) fn maybe_write(outputs: &[&Array], pending: Option<&Array>) {
    static STEPS: AtomicUsize = AtomicUsize::new(0);
    static PATH: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let Some(path) = PATH.get_or_init(|| std::env::var("MLXD_STEP_DOT").ok()) else {
        return;
    };
    if STEPS.fetch_add(1, Ordering::Relaxed) + 1 != STEP {
        return;
    }
    let written = pending
        .map_or(Ok(()), |p| p.eval().map_err(|e| e.to_string()))
        .and_then(|()| write(path, outputs));
    match written {
        Ok(()) => tracing::info!(path, step = STEP, "decode step graph written"),
        Err(e) => tracing::warn!(path, "decode step graph not written: {e}"),
    }
}

fn write(path: &str, outputs: &[&Array]) -> Result<(), String> {
    let c_path = std::ffi::CString::new(path).map_err(|e| e.to_string())?;
    // SAFETY: the file, vector and namer are created here, used only by the export call and
    // freed before returning; each array handle stays owned by its `Array` (the vector takes
    // its own references).
    unsafe {
        let file = libc::fopen(c_path.as_ptr(), c"w".as_ptr());
        if file.is_null() {
            return Err(std::io::Error::last_os_error().to_string());
        }
        let vector = mlx_sys::mlx_vector_array_new();
        let appended = outputs
            .iter()
            .all(|a| mlx_sys::mlx_vector_array_append_value(vector, a.as_ptr()) == 0);
        let namer = mlx_sys::mlx_node_namer_new();
        let status = if appended {
            mlx_sys::mlx_export_to_dot(file.cast(), namer, vector)
        } else {
            -1
        };
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(vector);
        libc::fclose(file);
        if status != 0 {
            return Err(format!(
                "mlx_export_to_dot returned {status} (-1: an output could not be listed)"
            ));
        }
    }
    Ok(())
}
