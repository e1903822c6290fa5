//! Sends that do not wait for the disk, and what a restart of the machine then requires: no
//! key and nonce may ever be used twice, even when a power loss took back ratchet advances of
//! messages that were already sent.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{app, group_of, Agent, CH};
use static_mls::store::DB_FILE;
use static_mls::{Engine, ErrorKind, Incoming};

fn agent_on_boot(name: &str, boot: Option<&str>) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        Engine::open_with_boot_id(dir.path(), name.as_bytes(), boot.map(str::to_owned)).unwrap();
    Agent { dir, engine }
}

/// What the disk of a machine that lost power now would hold if everything written after
/// this point were lost: a consistent copy of the open engine's database.
fn disk_now(agent: &Agent) -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    let conn = rusqlite::Connection::open(agent.dir.path().join(DB_FILE)).unwrap();
    let target = copy.path().join(DB_FILE);
    conn.execute("VACUUM INTO ?1", [target.to_str().unwrap()])
        .unwrap();
    copy
}

fn reopen(dir: &Path, name: &str, boot: Option<&str>) -> Engine {
    Engine::open_with_boot_id(dir, name.as_bytes(), boot.map(str::to_owned)).unwrap()
}

fn send(engine: &Engine, payload: &[u8]) -> Vec<u8> {
    let mut messages = engine.encrypt_many_unsynced(CH, &[payload]).unwrap();
    engine.sync_before_send().unwrap();
    messages.pop().unwrap()
}

/// Sends `payload` from alice's `engine`; bob reads it at `epoch`.
fn send_to_bob(engine: &Engine, bob: &Agent, payload: &[u8], epoch: u64) {
    let message = send(engine, payload);
    assert_eq!(
        bob.engine.process_incoming(CH, &message).unwrap(),
        app(b"alice", payload, epoch)
    );
}

/// Alice (opened on "boot-1") and bob in a group.
fn alice_and_bob() -> (Agent, Agent) {
    let (a, b) = (agent_on_boot("alice", Some("boot-1")), common::agent("bob"));
    group_of(&a, &[&b]);
    (a, b)
}

#[test]
fn after_the_machine_went_down_a_new_epoch_comes_before_encrypting() {
    let (a, b) = alice_and_bob();
    send_to_bob(&a.engine, &b, b"one", 1);
    let disk = disk_now(&a);
    // Sent (the relay has it, bob read it), but its ratchet advance never reached the disk.
    send_to_bob(&a.engine, &b, b"two", 1);

    // The machine restarts (another boot id); the engine was not closed.
    let a2 = reopen(disk.path(), "alice", Some("boot-2"));
    assert!(a2.needs_fresh_epoch(CH).unwrap());
    let refused = a2.encrypt(CH, b"three").unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Mls);
    assert!(
        refused.to_string().contains("before a commit of ours"),
        "{refused}"
    );
    assert_eq!(
        a2.encrypt_many_unsynced(CH, &[b"three"])
            .unwrap_err()
            .kind(),
        ErrorKind::Mls
    );

    // A commit of ours (here a self-update) moves to fresh secrets.
    let commit = a2.self_update(CH).unwrap();
    assert!(matches!(
        b.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::Commit { epoch: 2, .. }
    ));
    assert_eq!(
        a2.process_incoming(CH, &commit).unwrap(),
        Incoming::OwnCommit { epoch: 2 }
    );
    assert!(!a2.needs_fresh_epoch(CH).unwrap());
    send_to_bob(&a2, &b, b"three", 2);

    // Closed cleanly: the next opening, whatever the boot, suspects nothing.
    drop(a2);
    let a3 = reopen(disk.path(), "alice", Some("boot-3"));
    assert!(!a3.needs_fresh_epoch(CH).unwrap());
}

#[test]
fn what_the_fresh_epoch_prevents() {
    // The same loss, but the opening cannot tell (same boot id, as after a killed process,
    // which loses nothing written): encrypting again reuses the lost message's generation,
    // and bob cannot read it.
    let (a, b) = alice_and_bob();
    let disk = disk_now(&a);
    send_to_bob(&a.engine, &b, b"one", 1);
    let a2 = reopen(disk.path(), "alice", Some("boot-1"));
    assert!(!a2.needs_fresh_epoch(CH).unwrap());
    let reused = send(&a2, b"two");
    assert!(b.engine.process_incoming(CH, &reused).is_err());
}

#[test]
fn a_killed_process_a_clean_close_or_synced_sends_need_no_new_epoch() {
    let (a, b) = alice_and_bob();
    send_to_bob(&a.engine, &b, b"one", 1);
    // Killed process: the same boot, nothing written was lost.
    let killed = disk_now(&a);
    assert!(!reopen(killed.path(), "alice", Some("boot-1"))
        .needs_fresh_epoch(CH)
        .unwrap());
    // Closed cleanly, then the machine restarted.
    let dir = a.dir;
    drop(a.engine);
    assert!(!reopen(dir.path(), "alice", Some("boot-2"))
        .needs_fresh_epoch(CH)
        .unwrap());

    // No boot id: every send was synced, so a restart loses none.
    let (c, d) = (agent_on_boot("carol", None), common::agent("dave"));
    group_of(&c, &[&d]);
    send(&c.engine, b"one");
    let disk = disk_now(&c);
    assert!(!reopen(disk.path(), "carol", Some("boot-2"))
        .needs_fresh_epoch(CH)
        .unwrap());
}

#[test]
fn the_requirement_survives_another_restart_until_met() {
    let (a, b) = alice_and_bob();
    let disk = disk_now(&a);
    let a2 = reopen(disk.path(), "alice", Some("boot-2"));
    assert!(a2.needs_fresh_epoch(CH).unwrap());
    // Another member's commit is not enough: our lost sends may be at its epoch too.
    let theirs = b.engine.self_update(CH).unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &theirs).unwrap(),
        Incoming::OwnCommit { epoch: 2 }
    );
    assert!(matches!(
        a2.process_incoming(CH, &theirs).unwrap(),
        Incoming::Commit { epoch: 2, .. }
    ));
    assert!(a2.needs_fresh_epoch(CH).unwrap());
    drop(a2);
    let a3 = reopen(disk.path(), "alice", Some("boot-3"));
    assert!(a3.needs_fresh_epoch(CH).unwrap());
}
