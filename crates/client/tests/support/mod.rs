//! What the client's integration tests share: a real relay in-process (a tokio runtime of its
//! own, a fresh SQLite file, stop and restart on the same port), clients on temporary data
//! directories, a token authority (verifier and providers), and waits that all have deadlines.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::ops::Deref;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use static_client::{Channel, Client, ClientOptions, Next, Token, TokenError, TokenProvider};
use static_relay::{Principal, RelayConfig, RelayError, RelayServer, Verify};
use tempfile::TempDir;
use tokio::runtime::Runtime;

/// How long a test waits for anything that should happen promptly (a message, an epoch).
pub const WAIT: Duration = Duration::from_secs(20);

pub const TRANSPORT: &str = "transport error:";
pub const AUTH: &str = "auth error:";
pub const MLS: &str = "MLS engine error:";
pub const INVALID_NAME: &str = "invalid channel name:";

// --- the relay --------------------------------------------------------------------------------

type Configure = Arc<dyn Fn(&mut RelayConfig) + Send + Sync>;

/// A relay serving a SQLite file of its own on 127.0.0.1, on a runtime of its own (the client
/// calls block, so they must not run inside it). Stopped and restarted on the same port and
/// file, clients can reconnect to it.
pub struct Relay {
    runtime: Option<Runtime>,
    server: Option<RelayServer>,
    addr: SocketAddr,
    db_path: PathBuf,
    configure: Configure,
    verifier: Option<Arc<dyn Verify>>,
    _dir: TempDir,
}

impl Relay {
    /// Anonymous callers allowed, the defaults otherwise.
    pub fn start() -> Relay {
        Relay::start_with(|c| c.allow_anonymous = true, None)
    }

    /// A relay configured by `configure` (applied to every start) and checking tokens with
    /// `verifier`.
    pub fn start_with(
        configure: impl Fn(&mut RelayConfig) + Send + Sync + 'static,
        verifier: Option<Arc<dyn Verify>>,
    ) -> Relay {
        let dir = tempfile::tempdir().unwrap();
        let db_path = dir.path().join("relay.db");
        let connection = rusqlite::Connection::open(&db_path).unwrap();
        // The relay's tables: the relay crate's one list of migrations.
        for schema in static_relay::schema::SQLITE {
            connection.execute_batch(schema).unwrap();
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(4)
            .thread_name("test-relay")
            .enable_all()
            .build()
            .unwrap();
        let mut relay = Relay {
            runtime: Some(runtime),
            server: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            db_path,
            configure: Arc::new(configure),
            verifier,
            _dir: dir,
        };
        relay.serve(0);
        relay
    }

    fn runtime(&self) -> &Runtime {
        self.runtime.as_ref().unwrap()
    }

    /// Starts serving on `port` (0: any), retrying for a while if the port is not free yet.
    fn serve(&mut self, port: u16) {
        let mut config = RelayConfig::new(self.db_path.as_path());
        config.port = port;
        config.graceful_timeout = Duration::from_secs(1);
        (self.configure)(&mut config);
        let verifier = self.verifier.clone();
        let deadline = Instant::now() + Duration::from_secs(10);
        let server = self.runtime().block_on(async move {
            loop {
                match RelayServer::start(config.clone(), verifier.clone()).await {
                    Ok(server) => return server,
                    Err(e) if Instant::now() < deadline => {
                        eprintln!("relay: cannot start yet ({e}); retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("the relay did not start on port {port}: {e}"),
                }
            }
        });
        self.addr = server.local_addr();
        self.server = Some(server);
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The endpoint clients are given.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful stop (live subscriptions end with UNAVAILABLE, connections close); the port
    /// is free afterwards.
    pub fn stop(&mut self) {
        let server = self.server.take().expect("the relay is not running");
        self.runtime().block_on(async {
            tokio::time::timeout(Duration::from_secs(15), server.shutdown())
                .await
                .expect("the relay did not shut down within 15 s");
        });
    }

    /// Serves again on the same port and database.
    pub fn restart(&mut self) {
        assert!(self.server.is_none(), "the relay is running");
        let port = self.addr.port();
        self.serve(port);
        assert_eq!(self.addr.port(), port);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            if let Some(server) = self.server.take() {
                runtime.block_on(async {
                    let _ = tokio::time::timeout(Duration::from_secs(5), server.shutdown()).await;
                });
            }
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// A local port nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

// --- clients ----------------------------------------------------------------------------------

/// Patient enough for a loaded 2-core machine, short enough for a test.
pub fn options() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(5),
        retry_timeout: Duration::from_secs(20),
        ca_file: None,
    }
}

/// A client on a temporary data directory; closed when dropped. Derefs to [`Client`].
pub struct Agent {
    client: Option<Client>,
    pub name: String,
    endpoint: String,
    tokens: Option<Arc<dyn TokenProvider>>,
    options: ClientOptions,
    dir: TempDir,
}

impl Agent {
    /// An anonymous client of `relay` with the test [`options`].
    pub fn new(relay: &Relay, name: &str) -> Agent {
        Agent::with(&relay.endpoint(), name, None, options())
    }

    pub fn with(
        endpoint: &str,
        name: &str,
        tokens: Option<Arc<dyn TokenProvider>>,
        options: ClientOptions,
    ) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let client = Client::open(
            endpoint,
            dir.path(),
            name.as_bytes(),
            tokens.clone(),
            None,
            options.clone(),
        )
        .unwrap_or_else(|e| panic!("{name}: Client::open failed: {e}"));
        Agent {
            client: Some(client),
            name: name.to_owned(),
            endpoint: endpoint.to_owned(),
            tokens,
            options,
            dir,
        }
    }

    /// Closes the client (its channels end); [`Agent::reopen`] opens it again.
    pub fn close(&mut self) {
        if let Some(client) = self.client.take() {
            client.close();
        }
    }

    /// (Closes and) opens the client again on the same data directory (a process restart).
    pub fn reopen(&mut self) {
        let endpoint = self.endpoint.clone();
        self.reopen_at(&endpoint);
    }

    /// [`Agent::reopen`], reaching the relay at `endpoint` from now on.
    pub fn reopen_at(&mut self, endpoint: &str) {
        self.endpoint = endpoint.to_owned();
        self.close();
        let client = Client::open(
            &self.endpoint,
            self.dir.path(),
            self.name.as_bytes(),
            self.tokens.clone(),
            None,
            self.options.clone(),
        )
        .unwrap_or_else(|e| panic!("{}: Client::open failed: {e}", self.name));
        self.client = Some(client);
    }
}

impl Deref for Agent {
    type Target = Client;

    fn deref(&self) -> &Client {
        self.client.as_ref().unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            client.close();
        }
    }
}

/// Adds `newcomer` to `member`'s channel and joins it from the Welcome.
#[track_caller]
pub fn invite(member: &Channel, newcomer: &Agent) -> Arc<Channel> {
    let key_package = newcomer.generate_key_package().unwrap();
    let welcome = member
        .add_member(key_package)
        .unwrap_or_else(|e| panic!("add_member of {} failed: {e}", newcomer.name));
    newcomer
        .join_channel(member.name(), &welcome)
        .unwrap_or_else(|e| panic!("{} cannot join {:?}: {e}", newcomer.name, member.name()))
}

/// The members' identities, sorted, as text.
pub fn member_names(channel: &Channel) -> Vec<String> {
    let mut names: Vec<String> = channel
        .members()
        .unwrap()
        .into_iter()
        .map(|m| String::from_utf8_lossy(&m.identity).into_owned())
        .collect();
    names.sort();
    names
}

// --- bounded waits ----------------------------------------------------------------------------

/// The next message of `channel`, waiting up to `timeout`; panics (naming the channel and its
/// progress) if none comes, the channel ends, or it fails.
#[track_caller]
pub fn receive(channel: &Channel, timeout: Duration) -> Vec<u8> {
    match channel.wait_next(timeout) {
        Ok(Next::Message(message)) => message.payload,
        Ok(Next::Empty) => panic!(
            "channel {:?}: no message within {timeout:?} (progress {:?})",
            channel.name(),
            channel.progress()
        ),
        Ok(Next::End) => panic!("channel {:?} ended while waiting", channel.name()),
        Err(e) => panic!("channel {:?} failed while waiting: {e}", channel.name()),
    }
}

/// The next `n` messages of `channel`, all within `timeout`.
#[track_caller]
pub fn receive_n(channel: &Channel, n: usize, timeout: Duration) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut messages = Vec::with_capacity(n);
    while messages.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match channel.wait_next(left) {
            Ok(Next::Message(message)) => messages.push(message.payload),
            Ok(Next::Empty) => panic!(
                "channel {:?}: {} of {n} messages within {timeout:?} (progress {:?})",
                channel.name(),
                messages.len(),
                channel.progress()
            ),
            Ok(Next::End) => panic!(
                "channel {:?} ended after {} of {n} messages",
                channel.name(),
                messages.len()
            ),
            Err(e) => panic!(
                "channel {:?} failed after {} of {n} messages: {e}",
                channel.name(),
                messages.len()
            ),
        }
    }
    messages
}

/// Nothing more arrives on `channel` within `quiet` (no duplicates, nothing stray).
#[track_caller]
pub fn assert_quiet(channel: &Channel, quiet: Duration) {
    match channel.wait_next(quiet) {
        Ok(Next::Empty) => {}
        Ok(Next::Message(message)) => panic!(
            "channel {:?}: unexpected message {:?}",
            channel.name(),
            String::from_utf8_lossy(&message.payload)
        ),
        Ok(Next::End) => panic!("channel {:?} ended", channel.name()),
        Err(e) => panic!("channel {:?} failed: {e}", channel.name()),
    }
}

/// Polls `condition` until it holds, panicking with `what` after `timeout`.
#[track_caller]
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ends the whole test process if it is not dropped within `limit`: the last resort against a
/// blocking client call that never returns (every test holds one).
pub struct Watchdog {
    done: Arc<(Mutex<bool>, Condvar)>,
}

pub fn watchdog(what: &str, limit: Duration) -> Watchdog {
    let done = Arc::new((Mutex::new(false), Condvar::new()));
    let watched = Arc::clone(&done);
    let what = what.to_owned();
    std::thread::spawn(move || {
        let (flag, signal) = &*watched;
        let guard = flag.lock().unwrap();
        let (guard, _) = signal
            .wait_timeout_while(guard, limit, |done| !*done)
            .unwrap();
        if !*guard {
            eprintln!("watchdog: {what} did not finish within {limit:?}; aborting the tests");
            std::process::exit(101);
        }
    });
    Watchdog { done }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        *self.done.0.lock().unwrap() = true;
        self.done.1.notify_all();
    }
}

/// Work on a thread of its own, joined with a deadline.
pub struct Background<T> {
    what: String,
    result: mpsc::Receiver<T>,
    handle: std::thread::JoinHandle<()>,
}

impl<T: Send + 'static> Background<T> {
    pub fn spawn(what: &str, job: impl FnOnce() -> T + Send + 'static) -> Background<T> {
        let (tx, result) = mpsc::channel();
        let handle = std::thread::spawn(move || {
            let _ = tx.send(job());
        });
        Background {
            what: what.to_owned(),
            result,
            handle,
        }
    }

    /// Its result; panics if it is not done within `timeout`, or re-raises its panic.
    #[track_caller]
    pub fn join(self, timeout: Duration) -> T {
        match self.result.recv_timeout(timeout) {
            Ok(value) => {
                let _ = self.handle.join();
                value
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{} did not finish within {timeout:?}", self.what)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => match self.handle.join() {
                Err(panic) => std::panic::resume_unwind(panic),
                Ok(()) => unreachable!("{} ended without a result", self.what),
            },
        }
    }
}

/// Work for [`run_parallel`].
pub type Job<T> = Box<dyn FnOnce() -> T + Send>;

/// Runs each of `jobs` on a thread of its own and returns their results in order, panicking if
/// they are not all done within `timeout` (or one panicked).
pub fn run_parallel<T: Send + 'static>(timeout: Duration, jobs: Vec<Job<T>>) -> Vec<T> {
    let deadline = Instant::now() + timeout;
    let running: Vec<Background<T>> = jobs
        .into_iter()
        .enumerate()
        .map(|(i, job)| Background::spawn(&format!("parallel job {i}"), job))
        .collect();
    running
        .into_iter()
        .map(|job| job.join(deadline.saturating_duration_since(Instant::now())))
        .collect()
}

// --- errors -----------------------------------------------------------------------------------

/// The error of `result`, asserting its Display starts with `prefix` (the kinds' prefixes:
/// [`TRANSPORT`], [`AUTH`], [`MLS`], [`INVALID_NAME`]); returns the text. Errors are only ever
/// checked through this, by their text, whatever their type.
#[track_caller]
pub fn expect_error<T, E: Display>(result: Result<T, E>, prefix: &str) -> String {
    match result {
        Ok(_) => panic!("expected an error starting with {prefix:?}, got Ok"),
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.starts_with(prefix),
                "expected an error starting with {prefix:?}, got {text:?}"
            );
            text
        }
    }
}

// --- tokens -----------------------------------------------------------------------------------

/// Issues tokens and verifies them (the relay's [`Verify`]): a token is valid while issued and
/// not revoked, for the account it was issued to.
#[derive(Default)]
pub struct Authority {
    valid: Mutex<HashMap<String, String>>,
    issued: AtomicUsize,
    pub refused: AtomicUsize,
}

impl Authority {
    pub fn new() -> Arc<Authority> {
        Arc::new(Authority::default())
    }

    /// A fresh valid token of `account`.
    pub fn issue(&self, account: &str) -> String {
        let n = self.issued.fetch_add(1, Ordering::SeqCst);
        let token = jwt(account, &format!("t{n}"));
        self.valid
            .lock()
            .unwrap()
            .insert(token.clone(), account.to_owned());
        token
    }

    /// Every token issued so far becomes invalid (as if expired).
    pub fn revoke_all(&self) {
        self.valid.lock().unwrap().clear();
    }

    /// The relay's verifier backed by this authority.
    pub fn verifier(self: &Arc<Self>) -> Arc<dyn Verify> {
        Arc::new(AuthorityVerify(Arc::clone(self)))
    }
}

/// A token shaped as a JWT whose `sub` is `account` (the SDK reads whom its token names, to
/// bind its leaves to that account); `tag` tells tokens apart. Not signed: the [`Authority`]
/// checks tokens as opaque strings it issued.
pub fn jwt(account: &str, tag: &str) -> String {
    use base64::Engine as _;
    let encode = |part: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(part);
    let claims = serde_json::json!({ "sub": account, "jti": tag }).to_string();
    format!(
        "{}.{}.{}",
        encode(r#"{"alg":"none"}"#),
        encode(&claims),
        encode(tag)
    )
}

struct AuthorityVerify(Arc<Authority>);

impl Verify for AuthorityVerify {
    fn verify(
        &self,
        token: String,
        _peer: String,
    ) -> Pin<Box<dyn Future<Output = Result<Principal, RelayError>> + Send>> {
        let account = self.0.valid.lock().unwrap().get(&token).cloned();
        if account.is_none() {
            self.0.refused.fetch_add(1, Ordering::SeqCst);
        }
        Box::pin(async move {
            match account {
                Some(account) => Ok(Principal {
                    key_id: format!("key-{account}"),
                    account_id: account,
                    expires_at: None,
                    channels: None,
                }),
                None => Err(RelayError::Unauthenticated(
                    "token expired or invalid".into(),
                )),
            }
        })
    }
}

/// What a [`Provider`]'s next fetch does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A fresh valid token.
    Valid,
    /// A token the authority never issued (expired, forged).
    Invalid,
    /// The token endpoint refuses the key (an auth error: final).
    Refused,
    /// The token endpoint is unreachable (any other error: to be retried).
    Unreachable,
}

/// A [`TokenProvider`] of one account following a script of [`Step`]s, then [`Step::Valid`].
pub struct Provider {
    authority: Arc<Authority>,
    account: String,
    script: Mutex<VecDeque<Step>>,
    pub fetches: AtomicUsize,
}

impl Provider {
    pub fn new(authority: &Arc<Authority>, account: &str, script: &[Step]) -> Arc<Provider> {
        Arc::new(Provider {
            authority: Arc::clone(authority),
            account: account.to_owned(),
            script: Mutex::new(script.iter().copied().collect()),
            fetches: AtomicUsize::new(0),
        })
    }

    pub fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

/// What [`TokenProvider::fetch`] returns.
type FetchResult = Result<Token, TokenError>;

impl TokenProvider for Provider {
    fn fetch(&self) -> FetchResult {
        self.fetches.fetch_add(1, Ordering::SeqCst);
        let step = self
            .script
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Step::Valid);
        let value = match step {
            Step::Valid => self.authority.issue(&self.account),
            Step::Invalid => jwt(&self.account, "forged"),
            Step::Refused => return Err(TokenError::Refused("the API key is revoked".into())),
            Step::Unreachable => {
                return Err(TokenError::Unavailable(
                    "the token endpoint is unreachable".into(),
                ))
            }
        };
        Ok(Token {
            value,
            expires_in: Duration::from_secs(3600),
        })
    }
}

/// A client of `relay` authenticating with `provider`.
pub fn authed_agent(relay: &Relay, name: &str, provider: &Arc<Provider>) -> Agent {
    let tokens: Arc<dyn TokenProvider> = Arc::clone(provider) as Arc<dyn TokenProvider>;
    Agent::with(&relay.endpoint(), name, Some(tokens), options())
}

// --- the process ------------------------------------------------------------------------------

/// A field of /proc/self/status (e.g. "Threads", "VmRSS"), as its text.
pub fn proc_status(field: &str) -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// The process's thread count.
pub fn thread_count() -> usize {
    proc_status("Threads").parse().unwrap_or(0)
}
