//! Crash safety: a process killed (SIGKILL) at a random moment while it writes leaves a store
//! that loads, with its identity, its groups and a usable state.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use static_mls::{Engine, Incoming};

const CH: &str = "acme/agents/crash";
const ENV: &str = "STATIC_CORE_CRASH_DIR";

/// The victim: run in a child process by `kill_mid_write_leaves_a_loadable_store`.
#[test]
#[ignore = "run as a child process by kill_mid_write_leaves_a_loadable_store"]
fn crash_child() {
    let Some((_, a, b)) = common::child_pair(ENV, CH) else {
        return;
    };
    println!("ready");
    loop {
        for _ in 0..5 {
            let m = a.encrypt(CH, &[7u8; 1024]).unwrap();
            b.process_incoming(CH, &m).unwrap();
        }
        let commit = a.self_update(CH).unwrap();
        a.merge_pending_commit(CH).unwrap();
        b.process_incoming(CH, &commit).unwrap();
        let _ = b.generate_key_package().unwrap();
    }
}

#[test]
fn kill_mid_write_leaves_a_loadable_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut key = None;
    for round in 0..4u64 {
        let after = Duration::from_millis(700 + 173 * round);
        common::run_then_kill("crash_child", ENV, dir.path(), after);

        let a = Engine::open(dir.path().join("alice"), b"alice").unwrap();
        let b = Engine::open(dir.path().join("bob"), b"bob").unwrap();
        assert_eq!(a.group_names(), vec![CH.to_string()], "round {round}");
        let k = a.signature_public_key().to_vec();
        assert_eq!(key.get_or_insert_with(|| k.clone()), &k);
        // Killed between alice's merge and bob's processing, bob is one epoch behind; the
        // pending commit (if any) is still there for the caller to resolve.
        if a.has_pending_commit(CH).unwrap() {
            a.clear_pending_commit(CH).unwrap();
        }
        let (ea, eb) = (a.epoch(CH).unwrap(), b.epoch(CH).unwrap());
        assert!(ea == eb || ea == eb + 1, "round {round}: {ea} vs {eb}");
        if ea == eb {
            assert_eq!(
                a.epoch_authenticator(CH).unwrap(),
                b.epoch_authenticator(CH).unwrap()
            );
            let m = a.encrypt(CH, b"after the crash").unwrap();
            assert!(matches!(
                b.process_incoming(CH, &m).unwrap(),
                Incoming::Application { .. }
            ));
        } else {
            // The commit bob missed is lost with the killed process's memory (the relay's log
            // would replay it); alice's own state is intact and usable.
            a.encrypt(CH, b"still usable").unwrap();
            // Rebuild a consistent pair for the next round.
            drop((a, b));
            std::fs::remove_dir_all(dir.path().join("alice")).unwrap();
            std::fs::remove_dir_all(dir.path().join("bob")).unwrap();
            key = None;
        }
    }
}
