//! Reading a rank's part of a checkpoint tensor straight from its safetensors file, so that a
//! rank of an engine group reads its own bytes and never the other ranks' parts.
//!
//! MLX loads a safetensors tensor whole (one read of its bytes when the lazy array is first
//! evaluated), and a slice of it evaluates that whole read. Here the file's header (an 8-byte
//! little-endian length, then JSON: per tensor its `dtype`, `shape` and `data_offsets` from
//! the end of the header) says where each tensor lies, and a part — a range along one axis,
//! every other axis whole ([`Piece::Range`]) — is read as runs of contiguous bytes: one run per
//! index of the axes in front of the split one. A split of the first axis of a matrix (its rows,
//! a column split of a linear layer) is one run; a split of its last axis (its columns, a row
//! split) is one run per row, each a row's share; a stack of experts adds a factor of the expert
//! count. Nothing outside the rank's part is read.
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use super::shard::Piece;
use crate::loader::LoadError;

/// The largest header the safetensors format allows (its own reader refuses more).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// An open weight file and its path (for messages).
struct WeightFile {
    path: PathBuf,
    file: File,
}

/// Where one tensor lies in a safetensors file.
pub struct TensorOnDisk {
    file: Arc<WeightFile>,
    /// The file offset of its first byte.
    start: u64,
    dtype: Dtype,
    shape: Vec<i32>,
}

/// One header entry as the safetensors format writes it.
#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [u64; 2],
}

/// The MLX dtype and item size of a safetensors dtype the loader accepts (others are refused
/// when the files are opened, so they are never read here).
fn dtype_of(name: &str) -> Option<(Dtype, usize)> {
    Some(match name {
        "F32" => (Dtype::Float32, 4),
        "F16" => (Dtype::Float16, 2),
        "BF16" => (Dtype::Bfloat16, 2),
        "U32" => (Dtype::Uint32, 4),
        "U8" => (Dtype::Uint8, 1),
        _ => return None,
    })
}

fn item_size(dtype: Dtype) -> usize {
    match dtype {
        Dtype::Float32 | Dtype::Uint32 => 4,
        Dtype::Float16 | Dtype::Bfloat16 => 2,
        _ => 1,
    }
}

fn io_error(path: &Path, source: std::io::Error) -> LoadError {
    LoadError::Io {
        path: path.into(),
        source,
    }
}

fn corrupt(path: &Path, message: String) -> LoadError {
    LoadError::Safetensors {
        path: path.into(),
        message,
    }
}

/// Where every tensor of `files` lies (tensors of a dtype the loader does not accept are left
/// out). Reads only the files' headers.
pub fn index(files: &[PathBuf]) -> Result<HashMap<String, TensorOnDisk>, LoadError> {
    let mut tensors = HashMap::new();
    for path in files {
        let file = File::open(path).map_err(|e| io_error(path, e))?;
        let mut length = [0u8; 8];
        file.read_exact_at(&mut length, 0)
            .map_err(|e| io_error(path, e))?;
        let length = u64::from_le_bytes(length);
        if length > MAX_HEADER_BYTES {
            return Err(corrupt(
                path,
                format!("its header claims {length} bytes (at most {MAX_HEADER_BYTES})"),
            ));
        }
        let mut header = vec![0u8; length as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| io_error(path, e))?;
        let header: HashMap<String, serde_json::Value> = serde_json::from_slice(&header)
            .map_err(|e| corrupt(path, format!("its header is not JSON: {e}")))?;
        let file = Arc::new(WeightFile {
            path: path.clone(),
            file,
        });
        for (name, value) in header {
            if name == "__metadata__" {
                continue;
            }
            let entry: HeaderEntry = serde_json::from_value(value)
                .map_err(|e| corrupt(path, format!("its header entry for {name}: {e}")))?;
            let Some((dtype, item)) = dtype_of(&entry.dtype) else {
                continue;
            };
            let shape: Vec<i32> = entry
                .shape
                .iter()
                .map(|&d| i32::try_from(d))
                .collect::<Result<_, _>>()
                .map_err(|_| corrupt(path, format!("{name} has shape {:?}", entry.shape)))?;
            let [begin, end] = entry.data_offsets;
            let count: u64 = shape.iter().map(|&d| d.max(0) as u64).product();
            if end < begin || end - begin != count * item as u64 {
                return Err(corrupt(
                    path,
                    format!(
                        "{name}'s data offsets {begin}..{end} do not hold its shape {shape:?} \
                         of {}",
                        entry.dtype
                    ),
                ));
            }
            tensors.insert(
                name,
                TensorOnDisk {
                    file: file.clone(),
                    start: 8 + length + begin,
                    dtype,
                    shape,
                },
            );
        }
    }
    Ok(tensors)
}

impl TensorOnDisk {
    /// Whether the file's tensor is `array` as MLX loaded it (same dtype and shape): a tensor
    /// read here replaces that array.
    pub fn describes(&self, array: &Array) -> bool {
        self.dtype == array.dtype() && self.shape == array.shape()
    }

    /// The part `piece` of the tensor, read from the file, and the bytes read.
    /// [`Piece::Whole`] reads all of it; [`Piece::Zeros`] reads nothing.
    pub fn read(&self, piece: Piece) -> Result<(Array, u64), LoadError> {
        let (axis, from, len) = match piece {
            Piece::Whole => (0, 0, self.shape.first().copied().unwrap_or(1)),
            Piece::Zeros => {
                return Ok((mlx_rs::ops::zeros_dtype(&self.shape, self.dtype)?, 0));
            }
            Piece::Range { axis, start, len } => (axis, start, len),
        };
        let item = item_size(self.dtype);
        let dims: Vec<usize> = self.shape.iter().map(|&d| d.max(0) as usize).collect();
        let (from, len) = (from.max(0) as usize, len.max(0) as usize);
        // A scalar tensor is one item: one run of one.
        let extent = dims.get(axis).copied().unwrap_or(1);
        if from + len > extent {
            return Err(corrupt(
                &self.file.path,
                format!(
                    "entries {from}..{} of axis {axis} lie outside shape {:?}",
                    from + len,
                    self.shape
                ),
            ));
        }
        let outer: usize = dims.iter().take(axis).product();
        let inner: usize = dims.iter().skip(axis + 1).product::<usize>() * item;
        let run = len * inner;
        let mut bytes = vec![0u8; outer * run];
        if run > 0 {
            for (o, chunk) in bytes.chunks_exact_mut(run).enumerate() {
                let offset = self.start + ((o * extent + from) * inner) as u64;
                self.file
                    .file
                    .read_exact_at(chunk, offset)
                    .map_err(|e| io_error(&self.file.path, e))?;
            }
        }
        let mut shape = self.shape.clone();
        if let Some(d) = shape.get_mut(axis) {
            *d = len as i32;
        }
        // SAFETY: `bytes` holds exactly the shape's element count of `dtype` items (little
        // endian, as safetensors stores them and as the CPUs MLX runs on hold them), and MLX
        // copies them before this returns.
        let array = unsafe { Array::from_raw_data(bytes.as_ptr().cast(), &shape, self.dtype) };
        Ok((array, bytes.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::{ShardPlan, Split};

    fn values(a: &Array) -> Vec<f32> {
        a.as_slice::<f32>().to_vec()
    }

    /// A file with one `[2, 4, 6]` float tensor (a stack of two experts) and one `[4, 6]`
    /// matrix, their values counting up.
    fn write_file(dir: &Path) -> PathBuf {
        let stack: Vec<f32> = (0..48).map(|v| v as f32).collect();
        let matrix: Vec<f32> = (0..24).map(|v| 100.0 + v as f32).collect();
        let arrays = HashMap::from([
            (
                "m.switch_mlp.up_proj.weight".to_owned(),
                Array::from_slice(&stack, &[2, 4, 6]),
            ),
            (
                "m.o_proj.weight".to_owned(),
                Array::from_slice(&matrix, &[4, 6]),
            ),
        ]);
        let path = dir.join("model.safetensors");
        Array::save_safetensors(arrays, None, &path).unwrap();
        path
    }

    #[test]
    fn a_ranks_part_read_from_the_file_equals_the_cut_of_the_whole_and_reads_only_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path());
        let index = index(std::slice::from_ref(&path)).unwrap();
        let whole = Array::load_safetensors(&path).unwrap();
        for rank in 0..2 {
            let plan = ShardPlan::new(rank, 2)
                .split("switch_mlp.up_proj", Split::Column)
                .split("o_proj", Split::Row);
            for name in ["m.switch_mlp.up_proj.weight", "m.o_proj.weight"] {
                let on_disk = &index[name];
                assert!(on_disk.describes(&whole[name]));
                let piece = plan.piece(name, &on_disk.shape).unwrap();
                let (read, bytes) = on_disk.read(piece).unwrap();
                let cut = plan.cut(name, whole[name].clone()).unwrap();
                assert_eq!(read.shape(), cut.shape(), "{name} rank {rank}");
                assert_eq!(values(&read), values(&cut), "{name} rank {rank}");
                // Half of the tensor's bytes: the other rank's half is not read.
                assert_eq!(bytes as usize, whole[name].nbytes() / 2, "{name}");
            }
        }
    }

    #[test]
    fn whole_and_zero_pieces() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path());
        let index = index(&[path]).unwrap();
        let (whole, bytes) = index["m.o_proj.weight"].read(Piece::Whole).unwrap();
        assert_eq!(bytes, 24 * 4);
        assert_eq!(values(&whole)[23], 123.0);
        let (zeros, bytes) = index["m.o_proj.weight"].read(Piece::Zeros).unwrap();
        assert_eq!((zeros.shape(), bytes), (&[4, 6][..], 0));
    }

    #[test]
    fn a_truncated_file_fails_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path());
        let len = std::fs::metadata(&path).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(len - 8).unwrap();
        let index = index(std::slice::from_ref(&path)).unwrap();
        // The tensor stored last lies (partly) past the new end.
        let failed = ["m.o_proj.weight", "m.switch_mlp.up_proj.weight"]
            .iter()
            .filter_map(|name| index[*name].read(Piece::Whole).err())
            .map(|e| e.to_string())
            .collect::<Vec<_>>();
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].contains("model.safetensors"), "{failed:?}");
    }
}
