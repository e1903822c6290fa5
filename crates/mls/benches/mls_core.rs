//! `cargo bench -p static-mls`: per-message encrypt/decrypt (1 KiB) vs the Ed25519 sign+verify
//! floor, the batched calls (`-- batch`: `encrypt_many` / `process_entries`, per message), and
//! the add-member commit / Welcome processing at 8, 128 and 512 members.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use static_mls::bench_support::{
    ed25519_engine_sign_verify_ns, ed25519_sign_verify_ns, synthetic_key_packages, two_member_group,
};
use static_mls::{Engine, LogEntry};

const CH: &str = "bench/mls/core";

fn pair(dir: &std::path::Path, tag: &str) -> (Engine, Engine) {
    let a = Engine::open(dir.join(format!("{tag}a")), b"alice").unwrap();
    let b = Engine::open(dir.join(format!("{tag}b")), b"bob").unwrap();
    two_member_group(&a, &b, CH).unwrap();
    (a, b)
}

fn per_message(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    // Separate pairs: messages of the encrypt bench are never read, and a receiver refuses a
    // generation more than 1000 ahead of what it has read.
    let (a, _b) = pair(dir.path(), "enc");
    let (a2, b2) = pair(dir.path(), "dec");
    let payload = vec![0x42u8; 1024];

    let mut g = c.benchmark_group("per_message_1KiB");
    g.bench_function("ed25519_sign_verify_floor", |bench| {
        bench.iter_custom(|iters| {
            let ns =
                ed25519_sign_verify_ns(1024, u32::try_from(iters).unwrap_or(u32::MAX)).unwrap();
            Duration::from_nanos((ns * iters as f64) as u64)
        })
    });
    g.bench_function("encrypt", |bench| {
        bench.iter(|| a.encrypt(CH, &payload).unwrap())
    });
    g.bench_function("decrypt", |bench| {
        bench.iter_batched(
            || a2.encrypt(CH, &payload).unwrap(),
            |m| b2.process_incoming(CH, &m).unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// Per-message cost of the batched calls the client uses: `encrypt_many` (one durable
/// transaction per batch) and `process_entries` (one light transaction per batch), 1 KiB
/// payloads. Each reported time is per message (the batch time divided by its size).
fn batch(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let (a, _b) = pair(dir.path(), "benc");
    let (a2, b2) = pair(dir.path(), "bdec");
    let payload = vec![0x42u8; 1024];
    let mut seq = 0u64;

    let mut g = c.benchmark_group("batch_1KiB");
    g.sample_size(20).measurement_time(Duration::from_secs(5));
    // What the engine's own signer and verifier cost per message: the floor of the figures
    // below (one signature per encrypted message, one verification per processed one).
    g.bench_function("ed25519_engine_sign_verify_floor", |bench| {
        bench.iter_custom(|iters| {
            let ns = ed25519_engine_sign_verify_ns(1024, u32::try_from(iters).unwrap_or(u32::MAX))
                .unwrap();
            Duration::from_nanos((ns * iters as f64) as u64)
        })
    });
    for size in [1usize, 64] {
        let refs: Vec<&[u8]> = (0..size).map(|_| payload.as_slice()).collect();
        g.bench_function(format!("encrypt_many_{size}_per_msg"), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    a.encrypt_many(CH, &refs).unwrap();
                    total += start.elapsed();
                }
                total / size as u32
            })
        });
        g.bench_function(format!("process_entries_{size}_per_msg"), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let entries: Vec<(u64, Vec<u8>)> = a2
                        .encrypt_many(CH, &refs)
                        .unwrap()
                        .into_iter()
                        .map(|m| {
                            seq += 1;
                            (seq, m)
                        })
                        .collect();
                    let entries: Vec<LogEntry<'_>> =
                        entries.iter().map(|(s, m)| LogEntry::new(*s, m)).collect();
                    let start = Instant::now();
                    let applied = b2.process_entries(CH, &entries).unwrap();
                    total += start.elapsed();
                    assert!(applied.iter().all(|a| a.outcome.is_ok()));
                    // Keep the inbox small (not timed: it is not the engine's cost).
                    while b2.inbox_take(CH).unwrap().is_some() {}
                }
                total / size as u32
            })
        });
    }
    g.finish();
}

fn group_sizes(c: &mut Criterion) {
    let mut g = c.benchmark_group("add_member");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    for n in [8usize, 128, 512] {
        let dir = tempfile::tempdir().unwrap();
        let creator = Engine::open(dir.path().join("creator"), b"creator").unwrap();
        creator.create_group(CH).unwrap();
        let kps = synthetic_key_packages(n - 1).unwrap();
        let refs: Vec<&[u8]> = kps.iter().map(Vec::as_slice).collect();
        creator.add_members(CH, &refs).unwrap();
        creator.merge_pending_commit(CH).unwrap();
        let mut joiners = 0u32;
        g.bench_function(format!("commit_at_{n}"), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for kp in synthetic_key_packages(iters as usize).unwrap() {
                    let start = Instant::now();
                    creator.add_member(CH, &kp).unwrap();
                    total += start.elapsed();
                    creator.clear_pending_commit(CH).unwrap();
                }
                total
            })
        });
        g.bench_function(format!("welcome_at_{n}"), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    joiners += 1;
                    let j =
                        Engine::open(dir.path().join(format!("j{joiners}")), b"joiner").unwrap();
                    let out = creator
                        .add_member(CH, &j.generate_key_package().unwrap())
                        .unwrap();
                    creator.clear_pending_commit(CH).unwrap();
                    let start = Instant::now();
                    j.join_group(CH, &out.welcome).unwrap();
                    total += start.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, per_message, batch, group_sizes);
criterion_main!(benches);
