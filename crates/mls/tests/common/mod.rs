#![allow(dead_code, clippy::unwrap_used)]

use static_mls::{Engine, Incoming};
use tempfile::TempDir;

pub const CH: &str = "acme/agents/planner";

/// In a crash test's child process (the data directory in `env`): that directory, and
/// alice's and bob's engines in it with `channel` a two-member group (made on the first run).
/// `None` when the test runs on its own, not as a child.
pub fn child_pair(env: &str, channel: &str) -> Option<(std::path::PathBuf, Engine, Engine)> {
    let dir = std::path::PathBuf::from(std::env::var(env).ok()?);
    let a = Engine::open(dir.join("alice"), b"alice").unwrap();
    let b = Engine::open(dir.join("bob"), b"bob").unwrap();
    if !a.has_group(channel) {
        static_mls::bench_support::two_member_group(&a, &b, channel).unwrap();
    }
    Some((dir, a, b))
}

pub struct Agent {
    pub dir: TempDir,
    pub engine: Engine,
}

pub fn agent(name: &str) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), name.as_bytes()).unwrap();
    Agent { dir, engine }
}

/// `creator` creates `CH` and adds each of `others` in turn; every existing member processes
/// each commit from the "log". Returns the log of commits.
pub fn group_of(creator: &Agent, others: &[&Agent]) -> Vec<Vec<u8>> {
    creator.engine.create_group(CH).unwrap();
    let mut joined: Vec<&Agent> = vec![];
    let mut log = vec![];
    for other in others {
        let kp = other.engine.generate_key_package().unwrap();
        let out = creator.engine.add_member(CH, &kp).unwrap();
        // The relay accepted it: the creator sees its own commit echoed.
        assert_eq!(
            creator.engine.process_incoming(CH, &out.commit).unwrap(),
            Incoming::OwnCommit {
                epoch: creator.engine.epoch(CH).unwrap()
            }
        );
        for m in &joined {
            assert!(matches!(
                m.engine.process_incoming(CH, &out.commit).unwrap(),
                Incoming::Commit { .. }
            ));
        }
        other.engine.join_group(CH, &out.welcome).unwrap();
        joined.push(other);
        log.push(out.commit);
    }
    log
}

pub fn app(from: &[u8], payload: &[u8], epoch: u64) -> Incoming {
    Incoming::Application {
        sender: from.to_vec(),
        payload: payload.to_vec(),
        epoch,
    }
}

/// The identities of `CH`'s members as `agent` sees them, in leaf order.
pub fn member_names(agent: &Agent) -> Vec<Vec<u8>> {
    agent
        .engine
        .members(CH)
        .unwrap()
        .into_iter()
        .map(|m| m.identity)
        .collect()
}

/// Runs the ignored test `child` of the current test binary in a child process (with `env`
/// set to `dir`), lets it work for `after`, then kills it with SIGKILL.
pub fn run_then_kill(child: &str, env: &str, dir: &std::path::Path, after: std::time::Duration) {
    let exe = std::env::current_exe().unwrap();
    let mut process = std::process::Command::new(exe)
        .args([
            "--exact",
            child,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env, dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(after);
    process.kill().unwrap(); // SIGKILL
    process.wait().unwrap();
}
