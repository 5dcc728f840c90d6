//! A loaded model together with its [`AdapterTable`]: what the registry's loader returns for
//! a model loaded whole, so that the runtime finds the table without any family knowing of
//! adapters.
use std::sync::Arc;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::AdapterTable;
use crate::cache::{LayerCache, LayerKind};
use crate::models::{CausalLm, Feature, ModelInfo};

/// A family's model and the adapter table its linear layers registered in while it loaded.
/// Every [`CausalLm`] method is the family's own (each is forwarded, defaults included, so
/// that a family's overrides hold).
pub struct Adapted {
    inner: Box<dyn CausalLm>,
    table: Arc<AdapterTable>,
}

impl Adapted {
    pub fn new(inner: Box<dyn CausalLm>, table: Arc<AdapterTable>) -> Self {
        Self { inner, table }
    }
}

impl CausalLm for Adapted {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        self.inner.hidden(tokens, caches)
    }
    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        self.inner.head(hidden)
    }
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        self.inner.forward(tokens, caches)
    }
    fn forward_last(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        self.inner.forward_last(tokens, caches)
    }
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn refuses(&self, feature: Feature) -> Option<String> {
        self.inner.refuses(feature)
    }
    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.inner.layer_windows()
    }
    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.inner.layer_kinds()
    }
    fn new_dense_caches(&self) -> Vec<LayerCache> {
        self.inner.new_dense_caches()
    }
    fn adapters(&self) -> Option<&Arc<AdapterTable>> {
        Some(&self.table)
    }
}
