//! The rotary position embedding as one type that both the models (which build it from their
//! configs, in `models::rope`) and the KV caches (which rotate at each row's own offset) use;
//! it sits at the crate root so that `cache` needs nothing from `models`.
use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::Array;

type Result<T> = std::result::Result<T, Exception>;

/// Rotary position embedding, plain (`nn.RoPE`) or with precomputed frequencies (Llama 3).
#[derive(Debug)]
pub struct Rope {
    pub dims: i32,
    pub traditional: bool,
    pub base: f32,
    pub scale: f32,
    pub freqs: Option<Array>,
}

impl Rope {
    /// Per-row offsets `[B]` (int32) for a batch whose rows sit at different positions.
    pub fn forward_per_row(&self, x: &Array, offsets: &Array) -> Result<Array> {
        match &self.freqs {
            Some(freqs) => {
                fast::rope_dynamic(x, self.dims, self.traditional, None, 1.0, offsets, freqs)
            }
            None => fast::rope_dynamic(
                x,
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                offsets,
                None,
            ),
        }
    }

    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        match &self.freqs {
            Some(freqs) => fast::rope(x, self.dims, self.traditional, None, 1.0, offset, freqs),
            None => fast::rope(
                x,
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                offset,
                None,
            ),
        }
    }
}
