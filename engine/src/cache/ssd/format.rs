//! The on-disk format of one SSD-tier entry: a self-describing header, the raw tensor bytes,
//! and two checksums. Pure (no MLX, no files): encoding, decoding and every validity check.
//!
//! ```text
//! magic "MLXDKV\0\0" | version u32 | header_len u32 | header | header_crc u32 | payload | payload_crc u32
//! header: model fingerprint [32] | tokenizer hash [32] | space [32] | kind u8 | generated u32
//!         | n_tokens u32 | tokens [u32] | n_layers u32 | per layer: start u32, kind u8,
//!           kind 0 (keys and values): keys, values as quant_bits u8 (0 = plain)
//!             | group_size u32 | n_arrays u8 | per array: <array>
//!           kind 1 (a recurrent state): n_arrays u8 | per array: <array>
//!         | payload_len u64
//! array:  dtype u8 | ndim u8 | shape [u32] | offset u64 | len u64
//! ```
//! A KV layer's `start` is the logical position of its first held position (nonzero for a
//! sliding-window layer that evicted positions): its arrays hold `n_tokens - start` positions.
//! A state layer stands for all `n_tokens` and starts there (see `SeqKv`).
//! `space` is the adapter fingerprint whose KV the entry holds (all zeros: the base model's,
//! see `KvSpace`). All integers are little-endian. `header_crc` is the CRC-32 of every byte before it (so a
//! scan at start-up validates an entry from its header alone); `payload_crc` that of the
//! payload, checked when the entry is restored.

use crate::cache::KvSpace;

/// Bumped on any change to the layout above; a file of another version is foreign (a miss,
/// deleted). Version 2 added each layer's start, version 3 each layer's kind, version 4 the
/// entry's space.
pub const FORMAT_VERSION: u32 = 4;
/// Arrays one recurrent layer's state may have.
const MAX_STATE_ARRAYS: u8 = 16;
pub const MAGIC: &[u8; 8] = b"MLXDKV\0\0";
/// Bytes before the header: magic, version, header length.
const PREFIX: usize = 16;
/// Headers larger than this are refused before allocating (a corrupt length).
const MAX_HEADER: usize = 64 << 20;

/// Who may read an entry: the model's and the tokenizer's fingerprints (SHA-256).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub model: [u8; 32],
    pub tokenizer: [u8; 32],
}

/// Why an entry was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A prefix-cache entry (a finished sequence's KV).
    Prefix,
    /// A generation checkpoint of a running sequence, `generated` tokens past its prompt.
    Checkpoint { generated: u32 },
}

/// An array's element type, as the file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeCode {
    F32 = 1,
    F16 = 2,
    Bf16 = 3,
    U32 = 4,
}

impl DtypeCode {
    pub fn size(self) -> u64 {
        match self {
            DtypeCode::F32 | DtypeCode::U32 => 4,
            DtypeCode::F16 | DtypeCode::Bf16 => 2,
        }
    }

    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => DtypeCode::F32,
            2 => DtypeCode::F16,
            3 => DtypeCode::Bf16,
            4 => DtypeCode::U32,
            _ => return None,
        })
    }
}

/// One array of the payload: its type, shape and byte range (from the payload's start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    pub dtype: DtypeCode,
    pub shape: Vec<u32>,
    pub offset: u64,
    pub len: u64,
}

/// Keys or values of one layer: one plain array, or the three arrays of an affine-quantized
/// cache (packed weights, scales, biases) with its bits and group size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredDesc {
    pub quant: Option<(u8, u32)>,
    pub arrays: Vec<TensorDesc>,
}

/// One layer of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerDesc {
    /// Keys and values.
    Kv(StoredDesc, StoredDesc),
    /// A recurrent layer's state arrays (any shape).
    State(Vec<TensorDesc>),
}

impl LayerDesc {
    /// Every array of the layer, in payload order.
    pub fn arrays(&self) -> Vec<&TensorDesc> {
        match self {
            LayerDesc::Kv(k, v) => k.arrays.iter().chain(&v.arrays).collect(),
            LayerDesc::State(a) => a.iter().collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub identity: Identity,
    /// Whose KV this is: the base model's or an adapter's.
    pub space: KvSpace,
    pub kind: EntryKind,
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerDesc>,
    /// Per layer, the logical position of its first held position (see the module comment).
    pub starts: Vec<u32>,
    pub payload_len: u64,
}

/// Why a file is not a usable entry. Every one of them makes the file a miss to delete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("not an mlxd KV file (bad magic)")]
    Magic,
    #[error("format version {0}, this engine reads {FORMAT_VERSION}")]
    Version(u32),
    #[error("truncated ({0})")]
    Truncated(&'static str),
    #[error("header checksum mismatch")]
    HeaderChecksum,
    #[error("payload checksum mismatch")]
    PayloadChecksum,
    #[error("written for another model")]
    Model,
    #[error("written with another tokenizer")]
    Tokenizer,
    #[error("malformed header: {0}")]
    Malformed(String),
}

impl Header {
    /// The file's bytes before the payload: prefix, header, header checksum.
    pub fn encode(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(128 + 4 * self.tokens.len());
        h.extend_from_slice(&self.identity.model);
        h.extend_from_slice(&self.identity.tokenizer);
        h.extend_from_slice(&self.space.0);
        let (kind, generated) = match self.kind {
            EntryKind::Prefix => (0u8, 0u32),
            EntryKind::Checkpoint { generated } => (1, generated),
        };
        h.push(kind);
        h.extend_from_slice(&generated.to_le_bytes());
        h.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        for t in &self.tokens {
            h.extend_from_slice(&t.to_le_bytes());
        }
        h.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        let array = |h: &mut Vec<u8>, a: &TensorDesc| {
            h.push(a.dtype as u8);
            h.push(a.shape.len() as u8);
            for d in &a.shape {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&a.offset.to_le_bytes());
            h.extend_from_slice(&a.len.to_le_bytes());
        };
        for (layer, start) in self.layers.iter().zip(&self.starts) {
            h.extend_from_slice(&start.to_le_bytes());
            match layer {
                LayerDesc::Kv(k, v) => {
                    h.push(0);
                    for s in [k, v] {
                        let (bits, group) = s.quant.unwrap_or((0, 0));
                        h.push(bits);
                        h.extend_from_slice(&group.to_le_bytes());
                        h.push(s.arrays.len() as u8);
                        for a in &s.arrays {
                            array(&mut h, a);
                        }
                    }
                }
                LayerDesc::State(arrays) => {
                    h.push(1);
                    h.push(arrays.len() as u8);
                    for a in arrays {
                        array(&mut h, a);
                    }
                }
            }
        }
        h.extend_from_slice(&self.payload_len.to_le_bytes());
        let mut out = Vec::with_capacity(PREFIX + h.len() + 4);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(h.len() as u32).to_le_bytes());
        out.extend_from_slice(&h);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Bytes of the whole file: header part, payload, payload checksum.
    pub fn file_len(&self) -> u64 {
        self.encode().len() as u64 + self.payload_len + 4
    }
}

/// The header at the start of `bytes` (a file or its first part), checked against `expected`;
/// returns it with the payload's offset in the file. `file_len` is the file's full size, so a
/// truncated file is found from its header alone.
pub fn decode_header(
    bytes: &[u8],
    file_len: u64,
    expected: &Identity,
) -> Result<(Header, usize), Invalid> {
    if bytes.len() < PREFIX {
        return Err(Invalid::Truncated("shorter than the prefix"));
    }
    if &bytes[..8] != MAGIC {
        return Err(Invalid::Magic);
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(Invalid::Version(version));
    }
    let header_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    if header_len > MAX_HEADER {
        return Err(Invalid::Malformed(format!("header of {header_len} bytes")));
    }
    let crc_end = PREFIX + header_len + 4;
    if bytes.len() < crc_end {
        return Err(Invalid::Truncated("inside the header"));
    }
    let stored_crc = u32::from_le_bytes(
        bytes[PREFIX + header_len..crc_end]
            .try_into()
            .expect("4 bytes"),
    );
    if crc32fast::hash(&bytes[..PREFIX + header_len]) != stored_crc {
        return Err(Invalid::HeaderChecksum);
    }
    let header = parse(&bytes[PREFIX..PREFIX + header_len])?;
    if header.identity.model != expected.model {
        return Err(Invalid::Model);
    }
    if header.identity.tokenizer != expected.tokenizer {
        return Err(Invalid::Tokenizer);
    }
    let want = crc_end as u64 + header.payload_len + 4;
    if file_len < want {
        return Err(Invalid::Truncated("inside the payload"));
    }
    if file_len > want {
        return Err(Invalid::Malformed(format!(
            "{} bytes after the entry",
            file_len - want
        )));
    }
    Ok((header, crc_end))
}

/// The payload of a whole file whose header decoded with payload offset `start`, once its
/// checksum matches.
pub fn checked_payload<'a>(
    file: &'a [u8],
    header: &Header,
    start: usize,
) -> Result<&'a [u8], Invalid> {
    let end = start as u64 + header.payload_len;
    if (file.len() as u64) < end + 4 {
        return Err(Invalid::Truncated("inside the payload"));
    }
    let payload = &file[start..end as usize];
    let stored = u32::from_le_bytes(
        file[end as usize..end as usize + 4]
            .try_into()
            .expect("4 bytes"),
    );
    if crc32fast::hash(payload) != stored {
        return Err(Invalid::PayloadChecksum);
    }
    Ok(payload)
}

/// Reads the header fields in order, every length bounded by what is left.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Invalid> {
        if self.bytes.len() - self.at < n {
            return Err(Invalid::Malformed("a field runs past the header".into()));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, Invalid> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, Invalid> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, Invalid> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn fingerprint(&mut self) -> Result<[u8; 32], Invalid> {
        Ok(self.take(32)?.try_into().expect("32"))
    }
}

fn parse(bytes: &[u8]) -> Result<Header, Invalid> {
    let mut r = Reader { bytes, at: 0 };
    let identity = Identity {
        model: r.fingerprint()?,
        tokenizer: r.fingerprint()?,
    };
    let space = KvSpace(r.fingerprint()?);
    let kind = match (r.u8()?, r.u32()?) {
        (0, _) => EntryKind::Prefix,
        (1, generated) => EntryKind::Checkpoint { generated },
        (k, _) => return Err(Invalid::Malformed(format!("entry kind {k}"))),
    };
    let n = r.u32()? as usize;
    if n == 0 || n > (bytes.len() - r.at) / 4 {
        return Err(Invalid::Malformed(format!("{n} tokens")));
    }
    let tokens = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
    let n_layers = r.u32()? as usize;
    if n_layers == 0 || n_layers > 4096 {
        return Err(Invalid::Malformed(format!("{n_layers} layers")));
    }
    let mut layers = Vec::with_capacity(n_layers);
    let mut starts = Vec::with_capacity(n_layers);
    let mut arrays_end = Vec::new();
    for _ in 0..n_layers {
        let start = r.u32()?;
        let layer = match r.u8()? {
            0 if (start as usize) < n => {
                let k = stored(&mut r, &mut arrays_end)?;
                let v = stored(&mut r, &mut arrays_end)?;
                LayerDesc::Kv(k, v)
            }
            1 if start as usize == n => {
                let count = r.u8()?;
                if count == 0 || count > MAX_STATE_ARRAYS {
                    return Err(Invalid::Malformed(format!("a state of {count} arrays")));
                }
                let arrays = (0..count)
                    .map(|_| tensor(&mut r, &mut arrays_end, None))
                    .collect::<Result<Vec<_>, _>>()?;
                LayerDesc::State(arrays)
            }
            0 | 1 => {
                return Err(Invalid::Malformed(format!(
                    "a layer starts at {start} of {n} tokens"
                )))
            }
            k => return Err(Invalid::Malformed(format!("layer kind {k}"))),
        };
        starts.push(start);
        layers.push(layer);
    }
    let payload_len = r.u64()?;
    if r.at != bytes.len() {
        return Err(Invalid::Malformed("bytes after the payload length".into()));
    }
    if let Some(end) = arrays_end.iter().copied().find(|&e| e > payload_len) {
        return Err(Invalid::Malformed(format!(
            "an array ends at {end}, past the payload's {payload_len} bytes"
        )));
    }
    Ok(Header {
        identity,
        space,
        kind,
        tokens,
        layers,
        starts,
        payload_len,
    })
}

fn stored(r: &mut Reader<'_>, ends: &mut Vec<u64>) -> Result<StoredDesc, Invalid> {
    let bits = r.u8()?;
    let group = r.u32()?;
    let quant = match bits {
        0 => None,
        4 | 8 => Some((bits, group)),
        b => return Err(Invalid::Malformed(format!("{b}-bit quantization"))),
    };
    let count = r.u8()?;
    let want = if quant.is_some() { 3 } else { 1 };
    if count != want {
        return Err(Invalid::Malformed(format!(
            "{count} arrays where {want} belong"
        )));
    }
    let arrays = (0..count)
        .map(|_| tensor(r, ends, Some(4)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(StoredDesc { quant, arrays })
}

/// One array's descriptor; keys and values are 4-D (`ndim`), a state's arrays 1-D to 8-D.
fn tensor(
    r: &mut Reader<'_>,
    ends: &mut Vec<u64>,
    ndim_wanted: Option<usize>,
) -> Result<TensorDesc, Invalid> {
    let code = r.u8()?;
    let dtype =
        DtypeCode::from_u8(code).ok_or_else(|| Invalid::Malformed(format!("dtype code {code}")))?;
    let ndim = r.u8()? as usize;
    let fits = match ndim_wanted {
        Some(want) => ndim == want,
        None => (1..=8).contains(&ndim),
    };
    if !fits {
        return Err(Invalid::Malformed(format!("{ndim} dimensions")));
    }
    let shape = (0..ndim).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
    let offset = r.u64()?;
    let len = r.u64()?;
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    if elements.and_then(|e| e.checked_mul(dtype.size())) != Some(len) {
        return Err(Invalid::Malformed(format!(
            "{len} bytes for shape {shape:?}"
        )));
    }
    let end = offset
        .checked_add(len)
        .ok_or_else(|| Invalid::Malformed("an array's range overflows".into()))?;
    ends.push(end);
    Ok(TensorDesc {
        dtype,
        shape,
        offset,
        len,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub const ME: Identity = Identity {
        model: [7; 32],
        tokenizer: [9; 32],
    };

    /// A small valid file: two layers, keys plain f32, values 8-bit quantized.
    pub fn sample_file(identity: Identity, tokens: Vec<u32>) -> (Header, Vec<u8>) {
        let mut payload = Vec::new();
        let mut layers = Vec::new();
        let add = |dtype: DtypeCode, shape: Vec<u32>, payload: &mut Vec<u8>| {
            let len = shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size();
            let offset = payload.len() as u64;
            payload.extend((0..len).map(|i| (i * 31 % 251) as u8));
            TensorDesc {
                dtype,
                shape,
                offset,
                len,
            }
        };
        let n = tokens.len() as u32;
        for _ in 0..2 {
            let k = StoredDesc {
                quant: None,
                arrays: vec![add(DtypeCode::F32, vec![1, 2, n, 8], &mut payload)],
            };
            let v = StoredDesc {
                quant: Some((8, 32)),
                arrays: vec![
                    add(DtypeCode::U32, vec![1, 2, n, 2], &mut payload),
                    add(DtypeCode::Bf16, vec![1, 2, n, 1], &mut payload),
                    add(DtypeCode::Bf16, vec![1, 2, n, 1], &mut payload),
                ],
            };
            layers.push(LayerDesc::Kv(k, v));
        }
        let header = Header {
            identity,
            space: KvSpace([9; 32]),
            kind: EntryKind::Checkpoint { generated: 3 },
            tokens,
            starts: vec![0; layers.len()],
            layers,
            payload_len: payload.len() as u64,
        };
        let mut file = header.encode();
        file.extend_from_slice(&payload);
        file.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        (header, file)
    }

    fn decode(file: &[u8]) -> Result<Header, Invalid> {
        let (h, start) = decode_header(file, file.len() as u64, &ME)?;
        checked_payload(file, &h, start)?;
        Ok(h)
    }

    /// A file of one KV layer and one recurrent layer (a conv window and an f32 state) whose
    /// state layer starts at `state_start`.
    fn hybrid_file(state_start: u32) -> (Header, Vec<u8>) {
        let (mut header, _) = sample_file(ME, vec![1, 2, 3]);
        header.layers.truncate(1);
        header.starts.truncate(1);
        let mut offset = header.payload_len;
        let mut state = Vec::new();
        for (dtype, shape) in [
            (DtypeCode::Bf16, vec![1, 3, 16]),
            (DtypeCode::F32, vec![1, 4, 8, 8]),
        ] {
            let len = shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size();
            state.push(TensorDesc {
                dtype,
                shape,
                offset,
                len,
            });
            offset += len;
        }
        header.layers.push(LayerDesc::State(state));
        header.starts.push(state_start);
        header.payload_len = offset;
        let payload: Vec<u8> = (0..offset).map(|i| (i % 251) as u8).collect();
        let mut file = header.encode();
        file.extend_from_slice(&payload);
        file.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        (header, file)
    }

    #[test]
    fn a_recurrent_state_layer_round_trips_and_starts_where_the_entry_ends() {
        let (header, file) = hybrid_file(3);
        assert_eq!(decode(&file), Ok(header));
        let (_, early) = hybrid_file(2);
        assert!(matches!(decode(&early), Err(Invalid::Malformed(_))));
    }

    #[test]
    fn round_trips() {
        let (header, file) = sample_file(ME, vec![1, 2, 3, 4, 5]);
        assert_eq!(decode(&file).unwrap(), header);
        assert_eq!(header.file_len(), file.len() as u64);
    }

    #[test]
    fn layer_starts_round_trip_and_stay_below_the_tokens() {
        let (mut header, file) = sample_file(ME, vec![1, 2, 3]);
        let payload_and_crc = file[header.encode().len()..].to_vec();
        let with_starts = |header: &Header| {
            let mut f = header.encode();
            f.extend_from_slice(&payload_and_crc);
            f
        };
        header.starts = vec![0, 2];
        assert_eq!(decode(&with_starts(&header)).unwrap().starts, vec![0, 2]);
        header.starts = vec![0, 3];
        assert!(matches!(
            decode(&with_starts(&header)),
            Err(Invalid::Malformed(_))
        ));
    }

    #[test]
    fn a_flipped_byte_anywhere_is_caught() {
        let (_, file) = sample_file(ME, vec![1, 2, 3]);
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad).is_err(), "byte {i} flipped went unnoticed");
        }
    }

    #[test]
    fn every_truncation_is_caught() {
        let (_, file) = sample_file(ME, vec![1, 2, 3]);
        for len in 0..file.len() {
            let e = decode(&file[..len]).expect_err("truncated");
            assert!(
                matches!(e, Invalid::Truncated(_)),
                "cut at {len}: {e:?}, not Truncated"
            );
        }
        // The header alone, with the real file size, says the payload is cut.
        let (h, _) = sample_file(ME, vec![1, 2, 3]);
        let head = h.encode();
        assert!(matches!(
            decode_header(&head, file.len() as u64 - 1, &ME),
            Err(Invalid::Truncated(_))
        ));
    }

    #[test]
    fn foreign_files_are_refused_by_what_differs() {
        let other_model = Identity {
            model: [1; 32],
            ..ME
        };
        let (_, file) = sample_file(other_model, vec![1, 2]);
        assert_eq!(decode(&file), Err(Invalid::Model));
        let other_tokenizer = Identity {
            tokenizer: [1; 32],
            ..ME
        };
        let (_, file) = sample_file(other_tokenizer, vec![1, 2]);
        assert_eq!(decode(&file), Err(Invalid::Tokenizer));
    }

    #[test]
    fn another_version_or_no_magic_is_foreign() {
        let (_, mut file) = sample_file(ME, vec![1, 2]);
        file[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        assert_eq!(decode(&file), Err(Invalid::Version(FORMAT_VERSION + 1)));
        // Version 1 (no layer starts) and 3 (no space) are foreign too.
        let (_, mut file) = sample_file(ME, vec![1, 2]);
        file[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(decode(&file), Err(Invalid::Version(3)));
        let (_, mut file) = sample_file(ME, vec![1, 2]);
        file[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(decode(&file), Err(Invalid::Version(1)));
        let (_, mut file) = sample_file(ME, vec![1, 2]);
        file[0] = b'X';
        assert_eq!(decode(&file), Err(Invalid::Magic));
    }
}
