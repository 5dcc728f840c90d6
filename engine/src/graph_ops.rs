//! What a lazy MLX graph holds: its ops by primitive, as MLX prints the graph.
//!
//! On a GPU a decode step of a small model pays per op (a kernel, or a captured cuBLAS call,
//! each) more than per byte, so the number of ops a step builds is a figure worth watching
//! beside its time: the adapters' tests bound what an adapted linear adds, and
//! `examples/step_ops.rs` prints a model's decode step.
use std::collections::BTreeMap;

use mlx_rs::Array;

/// Primitives that make a view of their input (a new shape, strides or offset into the same
/// buffer: no kernel on a GPU).
pub const VIEWS: &[&str] = &[
    "Slice",
    "Split",
    "Flatten",
    "Unflatten",
    "Reshape",
    "Transpose",
    "Broadcast",
    "Squeeze",
    "ExpandDims",
];

/// Primitives that are matrix products.
pub const PRODUCTS: &[&str] = &[
    "Matmul",
    "AddMM",
    "QuantizedMatmul",
    "GatherMM",
    "GatherQMM",
];

/// The ops of a graph, counted by primitive name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub by_primitive: BTreeMap<String, usize>,
}

impl OpCounts {
    /// Every op, views included.
    pub fn total(&self) -> usize {
        self.by_primitive.values().sum()
    }

    /// The ops that compute (all but [`VIEWS`]).
    pub fn computing(&self) -> usize {
        self.count(|p| !VIEWS.contains(&p))
    }

    /// The matrix products ([`PRODUCTS`]).
    pub fn products(&self) -> usize {
        self.count(|p| PRODUCTS.contains(&p))
    }

    fn count(&self, keep: impl Fn(&str) -> bool) -> usize {
        self.by_primitive
            .iter()
            .filter(|(p, _)| keep(p))
            .map(|(_, n)| n)
            .sum()
    }
}

/// The ops the unevaluated graph of `out` holds (none once it is evaluated).
pub fn op_counts(out: &Array) -> OpCounts {
    let text = graph_text(out);
    // "Inputs: …", "Outputs: …", then one line per op, its primitive's name first.
    let mut by_primitive = BTreeMap::new();
    for name in text
        .lines()
        .skip(2)
        .filter_map(|l| l.split_whitespace().next())
    {
        *by_primitive.entry(name.to_owned()).or_insert(0) += 1;
    }
    OpCounts { by_primitive }
}

/// MLX's printout of the graph of `out` (`PRINT_GRAPH` set: also on stderr).
pub fn graph_text(out: &Array) -> String {
    // SAFETY: a temporary file MLX writes the graph into and this reads back; every object
    // made here is freed here.
    let text = unsafe {
        let file = libc::tmpfile();
        assert!(!file.is_null(), "tmpfile failed");
        let outputs = mlx_sys::mlx_vector_array_new_value(out.as_ptr());
        let namer = mlx_sys::mlx_node_namer_new();
        mlx_sys::mlx_print_graph(file.cast(), namer, outputs);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(outputs);
        libc::fflush(file);
        let len = libc::ftell(file).max(0) as usize;
        libc::rewind(file);
        let mut text = vec![0u8; len];
        let read = libc::fread(text.as_mut_ptr().cast(), 1, len, file);
        text.truncate(read);
        libc::fclose(file);
        String::from_utf8_lossy(&text).into_owned()
    };
    if std::env::var_os("PRINT_GRAPH").is_some() {
        eprintln!("{text}");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_products_views_and_the_rest() {
        let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
        x.eval().unwrap();
        let y = x
            .matmul(x.t())
            .unwrap()
            .add(&x)
            .unwrap()
            .reshape(&[4])
            .unwrap();
        let c = op_counts(&y);
        assert_eq!(c.products(), 1, "{c:?}");
        assert_eq!(c.total(), 4, "{c:?}");
        assert_eq!(c.computing(), 2, "{c:?}");
        y.eval().unwrap();
        assert_eq!(op_counts(&y).total(), 0);
    }
}
