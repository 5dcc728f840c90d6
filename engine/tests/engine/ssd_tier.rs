//! The SSD KV tier with real MLX arrays (CPU, small shapes): entries written behind and
//! restored by a new tier (a new engine process) bit for bit, plain and quantized; every kind
//! of unusable file a miss that is deleted, never a crash; the size cap evicting the oldest.
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use mlx_rs::ops::quantize;
use mlx_rs::Dtype;
use mlxd_engine::cache::ssd::format::EntryKind;
use mlxd_engine::cache::ssd::{SsdConfig, SsdCounters, SsdTier};
use mlxd_engine::cache::{KvQuant, Stored};

/// A directory that looks like a model to the fingerprint (config, weights, tokenizer).
fn model_dir(root: &Path, name: &str) -> std::path::PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), format!("{{\"name\": \"{name}\"}}")).unwrap();
    std::fs::write(dir.join("model.safetensors"), name.repeat(100)).unwrap();
    std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
    dir
}

fn config(dir: &Path, max_bytes: Option<u64>) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        max_bytes,
        demote_idle: None,
        checkpoint_every: None,
    }
}

fn open(cache: &Path, model: &Path, max_bytes: Option<u64>) -> (SsdTier, Arc<SsdCounters>) {
    let counters = Arc::new(SsdCounters::default());
    let tier = SsdTier::open(config(cache, max_bytes), model, None, counters.clone()).unwrap();
    (tier, counters)
}

/// Two layers of `[1, 2, n, 64]` keys and values: bf16 plain, or 8-bit quantized.
fn layers(n: i32, quantized: bool, seed: u64) -> Vec<(Stored, Stored)> {
    mlx_rs::random::seed(seed).unwrap();
    (0..2)
        .map(|_| {
            let kv = || {
                let a = mlx_rs::random::normal::<f32>(&[1, 2, n, 64], None, None, None)
                    .unwrap()
                    .as_dtype(Dtype::Bfloat16)
                    .unwrap();
                if quantized {
                    let (weights, scales, biases) = quantize(&a, 64, 8).unwrap();
                    Stored::Quantized {
                        weights,
                        scales,
                        biases,
                        quant: KvQuant {
                            bits: 8,
                            group_size: 64,
                        },
                    }
                } else {
                    Stored::Plain(a)
                }
            };
            (kv(), kv())
        })
        .collect()
}

fn same(a: &[(Stored, Stored)], b: &[(Stored, Stored)]) {
    assert_eq!(a.len(), b.len());
    for ((ak, av), (bk, bv)) in a.iter().zip(b) {
        for (x, y) in [(ak, bk), (av, bv)] {
            assert_eq!(x.is_quantized(), y.is_quantized());
            for (p, q) in x.arrays().into_iter().zip(y.arrays()) {
                assert_eq!(p.shape(), q.shape());
                assert_eq!(p.dtype(), q.dtype());
                assert!(p.eq_values(q).unwrap(), "restored array differs");
            }
        }
    }
}

fn kv_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn flush(tier: &SsdTier) {
    assert!(tier.handle().flush(Duration::from_secs(60)).complete);
}

#[test]
fn a_new_tier_restores_what_the_last_one_wrote() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path(), "m");
    let cache = root.path().join("cache");
    let tokens: Vec<u32> = (100..140).collect();
    let quant_tokens: Vec<u32> = (200..230).collect();
    let plain = layers(40, false, 1);
    let quantized = layers(30, true, 2);
    {
        let (tier, counters) = open(&cache, &model, None);
        tier.queue(&tokens, &plain, EntryKind::Prefix).unwrap();
        tier.queue(
            &quant_tokens,
            &quantized,
            EntryKind::Checkpoint { generated: 5 },
        )
        .unwrap();
        flush(&tier);
        assert_eq!(counters.writes.load(Ordering::Relaxed), 2);
        assert_eq!(counters.checkpoints.load(Ordering::Relaxed), 1);
        // Already on disk: not written again.
        tier.queue(&tokens[..20], &plain, EntryKind::Prefix)
            .unwrap();
        flush(&tier);
        assert_eq!(counters.writes.load(Ordering::Relaxed), 2);
        assert!(kv_files(tier.dir()).iter().all(|n| n.ends_with(".kv")));
    }
    let (tier, counters) = open(&cache, &model, None);
    assert_eq!(counters.files.load(Ordering::Relaxed), 2);
    let mut prompt = tokens[..25].to_vec();
    prompt.push(7);
    let m = tier.lookup(&prompt, prompt.len() - 1).expect("a match");
    assert_eq!((m.matched, m.entry_len), (25, 40));
    same(&tier.restore(&m).unwrap().expect("restored"), &plain);
    let m = tier.lookup(&quant_tokens, 29).expect("a match");
    same(&tier.restore(&m).unwrap().expect("restored"), &quantized);
    assert_eq!(counters.hits.load(Ordering::Relaxed), 2);
    assert_eq!(counters.restored_tokens.load(Ordering::Relaxed), 25 + 29);
    assert_eq!(counters.invalid.load(Ordering::Relaxed), 0);
}

#[test]
fn unusable_files_are_misses_and_deleted() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path(), "m");
    let other = model_dir(root.path(), "other");
    let cache = root.path().join("cache");
    let entries: Vec<Vec<u32>> = (0..4).map(|i| (i * 100..i * 100 + 16).collect()).collect();
    let (dir, names) = {
        let (tier, _) = open(&cache, &model, None);
        for t in &entries {
            tier.queue(t, &layers(16, false, 3), EntryKind::Prefix)
                .unwrap();
        }
        flush(&tier);
        let dir = tier.dir().to_path_buf();
        (dir.clone(), kv_files(&dir))
    };
    assert_eq!(names.len(), 4);
    // Another model's file under a name of ours.
    let foreign = {
        let (tier, _) = open(&cache, &other, None);
        tier.queue(&entries[0], &layers(16, false, 4), EntryKind::Prefix)
            .unwrap();
        flush(&tier);
        tier.dir().join(&kv_files(tier.dir())[0])
    };
    let name_of = |t: &[u32]| {
        mlxd_engine::cache::ssd::identity::entry_name(mlxd_engine::cache::KvSpace::BASE, t)
    };
    let path = |t: &[u32]| dir.join(name_of(t));
    std::fs::copy(&foreign, path(&entries[0])).unwrap();
    // Truncated.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path(&entries[1]))
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 100).unwrap();
    drop(f);
    // Another format version.
    let mut bytes = std::fs::read(path(&entries[2])).unwrap();
    bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(path(&entries[2]), &bytes).unwrap();
    // A flipped payload byte (found when restored).
    let mut bytes = std::fs::read(path(&entries[3])).unwrap();
    let at = bytes.len() - 50;
    bytes[at] ^= 0xff;
    std::fs::write(path(&entries[3]), &bytes).unwrap();
    // A half-written file a crash left.
    std::fs::write(dir.join(format!(".tmp-{}", name_of(&[1, 2]))), b"partial").unwrap();

    let (tier, counters) = open(&cache, &model, None);
    assert_eq!(counters.invalid.load(Ordering::Relaxed), 3);
    assert_eq!(kv_files(&dir), vec![name_of(&entries[3])]);
    let m = tier.lookup(&entries[3], 15).expect("indexed until read");
    assert!(
        tier.restore(&m).unwrap().is_none(),
        "a corrupt payload is a miss"
    );
    assert_eq!(counters.invalid.load(Ordering::Relaxed), 4);
    assert!(kv_files(&dir).is_empty());
    for t in &entries {
        assert!(tier.lookup(t, 15).is_none());
    }
}

#[test]
fn the_size_cap_evicts_the_oldest_files() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path(), "m");
    let cache = root.path().join("cache");
    let one = {
        let (tier, counters) = open(&cache, &model, None);
        tier.queue(&[1, 2, 3, 4], &layers(4, false, 5), EntryKind::Prefix)
            .unwrap();
        flush(&tier);
        counters.bytes.load(Ordering::Relaxed)
    };
    std::fs::remove_dir_all(&cache).unwrap();
    // Room for two entries of that size.
    let (tier, counters) = open(&cache, &model, Some(one * 2 + one / 2));
    for (i, first) in [10u32, 20, 30].into_iter().enumerate() {
        let tokens = vec![first, first + 1, first + 2, first + 3];
        tier.queue(&tokens, &layers(4, false, i as u64), EntryKind::Prefix)
            .unwrap();
        flush(&tier);
        std::thread::sleep(Duration::from_millis(5)); // distinct write times
    }
    assert_eq!(counters.files.load(Ordering::Relaxed), 2);
    assert!(
        tier.lookup(&[10, 11, 12, 13], 3).is_none(),
        "the oldest went first"
    );
    assert!(tier.lookup(&[20, 21, 22, 23], 3).is_some());
    assert!(tier.lookup(&[30, 31, 32, 33], 3).is_some());
    assert_eq!(kv_files(tier.dir()).len(), 2);
}

#[test]
fn idle_prefixes_are_demoted_to_disk_and_restored_by_a_lookup() {
    use mlxd_engine::cache::{CacheManager, KvLayout, KvSpace};
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path(), "m");
    let counters = Arc::new(SsdCounters::default());
    let mut config = config(&root.path().join("cache"), None);
    config.demote_idle = Some(Duration::from_millis(1));
    let tier = SsdTier::open(config, &model, None, counters.clone()).unwrap();
    let handle = tier.handle();
    let mut caches =
        CacheManager::new(None, 1 << 30, 512, 512, KvLayout::default()).with_ssd(Some(tier));
    let tokens: Vec<u32> = (1..=24).collect();
    let kv = layers(24, false, 9);
    caches
        .store(KvSpace::BASE, tokens.clone(), kv.clone())
        .unwrap();
    assert!(caches.prefix_bytes() > 0);
    std::thread::sleep(Duration::from_millis(20)); // idle for longer than 1 ms
    caches.demote_idle().unwrap();
    assert_eq!(caches.prefix_bytes(), 0, "the idle entry left memory");
    assert_eq!(counters.demoted.load(Ordering::Relaxed), 1);
    assert!(handle.flush(Duration::from_secs(60)).complete);
    assert_eq!(counters.files.load(Ordering::Relaxed), 1);

    let mut prompt = tokens[..20].to_vec();
    prompt.push(99);
    let hit = caches
        .lookup(KvSpace::BASE, &prompt)
        .unwrap()
        .expect("restored from disk");
    assert_eq!(hit.tokens, 20);
    assert_eq!(counters.hits.load(Ordering::Relaxed), 1);
    assert!(
        caches.prefix_bytes() > 0,
        "the restored entry is back in memory"
    );
}
