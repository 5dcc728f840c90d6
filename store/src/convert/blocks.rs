//! Decoding GGML's block quantizations into groups of 32 consecutive weights, each with the
//! values GGML's own dequantization computes (the reference every conversion is measured
//! against) and the form the block stores them in.
//!
//! Every supported type but Q6_K stores each run of 32 weights as affine (`w = scale*q + bias`
//! with `q` unsigned), which MLX's affine quantization holds exactly:
//!
//! | type | block | per 32 weights | scale | bias |
//! |------|-------|----------------|-------|------|
//! | Q4_0 | 32 | `d`, 4-bit `q` | `d` | `-8d` |
//! | Q4_1 | 32 | `d`, `m`, 4-bit `q` | `d` | `m` |
//! | Q5_0 | 32 | `d`, 5-bit `q` | `d` | `-16d` |
//! | Q5_1 | 32 | `d`, `m`, 5-bit `q` | `d` | `m` |
//! | Q8_0 | 32 | `d`, `i8` | `d` | `-128d` (`q' = q+128`) |
//! | Q4_K | 256 | eight sub-blocks: 6-bit `sc`, `m`; 4-bit `q` | `d*sc` | `-dmin*m` |
//! | Q5_K | 256 | as Q4_K with 5-bit `q` | `d*sc` | `-dmin*m` |
//!
//! Q6_K's sub-blocks are 16 weights with their own `i8` scale (`w = d*sc*k`, `k` in -32..31):
//! a group of 32 holds two scales, which no MLX group size (32, 64, 128) can carry, so it is
//! handed over as [`GroupForm::TwoScales`] for the caller to map.
use half::f16;

use super::gguf::GgmlType;

/// The weights of one MLX group.
pub const GROUP: usize = 32;

/// One group of [`GROUP`] consecutive weights of a row.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The values GGML's dequantization computes, in its f32 order of operations.
    pub reference: [f32; GROUP],
    pub form: GroupForm,
}

/// How the block stores a group.
#[derive(Debug, Clone, PartialEq)]
pub enum GroupForm {
    /// `reference[i] == scale * q[i] + bias` in f32.
    Affine {
        q: [u8; GROUP],
        scale: f32,
        bias: f32,
    },
    /// Q6_K: `reference[i] == (d * sc[i / 16]) * k[i]`, `k` in -32..=31.
    TwoScales { d: f32, sc: [i8; 2], k: [i8; GROUP] },
}

/// The bits per weight of the MLX affine form of `ty`, for the block types decoded here.
pub fn affine_bits(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q4K => Some(4),
        Q5_0 | Q5_1 | Q5K => Some(5),
        // Q6_K's two scales per group are mapped onto 8 bits (see `quant`).
        Q8_0 | Q6K => Some(8),
        _ => None,
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn affine(q: [u8; GROUP], scale: f32, bias: f32, reference: [f32; GROUP]) -> Group {
    Group {
        reference,
        form: GroupForm::Affine { q, scale, bias },
    }
}

/// Q4_K/Q5_K's packed 6-bit scale and min of sub-block `j` (GGML's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Decodes one block of `ty` (exactly `ty.block_layout().1` bytes) into its groups, in order.
/// `ty` must be one that [`affine_bits`] names.
pub fn decode_block(ty: GgmlType, blk: &[u8], out: &mut Vec<Group>) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let d = f16_at(blk, 0);
            let (m, qs) = if ty == GgmlType::Q4_1 {
                (Some(f16_at(blk, 2)), &blk[4..20])
            } else {
                (None, &blk[2..18])
            };
            let mut q = [0u8; GROUP];
            for j in 0..16 {
                q[j] = qs[j] & 0x0f;
                q[j + 16] = qs[j] >> 4;
            }
            let (reference, bias) = match m {
                Some(m) => (q.map(|v| d * v as f32 + m), m),
                None => (q.map(|v| (v as i32 - 8) as f32 * d), -8.0 * d),
            };
            out.push(affine(q, d, bias, reference));
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let d = f16_at(blk, 0);
            let (m, rest) = if ty == GgmlType::Q5_1 {
                (Some(f16_at(blk, 2)), &blk[4..])
            } else {
                (None, &blk[2..])
            };
            let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let qs = &rest[4..20];
            let mut q = [0u8; GROUP];
            for j in 0..16 {
                q[j] = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
                q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
            let (reference, bias) = match m {
                Some(m) => (q.map(|v| d * v as f32 + m), m),
                None => (q.map(|v| (v as i32 - 16) as f32 * d), -16.0 * d),
            };
            out.push(affine(q, d, bias, reference));
        }
        GgmlType::Q8_0 => {
            let d = f16_at(blk, 0);
            let k: [i8; GROUP] = std::array::from_fn(|i| blk[2 + i] as i8);
            // q' = q + 128 maps i8 onto u8 by flipping the sign bit.
            let q = std::array::from_fn(|i| blk[2 + i] ^ 0x80);
            out.push(affine(q, d, -128.0 * d, k.map(|v| v as f32 * d)));
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let d = f16_at(blk, 0);
            let dmin = f16_at(blk, 2);
            let scales = &blk[4..16];
            let (qh, qs) = if ty == GgmlType::Q5K {
                (Some(&blk[16..48]), &blk[48..176])
            } else {
                (None, &blk[16..144])
            };
            for sub in 0..8 {
                let (sc, m) = scale_min_k4(sub, scales);
                let (d1, m1) = (d * sc as f32, dmin * m as f32);
                // Sub-blocks 2i and 2i+1 are the low and high nibbles of bytes 32i..32i+32.
                let bytes = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                let shift = 4 * (sub % 2);
                let q: [u8; GROUP] = std::array::from_fn(|l| {
                    let low = (bytes[l] >> shift) & 0x0f;
                    match qh {
                        Some(qh) => low | (((qh[l] >> sub) & 1) << 4),
                        None => low,
                    }
                });
                out.push(affine(q, d1, -m1, q.map(|v| d1 * v as f32 - m1)));
            }
        }
        GgmlType::Q6K => {
            let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            let d = f16_at(blk, 208);
            // Two halves of 128 weights; within a half, run r (0..4) of 32 weights takes
            // nibble r/2 of ql[l + 32*(r%2)] and bits 2r..2r+2 of qh[l].
            for half in 0..2 {
                let (ql, qh) = (
                    &ql[64 * half..64 * half + 64],
                    &qh[32 * half..32 * half + 32],
                );
                for run in 0..4 {
                    let k: [i8; GROUP] = std::array::from_fn(|l| {
                        let low = (ql[l + 32 * (run % 2)] >> (4 * (run / 2))) & 0x0f;
                        let high = (qh[l] >> (2 * run)) & 3;
                        (low | (high << 4)) as i8 - 32
                    });
                    let first = 8 * half + 2 * run;
                    let pair = [sc[first] as i8, sc[first + 1] as i8];
                    let reference =
                        std::array::from_fn(|i| (d * pair[i / 16] as f32) * k[i] as f32);
                    out.push(Group {
                        reference,
                        form: GroupForm::TwoScales { d, sc: pair, k },
                    });
                }
            }
        }
        other => unreachable!("decode_block called for {other:?}, which affine_bits rejects"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scales_unpack_like_ggml() {
        // Sub-block j < 4: low 6 bits of bytes j and j+4; j >= 4: nibbles of byte j+4 with
        // the top two bits of bytes j-4 and j.
        let s: [u8; 12] = [0b11_000001, 2, 3, 4, 0b10_000101, 6, 7, 8, 0x9a, 0, 0, 0];
        assert_eq!(scale_min_k4(0, &s), (1, 5));
        assert_eq!(scale_min_k4(4, &s), (0xa | (0b11 << 4), 0x9 | (0b10 << 4)));
    }

    #[test]
    fn q6_k_groups_follow_the_ggml_layout() {
        let mut blk = vec![0u8; 210];
        // Weight 32 of the first half: run 1, low nibble of ql[32], bits 2..4 of qh[0].
        blk[32] = 0x05;
        blk[128] = 0b0000_1000;
        blk[192 + 2] = 3; // scale of weights 32..48
        blk[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        let mut groups = Vec::new();
        decode_block(GgmlType::Q6K, &blk, &mut groups);
        assert_eq!(groups.len(), 8);
        let GroupForm::TwoScales { d, sc, k } = &groups[1].form else {
            panic!("Q6_K is two-scale")
        };
        assert_eq!((*d, sc[0]), (0.5, 3));
        assert_eq!(k[0], (0x05 | (0b10 << 4)) - 32);
        assert_eq!(groups[1].reference[0], 0.5 * 3.0 * k[0] as f32);
        // Weights that are all zero bits are -32.
        assert_eq!(groups[0].reference[5], 0.0);
        let GroupForm::TwoScales { k, .. } = &groups[7].form else {
            panic!()
        };
        assert_eq!(k[31], -32);
    }
}
