//! Fuzz-style robustness: random and mutated inputs give an `Err`, never a panic or a hang, and
//! leave the group working.
#![allow(clippy::unwrap_used)]

mod common;

use common::{agent, app, group_of, CH};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use static_mls::ErrorKind;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

#[test]
fn random_bytes_are_refused_everywhere() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    let fresh = agent("carol");
    runner(300)
        .run(&proptest::collection::vec(any::<u8>(), 0..1500), |bytes| {
            prop_assert!(b.engine.process_incoming(CH, &bytes).is_err());
            prop_assert!(a.engine.add_member(CH, &bytes).is_err());
            let err = fresh.engine.join_group(CH, &bytes).unwrap_err();
            prop_assert_eq!(err.kind(), ErrorKind::Mls);
            Ok(())
        })
        .unwrap();
    assert_eq!(a.engine.epoch(CH).unwrap(), 1);
    assert!(!a.engine.has_pending_commit(CH).unwrap());
    let m = a.engine.encrypt(CH, b"alive").unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &m).unwrap(),
        app(b"alice", b"alive", 1)
    );
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Remove(usize),
}

fn mutate(input: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = input.to_vec();
    for m in mutations {
        if out.is_empty() {
            break;
        }
        match *m {
            Mutation::Flip(i, bit) => {
                let i = i % out.len();
                out[i] ^= 1 << (bit % 8);
            }
            Mutation::Truncate(i) => out.truncate(i % out.len()),
            Mutation::Insert(i, byte) => {
                let i = i % out.len();
                out.insert(i, byte);
            }
            Mutation::Remove(i) => {
                let i = i % out.len();
                out.remove(i);
            }
        }
    }
    out
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Remove),
    ];
    proptest::collection::vec(one, 1..4)
}

#[test]
fn mutated_messages_welcomes_and_key_packages_are_refused() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    group_of(&a, &[&b]);
    let app_msg = a.engine.encrypt(CH, b"target").unwrap();
    let commit = a.engine.self_update(CH).unwrap();
    a.engine.clear_pending_commit(CH).unwrap();
    let kp = c.engine.generate_key_package().unwrap();
    let out = a.engine.add_member(CH, &kp).unwrap();
    a.engine.clear_pending_commit(CH).unwrap();
    let joiner = agent("dave");

    runner(200)
        .run(&(0usize..4, mutations()), |(which, muts)| {
            match which {
                0 => {
                    let bad = mutate(&app_msg, &muts);
                    if bad != app_msg {
                        prop_assert!(b.engine.process_incoming(CH, &bad).is_err());
                    }
                }
                1 => {
                    let bad = mutate(&commit, &muts);
                    if bad != commit {
                        prop_assert!(b.engine.process_incoming(CH, &bad).is_err());
                    }
                }
                2 => {
                    let bad = mutate(&out.welcome, &muts);
                    prop_assert!(joiner.engine.join_group(CH, &bad).is_err());
                }
                _ => {
                    let bad = mutate(&kp, &muts);
                    // Only bytes outside the signed content (none, in practice) could change
                    // and still verify; never leave a commit pending.
                    if bad != kp && a.engine.add_member(CH, &bad).is_ok() {
                        a.engine.clear_pending_commit(CH).unwrap();
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    // The untouched originals still work after all that.
    assert_eq!(
        b.engine.process_incoming(CH, &app_msg).unwrap(),
        app(b"alice", b"target", 1)
    );
    assert_eq!(b.engine.epoch(CH).unwrap(), 1);
    let m = b.engine.encrypt(CH, b"fine").unwrap();
    assert_eq!(
        a.engine.process_incoming(CH, &m).unwrap(),
        app(b"bob", b"fine", 1)
    );
}
