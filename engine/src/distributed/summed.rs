//! A block branch whose last projection is split by row ([`super::Split::Row`]): each rank's
//! output is a partial sum, completed by an `all_sum` over the group, after which every rank
//! holds the same activations.
use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::Group;
use crate::cache::LayerCache;
use crate::models::attention::SelfAttention;
use crate::models::layers::Queries;
use crate::models::mlp::FeedForward;
use crate::models::params::{Parameters, Params};

/// `inner`'s output summed over `group`; without a group (one process), `inner` alone.
pub(crate) struct Summed<T> {
    inner: T,
    group: Option<Group>,
}

impl<T> Summed<T> {
    pub fn new(inner: T, group: Option<Group>) -> Self {
        Self { inner, group }
    }

    fn complete(&self, partial: Array) -> Result<Array, Exception> {
        match &self.group {
            Some(group) => group.all_sum(&partial),
            None => Ok(partial),
        }
    }
}

// Every method is forwarded, so that the inner part's own versions hold (an output projection
// that takes the residual add into its kernel, attention for the last query alone). The adds
// go to the inner part only outside a group: a rank's output is a partial sum, and each rank
// adding the residual before the sum would count it once per rank.
impl<T: SelfAttention> SelfAttention for Summed<T> {
    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        let partial = self.inner.attend(x, cache, which)?;
        self.complete(partial)
    }

    fn attend_add(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
        residual: &Array,
    ) -> Result<Array, Exception> {
        match self.group {
            None => self.inner.attend_add(x, cache, which, residual),
            Some(_) => residual.add(self.attend(x, cache, which)?),
        }
    }

    fn window(&self) -> Option<usize> {
        self.inner.window()
    }
}

impl<T: FeedForward> FeedForward for Summed<T> {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let partial = self.inner.forward(x)?;
        self.complete(partial)
    }

    fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array, Exception> {
        match self.group {
            None => self.inner.forward_add(x, residual),
            Some(_) => residual.add(self.forward(x)?),
        }
    }
}

impl<T: Parameters> Parameters for Summed<T> {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.inner);
    }
}
