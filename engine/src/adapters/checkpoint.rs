//! Gradient checkpointing of a training step, as mlx-lm's `--grad-checkpoint` does it
//! (`tuner/trainer.py`'s `grad_checkpoint`: each transformer layer's call under
//! `mx.checkpoint`): a layer's activations are not kept for the backward pass but computed
//! again from its input, so the step holds one layer's activations at a time instead of all
//! of them. The losses and gradients are the same; the peak memory is lower.
//!
//! The decoder runs each layer through [`layer`]. While a training step opened a
//! [`checkpointing`] scope on its thread, the layer becomes one `mx.checkpoint`ed function of
//! its input and of the trained arrays of its linear layers (the arrays must be the
//! function's inputs for their gradients to flow through it); the function selects those
//! arrays in the table itself, because MLX calls it again during the backward pass, after the
//! step's own selection ended. Outside such a scope [`layer`] is the plain call.
//!
//! It composes with a compiled step (`job::train::step`), as `mx.checkpoint` does with
//! mlx-lm's `mx.compile`d step: MLX calls the function while it traces the step (the forward
//! pass, then the recomputation in the backward pass of `value_and_grad`), and the compiled
//! graph keeps the recomputation, which depends on the forward pass's outputs, so that
//! compiling does not merge it back into the forward pass.
use std::cell::RefCell;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::AdapterTable;
use crate::cache::{DenseKv, LayerCache};

thread_local! {
    /// The table of the training step checkpointing its layers on this thread.
    static ACTIVE: RefCell<Option<Arc<AdapterTable>>> = const { RefCell::new(None) };
}

/// While the returned scope lives, the layers of forward passes built on this thread are
/// checkpointed, their trained arrays taken from `table`'s training selection.
pub fn checkpointing(table: Arc<AdapterTable>) -> Scope {
    let previous = ACTIVE.with(|a| a.borrow_mut().replace(table));
    Scope { previous }
}

/// Ends what [`checkpointing`] began.
pub struct Scope {
    previous: Option<Arc<AdapterTable>>,
}

impl Drop for Scope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        ACTIVE.with(|a| *a.borrow_mut() = previous);
    }
}

/// Layer `index` of the model (`layer`) applied to `h` with its `cache`:
/// `forward(layer, h, cache)`, or, in a [`checkpointing`] scope, the same under MLX's
/// checkpoint. A checkpointed layer runs on a fresh cache each time it is computed (a
/// training step's caches start empty and are thrown away; `cache` must be such one).
pub fn layer<L: 'static>(
    index: usize,
    h: &Array,
    cache: &mut LayerCache,
    layer: &L,
    forward: fn(&L, &Array, &mut LayerCache) -> Result<Array, Exception>,
) -> Result<Array, Exception> {
    let Some(table) = ACTIVE.with(|a| a.borrow().clone()) else {
        return forward(layer, h, cache);
    };
    if !matches!(cache, LayerCache::Dense(kv) if kv.offset() == 0) {
        return Err(Exception::custom(
            "a checkpointed layer runs on an empty dense cache (a training step's)",
        ));
    }
    let trained = table.training_of_layer(index);
    let mut inputs = vec![h.clone()];
    inputs.extend(trained.arrays().cloned());
    // SAFETY: the layer is part of the model, which outlives the step: MLX calls the
    // function now and again only while the step's gradient is built (the backward pass of
    // `value_and_grad`), before the training job drops the step's arrays and long before it
    // drops the model; the function is freed with the graph that holds it. A compiled step's
    // graph holds it until the step function is dropped (MLX's compile cache entry is erased
    // then), and that function holds the model.
    let layer: &'static L = unsafe { &*(layer as *const L) };
    let function = move |inputs: &[Array]| -> Result<Vec<Array>, Exception> {
        let selection = trained.with_arrays(&inputs[1..]);
        table.with_training(selection, || {
            let mut fresh = LayerCache::Dense(DenseKv::new());
            forward(layer, &inputs[0], &mut fresh).map(|out| vec![out])
        })
    };
    let mut out = apply_checkpointed(function, &inputs)
        .map_err(|e| Exception::custom(format!("checkpointed layer {index}: {e}")))?;
    out.pop()
        .ok_or_else(|| Exception::custom("a checkpointed layer returned nothing"))
}

/// A Rust function as MLX calls it, with the last error it returned.
struct Payload<F> {
    function: F,
    error: Option<String>,
}

/// `mx.checkpoint(function)(inputs)` through MLX's C API (mlx-rs does not wrap it).
fn apply_checkpointed<F>(function: F, inputs: &[Array]) -> Result<Vec<Array>, String>
where
    F: FnMut(&[Array]) -> Result<Vec<Array>, Exception> + 'static,
{
    let payload = Box::into_raw(Box::new(Payload {
        function,
        error: None,
    }));
    // SAFETY: the closure owns the payload (freed by `drop_payload` when MLX frees the last
    // copy of the closure); every handle made here is freed before returning; the arrays
    // read back are new references.
    unsafe {
        let raw = mlx_sys::mlx_closure_new_func_payload(
            Some(call::<F>),
            payload.cast::<c_void>(),
            Some(drop_payload::<F>),
        );
        let mut checkpointed = mlx_sys::mlx_closure_new();
        let status = mlx_sys::mlx_checkpoint(&mut checkpointed, raw);
        mlx_sys::mlx_closure_free(raw);
        if status != 0 {
            mlx_sys::mlx_closure_free(checkpointed);
            return Err("MLX could not checkpoint the layer".into());
        }
        let pointers: Vec<mlx_sys::mlx_array> = inputs.iter().map(Array::as_ptr).collect();
        let args = mlx_sys::mlx_vector_array_new_data(pointers.as_ptr(), pointers.len());
        let mut results = mlx_sys::mlx_vector_array_new();
        let status = mlx_sys::mlx_closure_apply(&mut results, checkpointed, args);
        mlx_sys::mlx_vector_array_free(args);
        let outcome = if status == 0 {
            Ok(read_vector(results))
        } else {
            // The payload still lives: the graph may hold the closure, and it was not freed.
            Err(format!(
                "MLX failed: {}",
                (*payload)
                    .error
                    .take()
                    .unwrap_or_else(|| "the checkpointed call failed".into())
            ))
        };
        mlx_sys::mlx_vector_array_free(results);
        mlx_sys::mlx_closure_free(checkpointed);
        outcome
    }
}

/// The arrays of an MLX vector, as new references.
unsafe fn read_vector(vector: mlx_sys::mlx_vector_array) -> Vec<Array> {
    (0..mlx_sys::mlx_vector_array_size(vector))
        .map(|i| {
            let mut a = mlx_sys::mlx_array_new();
            mlx_sys::mlx_vector_array_get(&mut a, vector, i);
            Array::from_ptr(a)
        })
        .collect()
}

extern "C" fn call<F>(
    ret: *mut mlx_sys::mlx_vector_array,
    args: mlx_sys::mlx_vector_array,
    payload: *mut c_void,
) -> i32
where
    F: FnMut(&[Array]) -> Result<Vec<Array>, Exception>,
{
    // SAFETY: `payload` is the `Payload<F>` this closure was made with, alive while MLX holds
    // the closure; `ret` is the vector MLX made for the results.
    let payload = unsafe { &mut *payload.cast::<Payload<F>>() };
    let result = catch_unwind(AssertUnwindSafe(|| {
        let inputs = unsafe { read_vector(args) };
        (payload.function)(&inputs)
    }));
    match result {
        Ok(Ok(outputs)) => {
            let pointers: Vec<mlx_sys::mlx_array> = outputs.iter().map(Array::as_ptr).collect();
            // SAFETY: `ret` is MLX's empty handle for the results; setting it takes new
            // references, and `outputs` is dropped after.
            unsafe { mlx_sys::mlx_vector_array_set_data(ret, pointers.as_ptr(), pointers.len()) }
        }
        Ok(Err(e)) => {
            // MLX reports only that the call failed: its reason goes to the log too.
            tracing::error!(error = %e, "a checkpointed layer failed");
            payload.error = Some(e.to_string());
            1
        }
        Err(_) => {
            payload.error = Some("the layer panicked".into());
            1
        }
    }
}

extern "C" fn drop_payload<F>(payload: *mut c_void) {
    // SAFETY: MLX calls this once, when the last copy of the closure is freed.
    drop(unsafe { Box::from_raw(payload.cast::<Payload<F>>()) });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpointed_function_gives_its_value_and_gradient() {
        let f = |x: &Array| x.multiply(x).and_then(|y| y.sum(None));
        let g = |inputs: &[Array]| -> Result<Vec<Array>, Exception> {
            let out =
                apply_checkpointed(|i: &[Array]| Ok(vec![i[0].multiply(&i[0])?]), &inputs[..1])
                    .map_err(Exception::custom)?;
            Ok(vec![out[0].sum(None)?])
        };
        let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
        let mut vg = mlx_rs::transforms::value_and_grad(g);
        let (value, grad) = vg(std::slice::from_ref(&x)).unwrap();
        assert_eq!(
            value[0].item_exact::<f32>(),
            f(&x).unwrap().item_exact::<f32>()
        );
        assert_eq!(grad[0].as_slice::<f32>(), &[2.0, 4.0, 6.0]);
    }
}
