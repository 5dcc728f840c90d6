//! The parameter list a model evaluates at load. Every part that holds weights implements
//! [`Parameters`], so a family lists its parameters by naming its parts once, and
//! [`Params::materialize`] reads them from disk in that order and returns the bytes held.
use std::marker::PhantomData;

use mlx_rs::Array;

use super::layers::{LayerNorm, Linear, Matrix, MatrixCell, RmsNorm};
use crate::loader::{LoadError, LoadReporter};

/// A part of a model that holds parameter arrays.
pub(crate) trait Parameters {
    /// Appends this part's arrays to `p`, in a fixed order.
    fn push_params<'a>(&'a self, p: &mut Params<'a>);
}

/// The parameter arrays of a model, in the order they are evaluated at load: the same arrays
/// the parts hold (shared handles), taken rather than borrowed because a linear layer's
/// matrix may be replaced while the model serves ([`super::layers::MatrixCell`]).
#[derive(Default)]
pub(crate) struct Params<'a>(Vec<Array>, PhantomData<&'a ()>);

impl<'a> Params<'a> {
    /// Appends the arrays of `part`.
    pub fn add<P: Parameters + ?Sized>(&mut self, part: &'a P) -> &mut Self {
        part.push_params(self);
        self
    }

    /// Evaluates every parameter (reading it from disk now), reporting the bytes read;
    /// returns the bytes held.
    pub fn materialize(&self, reporter: Option<&LoadReporter>) -> Result<usize, LoadError> {
        crate::loader::materialize(&self.0.iter().collect::<Vec<_>>(), reporter)
    }
}

/// The arrays of `part`, in order.
pub(crate) fn parameters_of<P: Parameters + ?Sized>(part: &P) -> Vec<Array> {
    let mut p = Params::default();
    p.add(part);
    p.0
}

impl Parameters for Array {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.0.push(self.clone());
    }
}

impl Parameters for Matrix {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match self {
            Matrix::Dense(w) => p.add(w),
            Matrix::Quantized(q) => p.add(&q.weight).add(&q.scales).add(&q.biases),
        };
    }
}

impl Parameters for MatrixCell {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.0.extend(self.with(parameters_of));
    }
}

impl Parameters for Linear {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.matrix).add(&self.bias);
    }
}

impl Parameters for RmsNorm {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight);
    }
}

impl Parameters for LayerNorm {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight).add(&self.bias);
    }
}

impl<T: Parameters> Parameters for Option<T> {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        if let Some(part) = self {
            p.add(part);
        }
    }
}

impl<T: Parameters> Parameters for [T] {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        for part in self {
            p.add(part);
        }
    }
}

impl<T: Parameters> Parameters for Vec<T> {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(self.as_slice());
    }
}

impl<T: Parameters + ?Sized> Parameters for Box<T> {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&**self);
    }
}
