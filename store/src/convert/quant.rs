//! Repacking GGML block quantization into MLX's affine quantization, and float conversion.
//!
//! MLX affine quantization stores, per group of `group_size` consecutive weights of a row, a
//! scale and a bias (`w = scale * q + bias`, `q` unsigned), and packs the `q`s of a row into
//! little-endian `u32` words: value `i` of a word sits in bits `bits*i .. bits*(i+1)`.
//!
//! - Q4_1 (`d`, `m`, 32 nibbles; `w = d*q + m`) is exactly affine 4-bit with scale `d`, bias `m`.
//! - Q4_0 (`d`, 32 nibbles; `w = d*(q-8)`) is affine 4-bit with scale `d`, bias `-8d`.
//! - Q8_0 (`d`, 32 `i8`; `w = d*q`) is affine 8-bit with `q' = q+128`, scale `d`, bias `-128d`.
//!
//! In all three, element `j < 16` of a 4-bit block is the low nibble of byte `j` and element
//! `j + 16` the high nibble. Scales and biases keep GGML's `f16`, so nothing is rounded.
use half::{bf16, f16};

use super::gguf::GgmlType;
use super::ConvertError;

/// GGML's block size for the quantizations we repack, which becomes MLX's group size.
pub const GROUP_SIZE: usize = 32;

/// A matrix in MLX affine quantized form.
#[derive(Debug, Clone, PartialEq)]
pub struct AffineQuant {
    pub bits: u32,
    pub group_size: usize,
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols * bits / 32` little-endian `u32` words, as bytes.
    pub weight: Vec<u8>,
    /// `rows * cols / group_size` little-endian `f16`s, as bytes.
    pub scales: Vec<u8>,
    /// Same shape as `scales`.
    pub biases: Vec<u8>,
}

impl AffineQuant {
    /// The dequantized values, row-major, for checks.
    pub fn dequantize(&self) -> Vec<f32> {
        let per_word = 32 / self.bits as usize;
        let mask = (1u32 << self.bits) - 1;
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            for c in 0..self.cols {
                let idx = r * self.cols + c;
                let w = idx / per_word;
                let word = u32::from_le_bytes(self.weight[4 * w..4 * w + 4].try_into().unwrap());
                let q = (word >> (self.bits as usize * (idx % per_word))) & mask;
                let g = idx / self.group_size;
                let s = read_f16(&self.scales, g).to_f32();
                let b = read_f16(&self.biases, g).to_f32();
                out.push(s * q as f32 + b);
            }
        }
        out
    }
}

fn read_f16(bytes: &[u8], i: usize) -> f16 {
    f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])
}

/// Checks that `data` holds `rows` rows of `cols` elements of `ty`, and that `row_order` is a
/// permutation of the rows; returns the bytes per source row.
fn check_layout(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    row_order: &[usize],
) -> Result<usize, ConvertError> {
    let (block, block_bytes) = ty.block_layout();
    let (block, block_bytes) = (block as usize, block_bytes as usize);
    if !cols.is_multiple_of(block) {
        return Err(ConvertError::Shape(format!(
            "{name}: row length {cols} is not a multiple of the {ty:?} block size {block}"
        )));
    }
    let row_bytes = cols / block * block_bytes;
    if data.len() != rows * row_bytes {
        return Err(ConvertError::Shape(format!(
            "{name}: {ty:?} data is {} bytes, expected {rows} rows x {row_bytes} bytes",
            data.len()
        )));
    }
    if row_order.len() != rows {
        return Err(ConvertError::Shape(format!(
            "{name}: row permutation has {} entries for {rows} rows",
            row_order.len()
        )));
    }
    Ok(row_bytes)
}

/// Repacks a Q4_0, Q4_1 or Q8_0 matrix of `rows x cols` (row-major, rows of whole blocks) into
/// MLX affine form, writing source row `row_order[i]` as output row `i`.
pub fn repack(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    row_order: &[usize],
) -> Result<AffineQuant, ConvertError> {
    let bits = match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => 4,
        GgmlType::Q8_0 => 8,
        other => {
            return Err(ConvertError::UnsupportedTensorType {
                name: name.to_string(),
                ggml_type: format!("{other:?} (quantized types supported: Q4_0, Q4_1, Q8_0)"),
            })
        }
    };
    let row_bytes = check_layout(name, ty, data, rows, cols, row_order)?;
    let (_, block_bytes) = ty.block_layout();
    let block_bytes = block_bytes as usize;
    let groups = rows * cols / GROUP_SIZE;
    let mut weight = Vec::with_capacity(rows * cols * bits / 8);
    let mut scales = Vec::with_capacity(groups * 2);
    let mut biases = Vec::with_capacity(groups * 2);
    for &src in row_order {
        if src >= rows {
            return Err(ConvertError::Shape(format!(
                "{name}: row permutation names row {src} of {rows}"
            )));
        }
        let row = &data[src * row_bytes..(src + 1) * row_bytes];
        for blk in row.chunks_exact(block_bytes) {
            let d = f16::from_le_bytes([blk[0], blk[1]]);
            match ty {
                GgmlType::Q4_1 => {
                    scales.extend_from_slice(&blk[0..2]);
                    biases.extend_from_slice(&blk[2..4]);
                    pack_nibbles(&blk[4..20], &mut weight);
                }
                GgmlType::Q4_0 => {
                    scales.extend_from_slice(&blk[0..2]);
                    biases.extend_from_slice(&exact_multiple(name, d, -8.0)?.to_le_bytes());
                    pack_nibbles(&blk[2..18], &mut weight);
                }
                GgmlType::Q8_0 => {
                    scales.extend_from_slice(&blk[0..2]);
                    biases.extend_from_slice(&exact_multiple(name, d, -128.0)?.to_le_bytes());
                    // q' = q + 128 maps i8 onto u8 by flipping the sign bit.
                    for word in blk[2..34].chunks_exact(4) {
                        weight.extend(word.iter().map(|&b| b ^ 0x80));
                    }
                }
                _ => unreachable!("bits chosen above"),
            }
        }
    }
    Ok(AffineQuant {
        bits: bits as u32,
        group_size: GROUP_SIZE,
        rows,
        cols,
        weight,
        scales,
        biases,
    })
}

/// `d * k` in f16, which is exact for a power of two unless it overflows.
fn exact_multiple(name: &str, d: f16, k: f32) -> Result<f16, ConvertError> {
    let v = d.to_f32() * k;
    let h = f16::from_f32(v);
    if d.is_finite() && !h.is_finite() {
        return Err(ConvertError::Shape(format!(
            "{name}: block scale {d} times {k} = {v} overflows f16 (max {})",
            f16::MAX
        )));
    }
    Ok(h)
}

/// Packs 32 nibbles (element j low nibble of byte j, element j+16 high nibble) into 4 words.
fn pack_nibbles(qs: &[u8], out: &mut Vec<u8>) {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 0x0f;
        q[j + 16] = qs[j] >> 4;
    }
    for eight in q.chunks_exact(8) {
        let mut word = 0u32;
        for (i, &v) in eight.iter().enumerate() {
            word |= (v as u32) << (4 * i);
        }
        out.extend_from_slice(&word.to_le_bytes());
    }
}

/// The float type written for unquantized tensors and for scales and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FloatDtype {
    /// GGML's own precision for scales and biases; half the size of f32.
    #[default]
    F16,
    /// For backends where f16 arithmetic is slow (MLX's CPU build: quantized matmuls with f16
    /// scales measured ~50x slower than with f32).
    F32,
}

impl FloatDtype {
    pub fn bytes(self) -> usize {
        match self {
            FloatDtype::F16 => 2,
            FloatDtype::F32 => 4,
        }
    }

    /// The name config.json's `torch_dtype` uses.
    pub fn torch_name(self) -> &'static str {
        match self {
            FloatDtype::F16 => "float16",
            FloatDtype::F32 => "float32",
        }
    }
}

/// Widens little-endian f16 bytes to f32 bytes when `dtype` asks for it (exact).
pub fn f16_bytes_as(dtype: FloatDtype, bytes: Vec<u8>) -> Vec<u8> {
    match dtype {
        FloatDtype::F16 => bytes,
        FloatDtype::F32 => bytes
            .chunks_exact(2)
            .flat_map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32().to_le_bytes())
            .collect(),
    }
}

/// Converts an F32, F16 or BF16 tensor of `rows x cols` to `dtype` bytes, writing source row
/// `row_order[i]` as output row `i`. A finite value too large for f16 is an error.
pub fn to_float(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    row_order: &[usize],
    dtype: FloatDtype,
) -> Result<Vec<u8>, ConvertError> {
    if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16) {
        return Err(ConvertError::UnsupportedTensorType {
            name: name.to_string(),
            ggml_type: format!("{ty:?} (float types supported: F32, F16, BF16)"),
        });
    }
    let row_bytes = check_layout(name, ty, data, rows, cols, row_order)?;
    let mut out = Vec::with_capacity(rows * cols * dtype.bytes());
    let mut push = |v: f32| -> Result<(), ConvertError> {
        match dtype {
            FloatDtype::F16 => out.extend_from_slice(&checked_f16(name, v)?.to_le_bytes()),
            FloatDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
        }
        Ok(())
    };
    for &src in row_order {
        if src >= rows {
            return Err(ConvertError::Shape(format!(
                "{name}: row permutation names row {src} of {rows}"
            )));
        }
        let row = &data[src * row_bytes..(src + 1) * row_bytes];
        match ty {
            GgmlType::F16 => {
                for b in row.chunks_exact(2) {
                    push(f16::from_le_bytes([b[0], b[1]]).to_f32())?;
                }
            }
            GgmlType::F32 => {
                for b in row.chunks_exact(4) {
                    push(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))?;
                }
            }
            GgmlType::Bf16 => {
                for b in row.chunks_exact(2) {
                    push(bf16::from_le_bytes([b[0], b[1]]).to_f32())?;
                }
            }
            _ => unreachable!("checked above"),
        }
    }
    Ok(out)
}

fn checked_f16(name: &str, v: f32) -> Result<f16, ConvertError> {
    let h = f16::from_f32(v);
    if v.is_finite() && !h.is_finite() {
        return Err(ConvertError::Shape(format!(
            "{name}: value {v} does not fit in f16 (max {})",
            f16::MAX
        )));
    }
    Ok(h)
}

/// The row order that undoes llama.cpp's Q/K permutation: within each head, GGUF row
/// `2i + j` (i < head_dim/2, j < 2) holds Hugging Face row `j * head_dim/2 + i`.
pub fn unpermute_qk_rows(
    name: &str,
    rows: usize,
    n_heads: usize,
) -> Result<Vec<usize>, ConvertError> {
    if n_heads == 0 || !rows.is_multiple_of(n_heads) || !(rows / n_heads).is_multiple_of(2) {
        return Err(ConvertError::Shape(format!(
            "{name}: {rows} rows do not split into {n_heads} heads of an even size"
        )));
    }
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                order.push(h * head_dim + 2 * i + j);
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(n: usize) -> Vec<usize> {
        (0..n).collect()
    }

    fn q4_1_block(d: f32, m: f32, q: &[u8; 32]) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        b.extend_from_slice(&f16::from_f32(m).to_le_bytes());
        for j in 0..16 {
            b.push(q[j] | (q[j + 16] << 4));
        }
        b
    }

    fn ggml_q4_1(d: f32, m: f32, q: &[u8; 32]) -> Vec<f32> {
        let (d, m) = (f16::from_f32(d).to_f32(), f16::from_f32(m).to_f32());
        q.iter().map(|&v| d * v as f32 + m).collect()
    }

    #[test]
    fn q4_1_repacks_losslessly() {
        let qa: [u8; 32] = std::array::from_fn(|i| (i * 7 % 16) as u8);
        let qb: [u8; 32] = std::array::from_fn(|i| (15 - i % 16) as u8);
        // Two rows, two blocks each.
        let mut data = q4_1_block(0.5, -1.0, &qa);
        data.extend(q4_1_block(0.25, 2.0, &qb));
        data.extend(q4_1_block(-0.125, 0.0, &qb));
        data.extend(q4_1_block(1.0, 0.5, &qa));
        let a = repack("t", GgmlType::Q4_1, &data, 2, 64, &identity(2)).unwrap();
        assert_eq!((a.bits, a.group_size), (4, 32));
        assert_eq!(a.weight.len(), 2 * 64 / 2);
        assert_eq!(a.scales.len(), 2 * 2 * 2);
        // First word holds elements 0..8 of row 0, element i in bits 4i..4i+4.
        let w0 = u32::from_le_bytes(a.weight[0..4].try_into().unwrap());
        for (i, &q) in qa.iter().take(8).enumerate() {
            assert_eq!((w0 >> (4 * i)) & 0xf, q as u32);
        }
        let mut expected = ggml_q4_1(0.5, -1.0, &qa);
        expected.extend(ggml_q4_1(0.25, 2.0, &qb));
        expected.extend(ggml_q4_1(-0.125, 0.0, &qb));
        expected.extend(ggml_q4_1(1.0, 0.5, &qa));
        assert_eq!(a.dequantize(), expected);

        // Swapping rows moves whole rows with their scales and biases.
        let s = repack("t", GgmlType::Q4_1, &data, 2, 64, &[1, 0]).unwrap();
        let deq = s.dequantize();
        assert_eq!(&deq[..64], &expected[64..]);
        assert_eq!(&deq[64..], &expected[..64]);
    }

    #[test]
    fn q4_0_and_q8_0_repack_losslessly() {
        let q: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
        let mut b = f16::from_f32(0.75).to_le_bytes().to_vec();
        for j in 0..16 {
            b.push(q[j] | (q[j + 16] << 4));
        }
        let a = repack("t", GgmlType::Q4_0, &b, 1, 32, &[0]).unwrap();
        let want: Vec<f32> = q.iter().map(|&v| 0.75 * (v as f32 - 8.0)).collect();
        assert_eq!(a.dequantize(), want);

        let qi: [i8; 32] = std::array::from_fn(|i| (i as i32 * 9 - 128).clamp(-128, 127) as i8);
        let mut b = f16::from_f32(0.01).to_le_bytes().to_vec();
        b.extend(qi.iter().map(|&v| v as u8));
        let a = repack("t", GgmlType::Q8_0, &b, 1, 32, &[0]).unwrap();
        assert_eq!(a.bits, 8);
        assert_eq!(a.weight.len(), 32);
        assert_eq!(a.weight[0], (qi[0] as i32 + 128) as u8);
        let d = f16::from_f32(0.01).to_f32();
        let got = a.dequantize();
        for (g, &v) in got.iter().zip(&qi) {
            // scale*q' + bias = d*(q+128) - 128d, equal to d*q up to f32 rounding.
            assert!((g - d * v as f32).abs() <= 1e-6, "{g} vs {}", d * v as f32);
        }
    }

    #[test]
    fn rejects_wrong_sizes_and_types() {
        let err = repack("x", GgmlType::Q4_1, &[0u8; 19], 1, 32, &[0]).unwrap_err();
        assert!(err.to_string().contains("19 bytes"), "{err}");
        let err = repack("x", GgmlType::Q6K, &[0u8; 210], 1, 256, &[0]).unwrap_err();
        assert!(err.to_string().contains("Q6K"), "{err}");
        let err = to_float(
            "x",
            GgmlType::F32,
            &1e6f32.to_le_bytes(),
            1,
            1,
            &[0],
            FloatDtype::F16,
        )
        .unwrap_err();
        assert!(err.to_string().contains("1000000"), "{err}");
    }

    #[test]
    fn floats_convert_to_f16() {
        let data: Vec<u8> = [1.0f32, -2.5, 0.1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let out = to_float("n", GgmlType::F32, &data, 1, 3, &[0], FloatDtype::F16).unwrap();
        let vals: Vec<f32> = out
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(vals, vec![1.0, -2.5, f16::from_f32(0.1).to_f32()]);
        let out = to_float("n", GgmlType::F32, &data, 1, 3, &[0], FloatDtype::F32).unwrap();
        assert_eq!(out, data);
        let wide = f16_bytes_as(FloatDtype::F32, f16::from_f32(0.5).to_le_bytes().to_vec());
        assert_eq!(wide, 0.5f32.to_le_bytes());
    }

    #[test]
    fn qk_unpermutation_inverts_llama_cpp_permutation() {
        // llama.cpp: HF row (h, j, i) goes to GGUF row (h, i, j) with j < 2, i < head_dim/2.
        let (heads, head_dim) = (3, 8);
        let rows = heads * head_dim;
        let mut gguf_of_hf = vec![0; rows];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..head_dim / 2 {
                    gguf_of_hf[h * head_dim + j * head_dim / 2 + i] = h * head_dim + 2 * i + j;
                }
            }
        }
        assert_eq!(unpermute_qk_rows("q", rows, heads).unwrap(), gguf_of_hf);
        assert!(unpermute_qk_rows("q", 10, 3).is_err());
    }
}
