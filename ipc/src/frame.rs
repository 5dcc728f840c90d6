//! Length-prefixed bincode frames: a 4-byte big-endian payload length, then the payload.

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest payload accepted on the control channel. Control messages are small; a huge
/// length prefix means the stream is corrupt (for example a stray `println!` on stdout).
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("control channel i/o: {0}")]
    Io(#[from] io::Error),
    #[error("control frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes")]
    TooLarge { len: u32 },
    #[error("control frame does not decode: {0}")]
    Decode(#[from] bincode::Error),
    #[error("control channel closed in the middle of a frame")]
    Truncated,
}

/// Encodes one message as a complete frame (prefix included).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let len = bincode::serialized_size(msg)?;
    let len = u32::try_from(len)
        .ok()
        .filter(|l| *l <= MAX_FRAME_BYTES)
        .ok_or(FrameError::TooLarge { len: u32::MAX })?;
    let mut buf = Vec::with_capacity(4 + len as usize);
    buf.extend_from_slice(&len.to_be_bytes());
    bincode::serialize_into(&mut buf, msg)?;
    Ok(buf)
}

fn check_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len });
    }
    Ok(len as usize)
}

/// Writes one frame and flushes.
pub fn write_frame<T: Serialize, W: Write>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    w.write_all(&encode(msg)?)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub fn read_frame<T: DeserializeOwned, R: Read>(r: &mut R) -> Result<Option<T>, FrameError> {
    let mut prefix = [0u8; 4];
    if !read_exact_or_eof(r, &mut prefix)? {
        return Ok(None);
    }
    let len = check_len(prefix)?;
    // Grows with the bytes that actually arrive: a prefix that promises a megabyte
    // and sends nothing allocates nothing.
    let mut payload = Vec::new();
    r.take(len as u64).read_to_end(&mut payload)?;
    if payload.len() < len {
        return Err(FrameError::Truncated);
    }
    Ok(Some(bincode::deserialize(&payload)?))
}

/// Fills `buf`; `Ok(false)` if the stream ended before the first byte.
fn read_exact_or_eof<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<bool, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Async counterpart of [`write_frame`].
pub async fn write_frame_async<T: Serialize, W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &T,
) -> Result<(), FrameError> {
    w.write_all(&encode(msg)?).await?;
    w.flush().await?;
    Ok(())
}

/// Async counterpart of [`read_frame`].
pub async fn read_frame_async<T: DeserializeOwned, R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<T>, FrameError> {
    let mut prefix = [0u8; 4];
    let mut filled = 0;
    while filled < 4 {
        match r.read(&mut prefix[filled..]).await? {
            0 if filled == 0 => return Ok(None),
            0 => return Err(FrameError::Truncated),
            n => filled += n,
        }
    }
    let len = check_len(prefix)?;
    let mut payload = Vec::new();
    (&mut *r).take(len as u64).read_to_end(&mut payload).await?;
    if payload.len() < len {
        return Err(FrameError::Truncated);
    }
    Ok(Some(bincode::deserialize(&payload)?))
}

#[cfg(test)]
mod proptests {
    use super::*;
    use mlxd_protocol::control::{ChildMsg, ParentMsg};
    use proptest::prelude::*;

    proptest! {
        // Small enough for a 2-core CI: a few hundred cases in well under a second.
        #![proptest_config(ProptestConfig::with_cases(std::env::var("MLXD_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)))]

        /// Arbitrary bytes never panic the decoder; it ends with a message, `None` or an
        /// error, and never reads past what it was given.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut r = io::Cursor::new(&bytes[..]);
            for _ in 0..64 {
                match read_frame::<ChildMsg, _>(&mut r) {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
            let mut r = io::Cursor::new(&bytes[..]);
            let _ = read_frame::<ParentMsg, _>(&mut r);
        }

        /// Any length prefix: above the limit is refused before reading; within it, a
        /// short payload is `Truncated` and the buffer never outgrows what arrived.
        #[test]
        fn length_prefixes_are_bounded(len in any::<u32>(), body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut bytes = len.to_be_bytes().to_vec();
            bytes.extend_from_slice(&body);
            let r = read_frame::<ChildMsg, _>(&mut io::Cursor::new(&bytes[..]));
            if len > MAX_FRAME_BYTES {
                prop_assert!(matches!(r, Err(FrameError::TooLarge { .. })), "{:?}", r);
            } else if (len as usize) > body.len() {
                prop_assert!(matches!(r, Err(FrameError::Truncated)), "{:?}", r);
            }
        }

        /// Valid frames round-trip, whatever follows them.
        #[test]
        fn stats_round_trip(active in any::<u32>(), kv in any::<u64>(), tail in proptest::collection::vec(any::<u8>(), 0..32)) {
            let msg = ChildMsg::Stats(mlxd_protocol::control::Stats { active, queued: 0, kv_bytes: kv, memory_bytes: kv, drafted_tokens: kv / 2, accepted_tokens: kv / 3, ssd: Default::default(), prefilling: 1, prefill_tokens_left: kv, memory: (active % 2 == 0).then_some(mlxd_protocol::control::MemoryStats { rss_bytes: kv, mlx_active_bytes: kv / 2, mlx_cache_bytes: kv / 3, mlx_cache_limit_bytes: kv / 4, mlx_peak_bytes: kv, mlx_memory_limit_bytes: u64::MAX }), prefix: mlxd_protocol::control::PrefixStats { lookups: kv, hits: kv / 2, reused_tokens: kv / 3, evictions: kv / 4, entries: u64::from(active), bytes: kv } });
            let mut bytes = encode(&msg).unwrap();
            bytes.extend_from_slice(&tail);
            let back = read_frame::<ChildMsg, _>(&mut io::Cursor::new(&bytes[..])).unwrap();
            prop_assert_eq!(back, Some(msg));
        }
    }

    #[tokio::test]
    async fn async_decoder_bounds_the_prefix_too() {
        let mut huge = &[0xffu8, 0xff, 0xff, 0xff][..];
        assert!(matches!(
            read_frame_async::<ChildMsg, _>(&mut huge).await,
            Err(FrameError::TooLarge { .. })
        ));
        let mut short = &[0u8, 0x10, 0, 0, 1, 2][..];
        assert!(matches!(
            read_frame_async::<ChildMsg, _>(&mut short).await,
            Err(FrameError::Truncated)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxd_protocol::control::{ChildMsg, Launch, Limits, ParentMsg, Stats, PROTOCOL_VERSION};

    fn launch() -> ParentMsg {
        ParentMsg::Launch(Launch {
            version: PROTOCOL_VERSION,
            model: "smollm2-135m".into(),
            socket_path: "/run/mlxd/engine-0.sock".into(),
            limits: Limits {
                max_batch_size: Some(8),
                kv_budget_bytes: None,
                context_length: Some(2048),
            },
            options: [("k".to_string(), "v".to_string())].into(),
        })
    }

    #[test]
    fn round_trip_sync() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &launch()).unwrap();
        write_frame(&mut buf, &ParentMsg::Drain).unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_frame::<ParentMsg, _>(&mut r).unwrap(), Some(launch()));
        assert_eq!(
            read_frame::<ParentMsg, _>(&mut r).unwrap(),
            Some(ParentMsg::Drain)
        );
        assert_eq!(read_frame::<ParentMsg, _>(&mut r).unwrap(), None);
    }

    #[tokio::test]
    async fn round_trip_async() {
        let msg = ChildMsg::Stats(Stats {
            active: 2,
            queued: 1,
            kv_bytes: 10,
            memory_bytes: 20,
            drafted_tokens: 6,
            accepted_tokens: 4,
            ssd: Default::default(),
            prefilling: 1,
            prefill_tokens_left: 300,
            memory: Some(mlxd_protocol::control::MemoryStats {
                rss_bytes: 300 << 20,
                mlx_cache_limit_bytes: 64 << 20,
                ..Default::default()
            }),
            prefix: Default::default(),
        });
        let mut buf = Vec::new();
        write_frame_async(&mut buf, &msg).await.unwrap();
        let mut r = buf.as_slice();
        assert_eq!(
            read_frame_async::<ChildMsg, _>(&mut r).await.unwrap(),
            Some(msg)
        );
        assert_eq!(read_frame_async::<ChildMsg, _>(&mut r).await.unwrap(), None);
    }

    #[test]
    fn truncated_frame_is_an_error() {
        let buf = encode(&launch()).unwrap();
        let mut r = &buf[..buf.len() - 1];
        assert!(matches!(
            read_frame::<ParentMsg, _>(&mut r),
            Err(FrameError::Truncated)
        ));
        let mut r = &buf[..2];
        assert!(matches!(
            read_frame::<ParentMsg, _>(&mut r),
            Err(FrameError::Truncated)
        ));
    }

    #[test]
    fn oversized_prefix_is_rejected_without_allocating() {
        let mut r: &[u8] = b"ll: hello from a stray println";
        assert!(matches!(
            read_frame::<ParentMsg, _>(&mut r),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn garbage_payload_is_a_decode_error() {
        let mut buf = 3u32.to_be_bytes().to_vec();
        buf.extend_from_slice(&[0xff, 0xff, 0xff]);
        let mut r = buf.as_slice();
        assert!(matches!(
            read_frame::<ParentMsg, _>(&mut r),
            Err(FrameError::Decode(_))
        ));
    }
}
