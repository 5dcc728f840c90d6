//! Repacking GGML block quantization into MLX's affine quantization, and float conversion.
//!
//! MLX affine quantization stores, per group of `group_size` consecutive weights of a row, a
//! scale and a bias (`w = scale * q + bias`, `q` unsigned), and packs the `q`s of a row into
//! little-endian `u32` words as one little-endian bit stream: value `i` of a row sits in bits
//! `bits*i .. bits*(i+1)` of it (for 3, 5 and 6 bits a value may straddle two words).
//!
//! [`blocks`] decodes each GGML block into groups of 32; the group size here is always 32.
//! Groups the block stores as affine keep their `q`s, with scale and bias rounded only to the
//! output float type (exact in f32; in f16 exact for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, whose
//! scales are GGML's own f16, and rounded for Q4_K and Q5_K, whose scales are products
//! `d*sc`). Q6_K groups carry two scales and are mapped onto 8 bits by [`map_two_scales`],
//! exactly when the values allow and otherwise with the smallest error of the candidates it
//! tries. Every element's error against GGML's dequantization is measured ([`ErrorStats`]).
use half::{bf16, f16};

use super::blocks::{self, Group, GroupForm, GROUP};
use super::gguf::GgmlType;
use super::ConvertError;

/// The group size of every matrix repacked here (GGML's block or sub-block of 32).
pub const GROUP_SIZE: usize = GROUP;

/// How far a converted tensor is from GGML's own dequantization of it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ErrorStats {
    pub elements: u64,
    /// The largest `|converted - reference|`.
    pub max_abs: f64,
    /// Sum of squared errors.
    pub sum_sq: f64,
    /// Sum of squared reference values, so the error can be read relative to the weights.
    pub sum_sq_ref: f64,
}

impl ErrorStats {
    pub fn add(&mut self, got: f32, reference: f32) {
        let e = (got as f64 - reference as f64).abs();
        self.elements += 1;
        if e > self.max_abs || e.is_nan() {
            self.max_abs = e;
        }
        self.sum_sq += e * e;
        self.sum_sq_ref += reference as f64 * reference as f64;
    }

    pub fn merge(&mut self, o: &ErrorStats) {
        self.elements += o.elements;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.sum_sq += o.sum_sq;
        self.sum_sq_ref += o.sum_sq_ref;
    }

    /// Whether every element equals the reference.
    pub fn is_exact(&self) -> bool {
        self.max_abs == 0.0
    }

    /// Root-mean-square error.
    pub fn rms(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            (self.sum_sq / self.elements as f64).sqrt()
        }
    }

    /// The RMS error over the RMS of the reference weights (0 when those are all zero).
    pub fn relative_rms(&self) -> f64 {
        if self.sum_sq_ref == 0.0 {
            0.0
        } else {
            (self.sum_sq / self.sum_sq_ref).sqrt()
        }
    }
}

/// A matrix in MLX affine quantized form.
#[derive(Debug, Clone, PartialEq)]
pub struct AffineQuant {
    pub bits: u32,
    pub group_size: usize,
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols * bits / 32` little-endian `u32` words, as bytes.
    pub weight: Vec<u8>,
    /// `rows * cols / group_size` scales, already rounded to the output float type.
    pub scales: Vec<f32>,
    /// Same shape as `scales`, rounded likewise.
    pub biases: Vec<f32>,
    /// The converted weights against GGML's dequantization.
    pub error: ErrorStats,
}

impl AffineQuant {
    /// The dequantized values, row-major, for checks.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_affine(
            self.bits,
            self.group_size,
            &self.weight,
            &self.scales,
            &self.biases,
        )
    }
}

/// MLX's affine dequantization (`scale * q + bias`, in f32) of packed `weight` words.
pub fn dequantize_affine(
    bits: u32,
    group_size: usize,
    weight: &[u8],
    scales: &[f32],
    biases: &[f32],
) -> Vec<f32> {
    let n = weight.len() * 8 / bits as usize;
    let mask = (1u64 << bits) - 1;
    (0..n)
        .map(|i| {
            let bit = i * bits as usize;
            let (byte, shift) = (bit / 8, bit % 8);
            let mut v = 0u64;
            for (k, b) in weight[byte..weight.len().min(byte + 3)].iter().enumerate() {
                v |= (*b as u64) << (8 * k);
            }
            let q = (v >> shift) & mask;
            let g = i / group_size;
            scales[g] * q as f32 + biases[g]
        })
        .collect()
}

/// `bits`-wide values written as one little-endian bit stream of little-endian `u32` words.
struct BitWriter {
    bits: u32,
    acc: u64,
    filled: u32,
    out: Vec<u8>,
}

impl BitWriter {
    fn push(&mut self, q: u8) {
        self.acc |= (q as u64) << self.filled;
        self.filled += self.bits;
        while self.filled >= 32 {
            self.out
                .extend_from_slice(&((self.acc & 0xffff_ffff) as u32).to_le_bytes());
            self.acc >>= 32;
            self.filled -= 32;
        }
    }
}

/// A value as the output float type stores it; an error when it does not fit.
fn stored(name: &str, what: &str, v: f32, dtype: FloatDtype) -> Result<f32, ConvertError> {
    match dtype {
        FloatDtype::F32 => Ok(v),
        FloatDtype::F16 => {
            let h = f16::from_f32(v);
            if v.is_finite() && !h.is_finite() {
                return Err(ConvertError::Shape(format!(
                    "{name}: {what} {v} does not fit in f16 (max {}); convert with f32",
                    f16::MAX
                )));
            }
            Ok(h.to_f32())
        }
    }
}

/// The largest error of one group in the affine form `(q, scale, bias)` once stored.
fn group_max_error(q: &[u8; GROUP], scale: f32, bias: f32, reference: &[f32; GROUP]) -> f32 {
    q.iter()
        .zip(reference)
        .map(|(&q, &r)| (scale * q as f32 + bias - r).abs())
        .fold(0.0, f32::max)
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// One group in affine form: `(q, scale, bias)`.
pub type AffineGroup = ([u8; GROUP], f32, f32);

/// The 8-bit affine form of a Q6_K group (`w = (d*sc[i/16]) * k[i]`) with the smallest
/// largest error once stored, of three candidates, the first preferred on ties:
/// 1. the coarsest exact lattice: with `v = sc*k` and `g` the gcd of the `v`s, `scale = d*g`,
///    `bias = d*min(v)`, when `(max(v) - min(v)) / g` fits in 0..=255;
/// 2. the lattice of the larger sub-block scale `m`: `scale = d*m/4`, `bias = -128*scale`,
///    `q = round(4v/m) + 128`, exact for the sub-block of scale `m` and within `d*m/8` for the
///    other;
/// 3. the min-max fit: `scale = d*(max v - min v)/255`, `bias = d*min v`.
pub fn map_two_scales(
    name: &str,
    d: f32,
    sc: [i8; 2],
    k: &[i8; GROUP],
    reference: &[f32; GROUP],
    dtype: FloatDtype,
) -> Result<AffineGroup, ConvertError> {
    let v: [i32; GROUP] = std::array::from_fn(|i| sc[i / 16] as i32 * k[i] as i32);
    let (lo, hi) = (*v.iter().min().unwrap(), *v.iter().max().unwrap());
    let g = v.iter().fold(0, |g, &x| gcd(g, x.unsigned_abs()));
    if g == 0 {
        return Ok(([0; GROUP], 0.0, 0.0));
    }
    let mut candidates: [Option<AffineGroup>; 3] = [None, None, None];
    if ((hi - lo) as u32) / g <= 255 {
        let q = v.map(|x| ((x - lo) as u32 / g) as u8);
        candidates[0] = Some((q, d * g as f32, d * lo as f32));
    }
    let m = sc[0].unsigned_abs().max(sc[1].unsigned_abs()) as f32;
    let q = v.map(|x| ((4.0 * x as f32 / m).round() + 128.0).clamp(0.0, 255.0) as u8);
    let s = d * m / 4.0;
    candidates[1] = Some((q, s, -128.0 * s));
    // Equal values make a one-point lattice, which the first candidate takes.
    let span = (hi - lo) as f32;
    if span > 0.0 {
        let q = v.map(|x| ((x - lo) as f32 * 255.0 / span).round().clamp(0.0, 255.0) as u8);
        candidates[2] = Some((q, d * span / 255.0, d * lo as f32));
    }

    let mut best: Option<(f32, AffineGroup)> = None;
    for (q, s, b) in candidates.into_iter().flatten() {
        let (s, b) = (
            stored(name, "scale", s, dtype)?,
            stored(name, "bias", b, dtype)?,
        );
        let e = group_max_error(&q, s, b, reference);
        if best.as_ref().is_none_or(|(be, _)| e < *be) {
            best = Some((e, (q, s, b)));
        }
    }
    Ok(best
        .expect("the larger sub-block's lattice is always a candidate")
        .1)
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

/// The quantized types [`repack`] converts, for error messages.
pub const QUANTIZED_TYPES: &str = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K";

/// Repacks a block-quantized matrix of `rows x cols` (row-major, rows of whole blocks) into
/// MLX affine form with scales and biases in `dtype`, writing source row `row_order[i]` as
/// output row `i`, and measures it against GGML's dequantization.
pub fn repack(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    row_order: &[usize],
    dtype: FloatDtype,
) -> Result<AffineQuant, ConvertError> {
    let bits = blocks::affine_bits(ty).ok_or_else(|| ConvertError::UnsupportedTensorType {
        name: name.to_string(),
        ggml_type: format!("{ty:?} (quantized types supported: {QUANTIZED_TYPES})"),
    })?;
    let row_bytes = check_layout(name, ty, data, rows, cols, row_order)?;
    let (_, block_bytes) = ty.block_layout();
    let groups = rows * cols / GROUP_SIZE;
    let mut w = BitWriter {
        bits,
        acc: 0,
        filled: 0,
        out: Vec::with_capacity(rows * cols * bits as usize / 8),
    };
    let mut scales = Vec::with_capacity(groups);
    let mut biases = Vec::with_capacity(groups);
    let mut error = ErrorStats::default();
    let mut decoded: Vec<Group> = Vec::with_capacity(8);
    for &src in row_order {
        if src >= rows {
            return Err(ConvertError::Shape(format!(
                "{name}: row permutation names row {src} of {rows}"
            )));
        }
        let row = &data[src * row_bytes..(src + 1) * row_bytes];
        for blk in row.chunks_exact(block_bytes as usize) {
            decoded.clear();
            blocks::decode_block(ty, blk, &mut decoded);
            for g in &decoded {
                let (q, s, b) = match &g.form {
                    GroupForm::Affine { q, scale, bias } => (
                        *q,
                        stored(name, "scale", *scale, dtype)?,
                        stored(name, "bias", *bias, dtype)?,
                    ),
                    GroupForm::TwoScales { d, sc, k } => {
                        map_two_scales(name, *d, *sc, k, &g.reference, dtype)?
                    }
                };
                for (&q, &r) in q.iter().zip(&g.reference) {
                    w.push(q);
                    error.add(s * q as f32 + b, r);
                }
                scales.push(s);
                biases.push(b);
            }
        }
    }
    debug_assert_eq!(w.filled, 0, "rows are whole groups of 32");
    Ok(AffineQuant {
        bits,
        group_size: GROUP_SIZE,
        rows,
        cols,
        weight: w.out,
        scales,
        biases,
        error,
    })
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

/// Little-endian bytes of `values` in `dtype`; the values must already be representable
/// (as [`repack`] leaves them), so the conversion is exact.
pub fn float_bytes(dtype: FloatDtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        FloatDtype::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        FloatDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Converts an F32, F16 or BF16 tensor of `rows x cols` to `dtype` bytes, writing source row
/// `row_order[i]` as output row `i`, with the rounding error measured. A finite value too large
/// for f16 is an error.
pub fn to_float(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    row_order: &[usize],
    dtype: FloatDtype,
) -> Result<(Vec<u8>, ErrorStats), ConvertError> {
    to_float_shifted(name, ty, data, (rows, cols), row_order, 0.0, dtype)
}

/// [`to_float`] of `value - shift` (computed in f32) for every value: Gemma's norms, which
/// llama.cpp stores as `1 + w`. The error is measured against `value - shift`; a shift of 0
/// leaves every value, its sign included, as it is.
pub fn to_float_shifted(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    (rows, cols): (usize, usize),
    row_order: &[usize],
    shift: f32,
    dtype: FloatDtype,
) -> Result<(Vec<u8>, ErrorStats), ConvertError> {
    if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16) {
        return Err(ConvertError::UnsupportedTensorType {
            name: name.to_string(),
            ggml_type: format!("{ty:?} (float types supported: F32, F16, BF16)"),
        });
    }
    let row_bytes = check_layout(name, ty, data, rows, cols, row_order)?;
    let mut out = Vec::with_capacity(rows * cols * dtype.bytes());
    let mut error = ErrorStats::default();
    let mut push = |v: f32| -> Result<(), ConvertError> {
        let v = if shift == 0.0 { v } else { v - shift };
        let s = stored(name, "value", v, dtype)?;
        error.add(s, v);
        match dtype {
            FloatDtype::F16 => out.extend_from_slice(&f16::from_f32(s).to_le_bytes()),
            FloatDtype::F32 => out.extend_from_slice(&s.to_le_bytes()),
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
    Ok((out, error))
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
        let a = repack(
            "t",
            GgmlType::Q4_1,
            &data,
            2,
            64,
            &identity(2),
            FloatDtype::F16,
        )
        .unwrap();
        assert_eq!((a.bits, a.group_size), (4, 32));
        assert_eq!(a.weight.len(), 2 * 64 / 2);
        assert_eq!(a.scales.len(), 2 * 2);
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
        let s = repack("t", GgmlType::Q4_1, &data, 2, 64, &[1, 0], FloatDtype::F16).unwrap();
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
        let a = repack("t", GgmlType::Q4_0, &b, 1, 32, &[0], FloatDtype::F16).unwrap();
        let want: Vec<f32> = q.iter().map(|&v| 0.75 * (v as f32 - 8.0)).collect();
        assert_eq!(a.dequantize(), want);

        let qi: [i8; 32] = std::array::from_fn(|i| (i as i32 * 9 - 128).clamp(-128, 127) as i8);
        let mut b = f16::from_f32(0.01).to_le_bytes().to_vec();
        b.extend(qi.iter().map(|&v| v as u8));
        let a = repack("t", GgmlType::Q8_0, &b, 1, 32, &[0], FloatDtype::F16).unwrap();
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
        let err = repack(
            "x",
            GgmlType::Q4_1,
            &[0u8; 19],
            1,
            32,
            &[0],
            FloatDtype::F16,
        )
        .unwrap_err();
        assert!(err.to_string().contains("19 bytes"), "{err}");
        let err = repack(
            "x",
            GgmlType::Q2K,
            &[0u8; 84],
            1,
            256,
            &[0],
            FloatDtype::F16,
        )
        .unwrap_err();
        assert!(err.to_string().contains("Q2K"), "{err}");
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
        let (out, err) = to_float("n", GgmlType::F32, &data, 1, 3, &[0], FloatDtype::F16).unwrap();
        assert_eq!(err.elements, 3);
        assert!(err.max_abs > 0.0 && err.max_abs < 1e-4, "{err:?}");
        let vals: Vec<f32> = out
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(vals, vec![1.0, -2.5, f16::from_f32(0.1).to_f32()]);
        let (out, err) = to_float("n", GgmlType::F32, &data, 1, 3, &[0], FloatDtype::F32).unwrap();
        assert_eq!(out, data);
        assert!(err.is_exact());
        assert_eq!(float_bytes(FloatDtype::F32, &[0.5]), 0.5f32.to_le_bytes());
    }

    #[test]
    fn odd_widths_pack_as_one_bit_stream() {
        for bits in [3u32, 5, 6] {
            let vals: Vec<u8> = (0..64).map(|i| ((i * 7 + 3) % (1 << bits)) as u8).collect();
            let mut w = BitWriter {
                bits,
                acc: 0,
                filled: 0,
                out: Vec::new(),
            };
            vals.iter().for_each(|&v| w.push(v));
            assert_eq!(w.out.len(), 64 * bits as usize / 8);
            let back = dequantize_affine(bits, 32, &w.out, &[1.0, 1.0], &[0.0, 0.0]);
            assert_eq!(back, vals.iter().map(|&v| v as f32).collect::<Vec<_>>());
        }
    }

    /// A Q4_K block: d, dmin, sub-block scales and mins (all < 64), 256 nibbles.
    fn q4_k_block(d: f32, dmin: f32, sc: [u8; 8], m: [u8; 8], q: &[u8; 256]) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        b.extend_from_slice(&f16::from_f32(dmin).to_le_bytes());
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
        }
        b.extend_from_slice(&s);
        for chunk in 0..4 {
            for l in 0..32 {
                b.push(q[64 * chunk + l] | (q[64 * chunk + 32 + l] << 4));
            }
        }
        b
    }

    #[test]
    fn q4_k_is_exact_with_f32_scales_and_measured_with_f16() {
        let sc = [1, 17, 33, 63, 2, 40, 50, 61];
        let m = [0, 5, 63, 12, 48, 1, 30, 16];
        let q: [u8; 256] = std::array::from_fn(|i| (i * 11 % 16) as u8);
        let (d, dmin) = (0.0123, 0.0071);
        let blk = q4_k_block(d, dmin, sc, m, &q);
        let a = repack("t", GgmlType::Q4K, &blk, 1, 256, &[0], FloatDtype::F32).unwrap();
        assert_eq!((a.bits, a.group_size, a.scales.len()), (4, 32, 8));
        let (d, dmin) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
        let want: Vec<f32> = (0..256)
            .map(|i| d * sc[i / 32] as f32 * q[i] as f32 - dmin * m[i / 32] as f32)
            .collect();
        assert_eq!(a.dequantize(), want);
        assert!(a.error.is_exact(), "{:?}", a.error);
        let h = repack("t", GgmlType::Q4K, &blk, 1, 256, &[0], FloatDtype::F16).unwrap();
        assert_eq!(h.weight, a.weight);
        let got = h.dequantize();
        let max = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() as f64)
            .fold(0.0, f64::max);
        assert_eq!(max, h.error.max_abs);
        // f16 keeps 11 significant bits of d*sc and dmin*m.
        assert!(
            max > 0.0 && max < 15.0 * 0.8 / 2048.0 + 0.45 / 2048.0,
            "{max}"
        );
    }

    #[test]
    fn two_scale_groups_map_exactly_when_a_lattice_fits() {
        let k: [i8; 32] = std::array::from_fn(|i| (i as i32 * 5 % 64 - 32) as i8);
        let d = 0.25f32;
        let reference = |sc: [i8; 2]| -> [f32; 32] {
            std::array::from_fn(|i| (d * sc[i / 16] as f32) * k[i] as f32)
        };
        // Scales 6 and -3: v = sc*k spans at most 6*63 = 378 over a lattice of 3: exact.
        let r = reference([6, -3]);
        let (q, s, b) = map_two_scales("t", d, [6, -3], &k, &r, FloatDtype::F32).unwrap();
        assert_eq!(group_max_error(&q, s, b, &r), 0.0);
        // Scales 37 and 23 (coprime, wide): the larger sub-block stays exact, the other is
        // within d*37/8.
        let r = reference([37, 23]);
        let (q, s, b) = map_two_scales("t", d, [37, 23], &k, &r, FloatDtype::F32).unwrap();
        let e = group_max_error(&q, s, b, &r);
        assert!(e > 0.0 && e <= d * 37.0 / 8.0, "{e}");
        for i in 0..16 {
            assert!((s * q[i] as f32 + b - r[i]).abs() <= d * 37.0 / 8.0);
        }
        // All zeros.
        let zero = map_two_scales("t", d, [0, 0], &k, &[0.0; 32], FloatDtype::F16).unwrap();
        assert_eq!(zero, ([0; 32], 0.0, 0.0));
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
