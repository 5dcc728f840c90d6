//! Between MLX arrays and the file format (on the MLX thread): the descriptors and arrays to
//! write for an entry's layers (keys and values, or a recurrent state), the bytes of an
//! evaluated array, and arrays built back from a payload.
use std::ffi::c_void;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::format::{DtypeCode, LayerDesc, StoredDesc, TensorDesc};
use crate::cache::{KvQuant, SeqLayer, Stored};

fn code(dtype: Dtype) -> Result<DtypeCode, Exception> {
    Ok(match dtype {
        Dtype::Float32 => DtypeCode::F32,
        Dtype::Float16 => DtypeCode::F16,
        Dtype::Bfloat16 => DtypeCode::Bf16,
        Dtype::Uint32 => DtypeCode::U32,
        other => {
            return Err(Exception::custom(format!(
                "the SSD tier cannot store {other:?} KV arrays"
            )))
        }
    })
}

fn dtype(code: DtypeCode) -> Dtype {
    match code {
        DtypeCode::F32 => Dtype::Float32,
        DtypeCode::F16 => Dtype::Float16,
        DtypeCode::Bf16 => Dtype::Bfloat16,
        DtypeCode::U32 => Dtype::Uint32,
    }
}

/// What [`prepare`] makes of an entry's layers.
pub struct Prepared {
    /// Each layer, as the header describes it.
    pub layers: Vec<LayerDesc>,
    /// The payload's arrays, row-contiguous and evaluated, in order.
    pub arrays: Vec<Array>,
    pub payload_len: u64,
}

/// Descriptors and row-contiguous, evaluated arrays (in payload order) for `layers`.
pub fn prepare(layers: &[SeqLayer]) -> Result<Prepared, Exception> {
    let mut arrays = Vec::new();
    let mut offset = 0u64;
    let mut place = |a: &Array| -> Result<TensorDesc, Exception> {
        let a = a.contiguous()?;
        let len = a.nbytes() as u64;
        let desc = TensorDesc {
            dtype: code(a.dtype())?,
            shape: a.shape().iter().map(|&d| d as u32).collect(),
            offset,
            len,
        };
        offset += len;
        arrays.push(a);
        Ok(desc)
    };
    let mut describe = |layer: &SeqLayer| -> Result<LayerDesc, Exception> {
        let mut stored = |s: &Stored| -> Result<StoredDesc, Exception> {
            let quant = s.quant().map(|q| (q.bits as u8, q.group_size as u32));
            let arrays = s
                .arrays()
                .into_iter()
                .map(&mut place)
                .collect::<Result<_, _>>()?;
            Ok(StoredDesc { quant, arrays })
        };
        Ok(match layer {
            SeqLayer::Kv(k, v) => LayerDesc::Kv(stored(k)?, stored(v)?),
            SeqLayer::State(state) => {
                LayerDesc::State(state.iter().map(&mut place).collect::<Result<_, _>>()?)
            }
        })
    };
    let descs = layers
        .iter()
        .map(&mut describe)
        .collect::<Result<Vec<_>, Exception>>()?;
    mlx_rs::transforms::eval(arrays.iter())?;
    Ok(Prepared {
        layers: descs,
        arrays,
        payload_len: offset,
    })
}

/// The bytes of an evaluated, row-contiguous array from [`prepare`].
///
/// Reading them on the writer thread is safe: the array is evaluated and nothing writes to
/// it (the prefix cache and the writer only hold references), and the data pointer stays
/// valid while the array lives.
pub fn bytes(a: &Array) -> Result<&[u8], Exception> {
    let mut contiguous = false;
    // SAFETY: `a` is a live array; the call only reads its flags.
    let rc = unsafe { mlx_sys::_mlx_array_is_row_contiguous(&mut contiguous, a.as_ptr()) };
    if rc != 0 || !contiguous {
        return Err(Exception::custom(
            "a KV array to write is not row-contiguous",
        ));
    }
    // SAFETY: the array is evaluated (see `prepare`) so its buffer holds `nbytes` bytes of the
    // element type the accessor is chosen by; the slice borrows `a`, which keeps them alive.
    unsafe {
        let ptr = match a.dtype() {
            Dtype::Float32 => mlx_sys::mlx_array_data_float32(a.as_ptr()) as *const u8,
            Dtype::Float16 => mlx_sys::mlx_array_data_float16(a.as_ptr()) as *const u8,
            Dtype::Bfloat16 => mlx_sys::mlx_array_data_bfloat16(a.as_ptr()) as *const u8,
            Dtype::Uint32 => mlx_sys::mlx_array_data_uint32(a.as_ptr()) as *const u8,
            other => {
                return Err(Exception::custom(format!(
                    "the SSD tier cannot store {other:?} KV arrays"
                )))
            }
        };
        if ptr.is_null() {
            return Err(Exception::custom("a KV array to write has no data"));
        }
        Ok(std::slice::from_raw_parts(ptr, a.nbytes()))
    }
}

/// The layers of a checked payload, as MLX arrays (copied out of the mapping).
pub fn restore(layers: &[LayerDesc], payload: &[u8]) -> Result<Vec<SeqLayer>, Exception> {
    let array = |t: &TensorDesc| -> Array {
        let bytes = &payload[t.offset as usize..(t.offset + t.len) as usize];
        let shape: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
        // SAFETY: the format checked that `bytes` holds exactly shape × element-size bytes of
        // `t.dtype`; MLX copies them into an array of its own.
        unsafe { Array::from_raw_data(bytes.as_ptr() as *const c_void, &shape, dtype(t.dtype)) }
    };
    let stored = |s: &StoredDesc| -> Stored {
        match s.quant {
            None => Stored::Plain(array(&s.arrays[0])),
            Some((bits, group)) => Stored::Quantized {
                weights: array(&s.arrays[0]),
                scales: array(&s.arrays[1]),
                biases: array(&s.arrays[2]),
                quant: KvQuant {
                    bits: bits as i32,
                    group_size: group as i32,
                },
            },
        }
    };
    let out: Vec<SeqLayer> = layers
        .iter()
        .map(|layer| match layer {
            LayerDesc::Kv(k, v) => SeqLayer::Kv(stored(k), stored(v)),
            LayerDesc::State(arrays) => SeqLayer::State(arrays.iter().map(array).collect()),
        })
        .collect();
    mlx_rs::transforms::eval(out.iter().flat_map(SeqLayer::arrays))?;
    Ok(out)
}
