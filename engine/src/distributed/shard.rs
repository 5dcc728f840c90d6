//! Tensor parallelism at load time: which checkpoint tensors a family divides among a group's
//! ranks and how, and the slicing that leaves each rank only its part (mlx-lm's `shard()` with
//! `shard_linear`, done as the weights are read instead of after).
//!
//! A linear layer `y = x Wᵀ` with `W` `[out, in]` is split one of two ways:
//! - **by column** (its outputs): rank `r` keeps rows `r·out/n ..` of `W` (and of a bias), so
//!   it computes its share of the output features (q/k/v/gate/up: its own heads, its share of
//!   the hidden MLP features);
//! - **by row** (its inputs): rank `r` keeps columns `r·in/n ..`, so it computes a partial
//!   sum of the whole output that an `all_sum` completes (o/down). A bias is added once: rank
//!   0 keeps it, the others hold zeros.
//!
//! MLX-quantized matrices split the same way: the packed weight, its scales and its biases are
//! cut along the same axis (by row, in whole quantization groups).
use mlx_rs::Array;

use super::Group;
use crate::loader::LoadError;

/// How one linear layer is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// By output features (rows of `W`).
    Column,
    /// By input features (columns of `W`); outputs are partial sums.
    Row,
}

/// The layers a family divides: a layer whose name (`model.layers.3.self_attn.q_proj`) ends
/// with `suffix` is split as `split`.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub rank: usize,
    pub size: usize,
    rules: Vec<(String, Split)>,
}

impl ShardPlan {
    /// An empty plan for rank `rank` of `size`.
    pub fn new(rank: usize, size: usize) -> Self {
        Self {
            rank,
            size,
            rules: Vec::new(),
        }
    }

    /// The plan of `group`'s rank.
    pub fn for_group(group: &Group) -> Self {
        Self::new(group.rank(), group.size())
    }

    /// Splits every layer whose name ends with `suffix` as `split`.
    pub fn split(mut self, suffix: &str, split: Split) -> Self {
        self.rules.push((format!(".{suffix}"), split));
        self
    }

    /// The split of the layer that the tensor `name` belongs to, and which part of it the
    /// tensor is.
    fn rule(&self, name: &str) -> Option<(Split, Part)> {
        let (layer, part) = name.rsplit_once('.')?;
        let part = match part {
            "weight" => Part::Weight,
            "scales" | "biases" => Part::Quantization,
            "bias" => Part::Bias,
            _ => return None,
        };
        self.rules
            .iter()
            .find(|(suffix, _)| layer.ends_with(suffix.as_str()))
            .map(|(_, split)| (*split, part))
    }

    /// Which part of the tensor `name`, of shape `shape`, is this rank's (the whole tensor
    /// when the plan does not divide its layer). An axis that `size` ranks cannot share
    /// equally fails, naming the tensor.
    pub fn piece(&self, name: &str, shape: &[i32]) -> Result<Piece, LoadError> {
        let Some((split, part)) = self.rule(name) else {
            return Ok(Piece::Whole);
        };
        let n = self.size as i32;
        // The last two axes are a matrix's `[out, in]` (a stack of experts' matrices has one
        // more in front); a bias is `[out]` (or one per expert).
        let last = shape.len() as i32 - 1;
        let axis = match (split, part) {
            (Split::Column, Part::Bias) => last,
            (Split::Column, _) => last - 1,
            // Added once, after the partial sums are summed: rank 0's.
            (Split::Row, Part::Bias) if self.rank == 0 => return Ok(Piece::Whole),
            (Split::Row, Part::Bias) => return Ok(Piece::Zeros),
            (Split::Row, _) => last,
        };
        let Some(&len) = usize::try_from(axis).ok().and_then(|a| shape.get(a)) else {
            return Err(LoadError::Config(format!(
                "{name} has no axis {axis} to divide among the ranks"
            )));
        };
        if len % n != 0 {
            return Err(LoadError::Config(format!(
                "{name} has {len} {} along the axis tensor parallelism divides, which {n} ranks \
                 cannot share equally",
                match (split, part) {
                    (Split::Row, Part::Quantization) => "quantization groups",
                    (Split::Row, Part::Weight) => "input columns (packed)",
                    _ => "output rows",
                }
            )));
        }
        let share = len / n;
        Ok(Piece::Range {
            axis: axis as usize,
            start: self.rank as i32 * share,
            len: share,
        })
    }

    /// This rank's part of the tensor `name` (the tensor itself when the plan does not divide
    /// its layer), cut from the array in memory, as an array of its own: a slice would keep
    /// the whole tensor's buffer alive. (The loader reads a checkpoint tensor's part from its
    /// file instead, `distributed::shard_read`; this serves tensors a sanitize step made.)
    pub fn cut(&self, name: &str, tensor: Array) -> Result<Array, LoadError> {
        match self.piece(name, tensor.shape())? {
            Piece::Whole => Ok(tensor),
            Piece::Zeros => Ok(mlx_rs::ops::zeros_like(&tensor)?),
            Piece::Range { axis, .. } => {
                let piece = tensor
                    .split_equal(self.size as i32, axis as i32)?
                    .swap_remove(self.rank);
                Ok(piece.contiguous()?)
            }
        }
    }
}

/// A rank's part of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// All of it (a tensor the plan does not divide, or rank 0's row-split bias).
    Whole,
    /// Zeros of its shape (a row-split bias on ranks other than 0): nothing to read.
    Zeros,
    /// `len` entries from `start` along `axis`, every other axis whole.
    Range { axis: usize, start: i32, len: i32 },
}

/// Which of a layer's tensors a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Weight,
    /// A quantized matrix's scales or biases (laid out like its weight).
    Quantization,
    /// The layer's bias (one value per output).
    Bias,
}

/// Checks that `ranks` can share `heads` query heads and `kv_heads` KV heads equally (what a
/// column split of q/k/v needs), naming the model's counts when they cannot.
pub fn check_heads(heads: i32, kv_heads: i32, ranks: usize) -> Result<(), LoadError> {
    let n = ranks as i32;
    if heads % n != 0 || kv_heads % n != 0 {
        return Err(LoadError::Config(format!(
            "tensor parallelism over {ranks} ranks needs the attention heads divided equally, \
             but the model has {heads} query heads and {kv_heads} KV heads; use a rank count \
             that divides both"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: i32, cols: i32) -> Array {
        let data: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        Array::from_slice(&data, &[rows, cols])
    }

    fn values(a: &Array) -> Vec<f32> {
        a.as_slice::<f32>().to_vec()
    }

    fn plan(rank: usize) -> ShardPlan {
        ShardPlan::new(rank, 2)
            .split("q_proj", Split::Column)
            .split("o_proj", Split::Row)
    }

    #[test]
    fn columns_take_output_rows_and_rows_take_input_columns() {
        let q = plan(1).cut("l.0.q_proj.weight", matrix(4, 3)).unwrap();
        assert_eq!(q.shape(), &[2, 3]);
        assert_eq!(values(&q), vec![6., 7., 8., 9., 10., 11.]);
        let o = plan(1).cut("l.0.o_proj.weight", matrix(3, 4)).unwrap();
        assert_eq!(o.shape(), &[3, 2]);
        assert_eq!(values(&o), vec![2., 3., 6., 7., 10., 11.]);
    }

    #[test]
    fn a_row_split_bias_is_added_by_rank_zero_only() {
        let bias = Array::from_slice(&[1f32, 2., 3.], &[3]);
        assert_eq!(
            values(&plan(0).cut("a.o_proj.bias", bias.clone()).unwrap()),
            vec![1., 2., 3.]
        );
        assert_eq!(
            values(&plan(1).cut("a.o_proj.bias", bias).unwrap()),
            vec![0., 0., 0.]
        );
        let bias = Array::from_slice(&[1f32, 2., 3., 4.], &[4]);
        assert_eq!(
            values(&plan(1).cut("a.q_proj.bias", bias).unwrap()),
            vec![3., 4.]
        );
    }

    #[test]
    fn other_tensors_are_whole_and_uneven_splits_fail_naming_the_tensor() {
        let norm = plan(1).cut("a.q_norm.weight", matrix(1, 3)).unwrap();
        assert_eq!(norm.shape(), &[1, 3]);
        let err = plan(0)
            .cut("a.q_proj.weight", matrix(3, 2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a.q_proj.weight") && err.contains("3 output rows"),
            "{err}"
        );
    }

    #[test]
    fn stacked_experts_split_their_own_matrices() {
        // [experts 2, out 4, in 2]: rank 1 keeps rows 2..4 of each expert's matrix.
        let data: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let experts = Array::from_slice(&data, &[2, 4, 2]);
        let plan = ShardPlan::new(1, 2)
            .split("switch_mlp.up_proj", Split::Column)
            .split("switch_mlp.down_proj", Split::Row);
        let up = plan
            .cut("m.switch_mlp.up_proj.weight", experts.clone())
            .unwrap();
        assert_eq!(up.shape(), &[2, 2, 2]);
        assert_eq!(values(&up), vec![4., 5., 6., 7., 12., 13., 14., 15.]);
        let down = plan.cut("m.switch_mlp.down_proj.weight", experts).unwrap();
        assert_eq!(down.shape(), &[2, 4, 1]);
        assert_eq!(values(&down), vec![1., 3., 5., 7., 9., 11., 13., 15.]);
    }

    #[test]
    fn heads_must_divide() {
        assert!(check_heads(4, 2, 2).is_ok());
        let err = check_heads(4, 1, 2).unwrap_err().to_string();
        assert!(err.contains("4 query heads and 1 KV heads"), "{err}");
    }
}
