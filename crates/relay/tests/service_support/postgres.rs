//! A throwaway PostgreSQL cluster for the service tests (initdb in a temporary directory,
//! loopback only, as `tests/support/postgres.py` makes one): moved from service_postgres.rs
//! so that other test files run on PostgreSQL too.

use std::path::PathBuf;
use std::process::Command;

use tempfile::TempDir;

/// The relay's tables on PostgreSQL (the crate's one list of migrations).
pub const SCHEMA: &[&str] = static_relay::schema::POSTGRESQL;

/// A PostgreSQL cluster of the test's own, stopped when dropped.
pub struct Cluster {
    bindir: PathBuf,
    root: TempDir,
    port: u16,
    /// PostgreSQL refuses to run as root: then it runs as the `postgres` user.
    as_root: bool,
}

/// The directory holding `initdb` and `pg_ctl`, if PostgreSQL is installed.
fn postgres_bin() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().or_else(|| {
        let out = Command::new("sh")
            .args(["-c", "command -v initdb"])
            .output()
            .ok()?;
        let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
        Some(path.canonicalize().ok()?.parent()?.to_owned())
    })
}

fn id_of(flag: &str) -> u32 {
    let out = Command::new("id")
        .args([flag, "postgres"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

impl Cluster {
    /// A started cluster, or None (after saying so) without PostgreSQL.
    pub fn start() -> Option<Cluster> {
        let Some(bindir) = postgres_bin() else {
            eprintln!("postgresql: skipped (no PostgreSQL binaries: scripts/ensure-postgres.sh)");
            return None;
        };
        let root = tempfile::Builder::new()
            .prefix("static-pg-")
            .tempdir()
            .unwrap();
        let as_root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|out| out.stdout.trim_ascii() == b"0");
        if as_root {
            std::os::unix::fs::chown(root.path(), Some(id_of("-u")), Some(id_of("-g"))).unwrap();
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = Cluster {
            bindir,
            root,
            port,
            as_root,
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        let options = format!(
            "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} \
             -c fsync=off",
            cluster.root.path().display()
        );
        let log = cluster.root.path().join("server.log");
        cluster.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
        Some(cluster)
    }

    fn data(&self) -> PathBuf {
        self.root.path().join("data")
    }

    fn run(&self, program: &str, args: &[&str]) {
        let program = self.bindir.join(program);
        let mut command = if self.as_root {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&program);
            command
        } else {
            Command::new(&program)
        };
        let out = command
            .args(args)
            .current_dir(self.root.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{} failed: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A new database with the relay's tables.
    pub async fn database(&self, name: &str) -> String {
        let admin = connect(&self.url("postgres")).await;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap();
        let url = self.url(name);
        let db = connect(&url).await;
        for schema in SCHEMA {
            db.batch_execute(schema).await.unwrap();
        }
        url
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data();
        let args = ["-D", data.to_str().unwrap(), "-m", "immediate", "stop"];
        // Best effort: the temporary directory goes anyway.
        let program = self.bindir.join("pg_ctl");
        let _ = if self.as_root {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&program)
                .args(args)
                .output()
        } else {
            Command::new(&program).args(args).output()
        };
    }
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}
