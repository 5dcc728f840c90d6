//! Gumbel noise for sampling, counter-based: the noise for row `b`, vocabulary entry `v`,
//! depends only on that row's key and `v`.
//!
//! MLX's random functions take one key per call, so a batch would need one call per row. Here
//! a whole `[B, vocab]` block comes from a few integer ops: each row's key is a pair of u32
//! derived on the host from (seed, index of the generated token), and each element hashes its
//! vocabulary index with that key. So the draw for generated token i of a seeded request is
//! the same alone, in any batch, and after a resume.
use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

/// The key of generated token `step` of a request seeded with `seed` (SplitMix64 finaliser).
pub fn row_key(seed: u64, step: u64) -> [u32; 2] {
    let mut z = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    [z as u32, (z >> 32) as u32]
}

type NoiseFn = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;

thread_local! {
    /// The noise graph, compiled once per thread (shapeless: any batch, any vocabulary), so
    /// that its twenty-odd element-wise ops run as a few fused kernels.
    static NOISE: std::cell::RefCell<Option<NoiseFn>> = const { std::cell::RefCell::new(None) };
}

/// Standard Gumbel noise `[B, vocab]` (float32) for rows with the given keys.
pub fn gumbel(keys: &[[u32; 2]], vocab: i32) -> Result<Array, Exception> {
    let b = keys.len() as i32;
    // Two columns rather than one `[B, 2]` array: a shapeless compiled graph cannot slice.
    let k0: Vec<u32> = keys.iter().map(|k| k[0]).collect();
    let k1: Vec<u32> = keys.iter().map(|k| k[1]).collect();
    let k0 = Array::from_slice(&k0, &[b, 1]);
    let k1 = Array::from_slice(&k1, &[b, 1]);
    let ids = Array::arange::<_, u32>(None, vocab as u32, None)?.reshape(&[1, vocab])?;
    NOISE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let f = slot.get_or_insert_with(|| {
            Box::new(mlx_rs::transforms::compile::compile(noise_graph, true))
        });
        Ok(f(&[k0, k1, ids])?.remove(0))
    })
}

/// The hash of `ids` `[1, vocab]` under each row's key (two `[B, 1]` halves), as Gumbel noise.
fn noise_graph(args: &[Array]) -> Result<Vec<Array>, Exception> {
    let (k0, k1, ids) = (&args[0], &args[1], &args[2]);
    let mut x = xor(ids, k0)?;
    x = x.multiply(scalar(0x9E37_79B1))?;
    x = xor(&x, &shr(&x, 16)?)?;
    x = x.multiply(scalar(0x85EB_CA6B))?;
    x = xor(&x, &shr(&x, 13)?)?;
    x = xor(&x, k1)?;
    x = x.multiply(scalar(0xC2B2_AE35))?;
    x = xor(&x, &shr(&x, 16)?)?;
    // 24 high bits → a uniform in (0, 1), never 0 or 1.
    let u = shr(&x, 8)?
        .as_dtype(Dtype::Float32)?
        .add(Array::from_f32(0.5))?
        .multiply(Array::from_f32(1.0 / 16_777_216.0))?;
    Ok(vec![u.log()?.negative()?.log()?.negative()?])
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

    #[test]
    fn a_row_depends_only_on_its_key() {
        let a = gumbel(&[row_key(7, 3), row_key(1, 0)], 50).unwrap();
        let b = gumbel(&[row_key(1, 0), row_key(9, 9), row_key(7, 3)], 50).unwrap();
        use mlx_rs::ops::indexing::IndexOp;
        let a0: Vec<f32> = a.index(0).as_slice().to_vec();
        let b2: Vec<f32> = b.index(2).as_slice().to_vec();
        assert_eq!(a0, b2);
        let a1: Vec<f32> = a.index(1).as_slice().to_vec();
        assert_ne!(a0, a1);
    }

    #[test]
    fn noise_is_standard_gumbel() {
        let keys: Vec<[u32; 2]> = (0..64).map(|i| row_key(42, i)).collect();
        let g = gumbel(&keys, 1000).unwrap();
        let v: Vec<f32> = g.as_slice().to_vec();
        assert!(v.iter().all(|x| x.is_finite()));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        // Gumbel(0, 1): mean = Euler–Mascheroni constant 0.5772, variance pi^2 / 6 = 1.645.
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!((mean - 0.5772).abs() < 0.02, "mean {mean}");
        assert!((var - 1.645).abs() < 0.05, "variance {var}");
    }

    #[test]
    fn keys_differ_by_seed_and_step() {
        assert_ne!(row_key(1, 0), row_key(2, 0));
        assert_ne!(row_key(1, 0), row_key(1, 1));
        assert_eq!(row_key(5, 5), row_key(5, 5));
    }
}
