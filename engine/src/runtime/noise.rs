//! Gumbel noise for sampling, counter-based: the noise for row `b`, vocabulary entry `v`,
//! depends only on that row's seed, the index of the token being generated, and `v`.
//!
//! MLX's random functions take one key per call, so a batch would need one call per row. Here
//! a whole `[B, vocab]` block comes from one graph of integer ops (compiled as part of the
//! sampler's step): each row's key is
//! mixed on the device from its seed and step (kept as `[B, 1]` arrays that advance on the
//! device, so a step uploads nothing), and each element hashes its vocabulary index with that
//! key. So the draw for generated token i of a seeded request is the same alone, in any batch,
//! and after a resume.
use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

/// Standard Gumbel noise `[B, vocab]` (float32) for rows with the given seeds (`[B, 1]` u32
/// low and high halves) at the given generated-token indices (`[B, 1]` u32), for the
/// vocabulary ids `ids` (`[1, vocab]` u32), all on the device. Its twenty-odd element-wise ops
/// are meant to run inside a compiled graph (the sampler's), where they fuse into a few
/// kernels.
pub fn graph(
    seed_lo: &Array,
    seed_hi: &Array,
    steps: &Array,
    ids: &Array,
) -> Result<Array, Exception> {
    let k0 = fmix(&xor(seed_lo, &steps.multiply(scalar(0x9E37_79B1))?)?)?;
    let k1 = fmix(&xor(seed_hi, &fmix(&steps.add(scalar(0x632B_E5AB))?)?)?)?;
    let mut x = xor(ids, &k0)?;
    x = x.multiply(scalar(0x9E37_79B1))?;
    x = fmix(&xor(&fmix(&x)?, &k1)?)?;
    // 24 high bits → a uniform in (0, 1), never 0 or 1.
    let u = shr(&x, 8)?
        .as_dtype(Dtype::Float32)?
        .add(Array::from_f32(0.5))?
        .multiply(Array::from_f32(1.0 / 16_777_216.0))?;
    u.log()?.negative()?.log()?.negative()
}

/// The murmur3 finaliser: a bijective mix of 32 bits.
fn fmix(x: &Array) -> Result<Array, Exception> {
    let mut x = xor(x, &shr(x, 16)?)?;
    x = x.multiply(scalar(0x85EB_CA6B))?;
    x = xor(&x, &shr(&x, 13)?)?;
    x = x.multiply(scalar(0xC2B2_AE35))?;
    xor(&x, &shr(&x, 16)?)
}

fn scalar(v: u32) -> Array {
    Array::from_slice(&[v], &[1])
}

fn shr(x: &Array, bits: u32) -> Result<Array, Exception> {
    binary(x, &scalar(bits), mlx_sys::mlx_right_shift, "right_shift")
}

fn xor(a: &Array, b: &Array) -> Result<Array, Exception> {
    binary(a, b, mlx_sys::mlx_bitwise_xor, "bitwise_xor")
}

type BinaryOp = unsafe extern "C" fn(
    *mut mlx_sys::mlx_array,
    mlx_sys::mlx_array,
    mlx_sys::mlx_array,
    mlx_sys::mlx_stream,
) -> std::os::raw::c_int;

/// An MLX binary op that mlx-rs does not wrap (the integer bit operations).
fn binary(a: &Array, b: &Array, op: BinaryOp, name: &str) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: `res` is a fresh handle that the op fills; `a`, `b` and the stream are live
    // handles owned by the caller for the duration of the call; on success the handle is
    // owned by the returned Array, on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = op(&mut res, a.as_ptr(), b.as_ptr(), stream.as_ref().as_ptr());
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!(
                "MLX {name} failed on shapes {:?} and {:?}",
                a.shape(),
                b.shape()
            )));
        }
        Ok(Array::from_ptr(res))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    fn col(v: &[u32]) -> Array {
        Array::from_slice(v, &[v.len() as i32, 1])
    }

    fn noise(rows: &[(u64, u32)], vocab: i32) -> Array {
        let lo: Vec<u32> = rows.iter().map(|r| r.0 as u32).collect();
        let hi: Vec<u32> = rows.iter().map(|r| (r.0 >> 32) as u32).collect();
        let steps: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let ids = Array::arange::<_, u32>(None, vocab as u32, None)
            .unwrap()
            .reshape(&[1, vocab])
            .unwrap();
        graph(&col(&lo), &col(&hi), &col(&steps), &ids).unwrap()
    }

    fn row(a: &Array, r: i32) -> Vec<f32> {
        a.index(r).as_slice().to_vec()
    }

    #[test]
    fn a_row_depends_only_on_its_seed_and_step() {
        let a = noise(&[(7, 3), (1, 0)], 50);
        let b = noise(&[(1, 0), (9, 9), (7, 3)], 50);
        assert_eq!(row(&a, 0), row(&b, 2));
        assert_eq!(row(&a, 1), row(&b, 0));
        assert_ne!(row(&a, 0), row(&a, 1));
        // Neighbouring seeds and steps, and the seed's high half, all change the draw.
        let c = noise(&[(7, 4), (8, 3), (7 + (1 << 32), 3)], 50);
        for r in 0..3 {
            assert_ne!(row(&a, 0), row(&c, r));
        }
    }

    #[test]
    fn noise_is_standard_gumbel() {
        let rows: Vec<(u64, u32)> = (0..64).map(|i| (42, i)).collect();
        let g = noise(&rows, 1000);
        let v: Vec<f32> = g.as_slice().to_vec();
        assert!(v.iter().all(|x| x.is_finite()));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        // Gumbel(0, 1): mean = Euler–Mascheroni constant 0.5772, variance pi^2 / 6 = 1.645.
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!((mean - 0.5772).abs() < 0.02, "mean {mean}");
        assert!((var - 1.645).abs() < 0.05, "variance {var}");
    }
}
