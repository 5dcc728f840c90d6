//! Compiled functions kept for the thread's life.
//!
//! MLX caches the graph it traces for a compiled function under that function's id, and
//! mlx-rs gives every `compile` call a new id and erases it when the compiled value is
//! dropped: a function compiled inside a layer's forward pass is traced again on every call
//! (every layer, every step). [`call`] compiles each function once per thread (the model
//! runs on one thread) and keeps it, so a shape is traced once.
use std::cell::RefCell;
use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

/// An element-wise function over arrays, as MLX compiles it.
pub(crate) type Ops = fn(&[Array]) -> Result<Vec<Array>, Exception>;

type CompiledFn = Box<dyn for<'a> FnMut(&'a [Array]) -> Result<Vec<Array>, Exception>>;

thread_local! {
    /// Compiled functions by the address of the function they compile.
    static KEPT: RefCell<HashMap<usize, CompiledFn>> = RefCell::new(HashMap::new());
}

/// `ops(args)` through its compiled form (`shapeless`: one trace for every shape). `ops`
/// must not itself call [`call`] (the table is borrowed while it runs).
pub(crate) fn call(ops: Ops, shapeless: bool, args: &[Array]) -> Result<Vec<Array>, Exception> {
    KEPT.with(|cell| {
        let mut kept = cell.borrow_mut();
        let f = kept
            .entry(ops as usize)
            .or_insert_with(|| Box::new(compile(ops, shapeless)));
        f(args)
    })
}

/// The one output of `ops(args)`, compiled and kept.
pub(crate) fn call_one(ops: Ops, shapeless: bool, args: &[Array]) -> Result<Array, Exception> {
    call(ops, shapeless, args)?
        .into_iter()
        .next()
        .ok_or_else(|| Exception::custom("a compiled function gave no output"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn double(args: &[Array]) -> Result<Vec<Array>, Exception> {
        Ok(vec![args[0].multiply(Array::from_f32(2.0))?])
    }

    #[test]
    fn a_kept_function_is_compiled_once_and_serves_every_shape() {
        let a = call_one(double, true, &[Array::from_slice(&[1.0f32, 2.0], &[2])]).unwrap();
        assert_eq!(a.as_slice::<f32>(), &[2.0, 4.0]);
        let b = call_one(double, true, &[Array::from_slice(&[3.0f32; 3], &[3])]).unwrap();
        assert_eq!(b.as_slice::<f32>(), &[6.0, 6.0, 6.0]);
        KEPT.with(|k| assert_eq!(k.borrow().len(), 1));
    }
}
