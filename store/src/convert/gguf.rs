//! A reader for GGUF files (versions 2 and 3): header, metadata, tensor infos and tensor data,
//! over a memory map of the file. Every read is bounds-checked; a malformed file is an error
//! that names the offset and the value that broke the format.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::ConvertError;

const MAGIC: &[u8; 4] = b"GGUF";
/// `general.alignment` when the file does not say.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Sanity limit on the number of dimensions of one tensor.
const MAX_DIMS: u32 = 8;

/// One metadata value. Arrays hold values of a single type (possibly nested arrays).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::F32(_) => "float32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F64(_) => "float64",
        }
    }

    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, when it is an integer of any width that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, when it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
}

/// The element type of a tensor, as numbered in GGML.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => Iq2Xxs,
            17 => Iq2Xs,
            18 => Iq3Xxs,
            19 => Iq1S,
            20 => Iq4Nl,
            21 => Iq3S,
            22 => Iq2S,
            23 => Iq4Xs,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => Iq1M,
            30 => Bf16,
            34 => Tq1_0,
            35 => Tq2_0,
            39 => Mxfp4,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    pub fn block_layout(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | Bf16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            Iq2Xxs => (256, 66),
            Iq2Xs => (256, 74),
            Iq3Xxs => (256, 98),
            Iq1S => (256, 50),
            Iq4Nl => (32, 18),
            Iq3S => (256, 110),
            Iq2S => (256, 82),
            Iq4Xs => (256, 136),
            Iq1M => (256, 56),
            Tq1_0 => (256, 54),
            Tq2_0 => (256, 66),
            Mxfp4 => (32, 17),
        }
    }
}

/// Where one tensor lives in the file, and its shape in GGUF order (`dims[0]` is the innermost,
/// fastest-varying dimension).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the file (already including the data section start).
    pub file_offset: u64,
    pub byte_len: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub alignment: u64,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ConvertError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(ConvertError::Malformed(format!(
                "{what}: needs {n} bytes at offset {}, but the file is {} bytes long",
                self.pos,
                self.buf.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ConvertError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, ConvertError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, ConvertError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, ConvertError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, ConvertError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length that must fit in the rest of the file, given at least `min_item` bytes per item.
    fn count(&mut self, what: &str, min_item: u64) -> Result<usize, ConvertError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let remaining = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_item) > remaining {
            return Err(ConvertError::Malformed(format!(
                "{what} at offset {at} is {n}, more than the {remaining} bytes left in the file hold"
            )));
        }
        usize::try_from(n).map_err(|_| {
            ConvertError::Malformed(format!("{what} at offset {at} is {n}, too large"))
        })
    }

    fn string(&mut self, what: &str) -> Result<String, ConvertError> {
        let at = self.pos;
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            ConvertError::Malformed(format!(
                "{what} at offset {at} is not valid UTF-8 ({e}): {:?}",
                String::from_utf8_lossy(bytes)
            ))
        })
    }

    fn value(&mut self, value_type: u32, key: &str, depth: u32) -> Result<MetaValue, ConvertError> {
        let what = key;
        Ok(match value_type {
            0 => MetaValue::U8(self.u8(what)?),
            1 => MetaValue::I8(self.u8(what)? as i8),
            2 => MetaValue::U16(self.u16(what)?),
            3 => MetaValue::I16(self.u16(what)? as i16),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(self.u32(what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            7 => {
                let at = self.pos;
                match self.u8(what)? {
                    0 => MetaValue::Bool(false),
                    1 => MetaValue::Bool(true),
                    b => {
                        return Err(ConvertError::Malformed(format!(
                            "{key}: bool at offset {at} is {b}, not 0 or 1"
                        )))
                    }
                }
            }
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= 4 {
                    return Err(ConvertError::Malformed(format!(
                        "{key}: arrays nested more than 4 deep at offset {}",
                        self.pos
                    )));
                }
                let elem_type = self.u32(what)?;
                let min_item = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => {
                        return Err(ConvertError::Malformed(format!(
                            "{key}: unknown array element type {t} at offset {}",
                            self.pos - 4
                        )))
                    }
                };
                let n = self.count(what, min_item)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_type, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(self.u64(what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            t => {
                return Err(ConvertError::Malformed(format!(
                    "{key}: unknown metadata value type {t} at offset {}",
                    self.pos - 4
                )))
            }
        })
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, ConvertError> {
        let file = File::open(path).map_err(|e| ConvertError::io(path, e))?;
        // SAFETY: the map is read-only; the file is not expected to change while we convert it,
        // and every access below is bounds-checked against the map's length.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(path, e))?;
        Self::parse(path, map)
    }

    fn parse(path: &Path, map: Mmap) -> Result<Self, ConvertError> {
        let mut c = Cursor { buf: &map, pos: 0 };
        let magic = c.array::<4>("magic").map_err(|_| ConvertError::NotGguf {
            path: path.to_path_buf(),
            found: format!("{} bytes", map.len()),
        })?;
        if &magic != MAGIC {
            return Err(ConvertError::NotGguf {
                path: path.to_path_buf(),
                found: format!("magic {magic:02x?}"),
            });
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            return Err(ConvertError::Malformed(format!(
                "GGUF version {version} is not supported (supported: 2, 3)"
            )));
        }
        // A tensor info is at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
        let n_tensors = c.count("tensor count", 24)?;
        // A key-value pair is at least 8 (key len) + 4 (type) + 1 bytes.
        let n_kv = c.count("metadata count", 13)?;

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let value_type = c.u32(&key)?;
            let value = c.value(value_type, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(ConvertError::Malformed(format!(
                    "metadata key {key:?} appears twice"
                )));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(ConvertError::Malformed(format!(
                        "general.alignment is {v:?}, not a power of two"
                    )))
                }
            },
        };

        struct Raw {
            name: String,
            dims: Vec<u64>,
            ggml_type: GgmlType,
            offset: u64,
        }
        let mut raws = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(ConvertError::Malformed(format!(
                    "tensor {name:?} has {n_dims} dimensions (allowed: 1 to {MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let type_id = c.u32(&name)?;
            let ggml_type =
                GgmlType::from_id(type_id).ok_or_else(|| ConvertError::UnsupportedTensorType {
                    name: name.clone(),
                    ggml_type: format!("unknown type id {type_id}"),
                })?;
            let offset = c.u64(&name)?;
            raws.push(Raw {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = map.len() as u64;

        let mut tensors = Vec::with_capacity(raws.len());
        let mut seen = std::collections::HashSet::new();
        for r in raws {
            if !seen.insert(r.name.clone()) {
                return Err(ConvertError::Malformed(format!(
                    "tensor {:?} appears twice",
                    r.name
                )));
            }
            if !r.offset.is_multiple_of(alignment) {
                return Err(ConvertError::Malformed(format!(
                    "tensor {:?} data offset {} is not a multiple of the alignment {alignment}",
                    r.name, r.offset
                )));
            }
            let n_elements = r
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| {
                    ConvertError::Malformed(format!(
                        "tensor {:?} dims {:?} overflow",
                        r.name, r.dims
                    ))
                })?;
            let (block, block_bytes) = r.ggml_type.block_layout();
            if !r.dims[0].is_multiple_of(block) {
                return Err(ConvertError::Malformed(format!(
                    "tensor {:?} ({:?}) inner dimension {} is not a multiple of the block size {block}",
                    r.name, r.ggml_type, r.dims[0]
                )));
            }
            let byte_len = n_elements / block * block_bytes;
            let file_offset = data_start + r.offset;
            if file_offset
                .checked_add(byte_len)
                .is_none_or(|end| end > file_len)
            {
                return Err(ConvertError::Malformed(format!(
                    "tensor {:?} data [{file_offset}, +{byte_len}) runs past the end of the file ({file_len} bytes)",
                    r.name
                )));
            }
            tensors.push(TensorInfo {
                name: r.name,
                dims: r.dims,
                ggml_type: r.ggml_type,
                file_offset,
                byte_len,
            });
        }

        Ok(Self {
            path: path.to_path_buf(),
            map,
            version,
            alignment,
            metadata,
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The raw bytes of a tensor's data.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        // Bounds were checked in `parse`.
        &self.map[info.file_offset as usize..(info.file_offset + info.byte_len) as usize]
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required string value.
    pub fn str(&self, key: &str) -> Result<&str, ConvertError> {
        match self.required(key)? {
            MetaValue::String(s) => Ok(s),
            v => Err(ConvertError::wrong_type(key, "string", v)),
        }
    }

    /// A required non-negative integer value.
    pub fn u64(&self, key: &str) -> Result<u64, ConvertError> {
        let v = self.required(key)?;
        v.as_u64()
            .ok_or_else(|| ConvertError::wrong_type(key, "unsigned integer", v))
    }

    /// An optional non-negative integer value.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, ConvertError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| ConvertError::wrong_type(key, "unsigned integer", v))
            })
            .transpose()
    }

    /// A required float value (integers accepted).
    pub fn f64(&self, key: &str) -> Result<f64, ConvertError> {
        let v = self.required(key)?;
        v.as_f64()
            .ok_or_else(|| ConvertError::wrong_type(key, "number", v))
    }

    /// An optional bool value.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ConvertError::wrong_type(key, "bool", v)),
        }
    }

    /// A required array value.
    pub fn array(&self, key: &str) -> Result<&[MetaValue], ConvertError> {
        match self.required(key)? {
            MetaValue::Array(a) => Ok(a),
            v => Err(ConvertError::wrong_type(key, "array", v)),
        }
    }

    fn required(&self, key: &str) -> Result<&MetaValue, ConvertError> {
        self.metadata
            .get(key)
            .ok_or_else(|| ConvertError::MissingKey(key.to_string()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    /// Builds a GGUF v3 file in memory, for tests.
    #[derive(Default)]
    pub(crate) struct GgufBuilder {
        kv: Vec<u8>,
        n_kv: u64,
        infos: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    fn put_str(buf: &mut Vec<u8>, s: &str) {
        buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    }

    impl GgufBuilder {
        pub(crate) fn kv_raw(&mut self, key: &str, ty: u32, payload: &[u8]) -> &mut Self {
            put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&ty.to_le_bytes());
            self.kv.extend_from_slice(payload);
            self.n_kv += 1;
            self
        }
        pub(crate) fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.kv_raw(key, 4, &v.to_le_bytes())
        }
        pub(crate) fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.kv_raw(key, 6, &v.to_le_bytes())
        }
        pub(crate) fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.kv_raw(key, 7, &[v as u8])
        }
        pub(crate) fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            let mut p = Vec::new();
            put_str(&mut p, v);
            self.kv_raw(key, 8, &p)
        }
        pub(crate) fn kv_str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let mut p = 8u32.to_le_bytes().to_vec();
            p.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                put_str(&mut p, s);
            }
            self.kv_raw(key, 9, &p)
        }
        pub(crate) fn kv_i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let mut p = 5u32.to_le_bytes().to_vec();
            p.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                p.extend_from_slice(&x.to_le_bytes());
            }
            self.kv_raw(key, 9, &p)
        }
        pub(crate) fn tensor(
            &mut self,
            name: &str,
            dims: &[u64],
            ty: u32,
            data: Vec<u8>,
        ) -> &mut Self {
            self.infos.push((name.to_string(), dims.to_vec(), ty, data));
            self
        }
        pub(crate) fn build(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(b"GGUF");
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&(self.infos.len() as u64).to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            let mut offset = 0u64;
            let mut offsets = Vec::new();
            for (_, _, _, data) in &self.infos {
                offsets.push(offset);
                offset = (offset + data.len() as u64).div_ceil(32) * 32;
            }
            for ((name, dims, ty, _), off) in self.infos.iter().zip(&offsets) {
                put_str(&mut out, name);
                out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&off.to_le_bytes());
            }
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
            let start = out.len();
            for ((_, _, _, data), off) in self.infos.iter().zip(&offsets) {
                out.resize(start + *off as usize, 0);
                out.extend_from_slice(data);
            }
            out
        }
        pub(crate) fn write(&self, path: &Path) {
            let mut f = File::create(path).unwrap();
            f.write_all(&self.build()).unwrap();
        }
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut b = GgufBuilder::default();
        b.kv_u32("a.u32", 7)
            .kv_f32("a.f32", 1.5)
            .kv_bool("a.bool", true)
            .kv_str("a.str", "héllo")
            .kv_str_array("a.strs", &["x", "yz"])
            .kv_i32_array("a.ints", &[-1, 3])
            .tensor("w", &[2, 3], 0, vec![0u8; 24])
            .tensor("v", &[4], 1, vec![1u8; 8]);
        b.write(&path);
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.u64("a.u32").unwrap(), 7);
        assert_eq!(g.f64("a.f32").unwrap(), 1.5);
        assert_eq!(g.opt_bool("a.bool").unwrap(), Some(true));
        assert_eq!(g.str("a.str").unwrap(), "héllo");
        assert_eq!(
            g.array("a.strs").unwrap(),
            &[
                MetaValue::String("x".into()),
                MetaValue::String("yz".into())
            ]
        );
        assert_eq!(
            g.array("a.ints").unwrap(),
            &[MetaValue::I32(-1), MetaValue::I32(3)]
        );
        assert_eq!(g.tensors.len(), 2);
        assert_eq!(g.tensors[0].dims, vec![2, 3]);
        assert_eq!(g.tensors[1].ggml_type, GgmlType::F16);
        assert_eq!(g.tensor_data(&g.tensors[1]), &[1u8; 8]);
        assert!(matches!(g.str("missing"), Err(ConvertError::MissingKey(_))));
        assert!(matches!(
            g.str("a.u32"),
            Err(ConvertError::WrongType { .. })
        ));
    }

    #[test]
    fn rejects_truncated_and_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut b = GgufBuilder::default();
        b.kv_u32("a", 1).tensor("w", &[4], 0, vec![0u8; 16]);
        let bytes = b.build();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = GgufFile::open(&path).unwrap_err().to_string();
        assert!(err.contains("runs past the end"), "{err}");
        std::fs::write(&path, b"PK\x03\x04rest").unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        assert!(matches!(err, ConvertError::NotGguf { .. }), "{err}");
    }
}
