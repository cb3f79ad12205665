//! kvflow's [`Discovery`] port over etcd: an engine publishes its [`EngineRecord`] under an
//! etcd lease that it keeps alive, and peers watch the records come and go. A host that dies
//! without a word stops renewing, its lease lapses, and every watcher sees [`Change::Down`].
//!
//! ```no_run
//! use std::time::Duration;
//! use kv_core::discovery::{Change, Discovery, DiscoveryError, EngineRecord};
//! use kv_core::{EngineId, KvLayout, Role};
//! use kv_discovery_etcd::{EtcdConfig, EtcdDiscovery};
//!
//! # async fn engine() -> Result<(), Box<dyn std::error::Error>> {
//! let config = EtcdConfig {
//!     endpoints: vec!["http://10.0.0.9:2379".into()],
//!     ttl: Duration::from_secs(5),
//!     ..EtcdConfig::default()
//! };
//! // Inside the engine's tokio runtime: the registration and keep-alive run on it.
//! let discovery = EtcdDiscovery::connect(config).await?;
//! discovery
//!     .publish(&EngineRecord {
//!         engine: EngineId::new("decode0"),
//!         instance: 1,
//!         role: Role::Decode,
//!         addresses: vec!["10.0.0.2:5600".into()],
//!         layout: KvLayout::llama3_8b(16),
//!         tp_size: 1,
//!     })
//!     .await?;
//! let mut watch = discovery.watch().await?;
//! loop {
//!     if let Some(lapsed) = watch.registration_error() {
//!         // Peers were told this incarnation is gone: stop, or restart as a new incarnation.
//!         return Err(lapsed.into());
//!     }
//!     match watch.next().await {
//!         Ok(Change::Up(peer)) => { /* knock on peer.addresses (the side channel proves it) */ }
//!         Ok(Change::Down { engine, instance }) => { /* release what that incarnation held */ }
//!         Err(DiscoveryError::Closed) => break,
//!         Err(_unreachable) => { /* logged; the watch reconnects and catches up by itself */ }
//!     }
//! }
//! discovery.withdraw().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Keys and values
//!
//! Engine `E` lives at `{prefix}/engines/E` ([`EtcdConfig::prefix`], `/kvflow` by default),
//! and its value is its [`EngineRecord`] as JSON (serde_json), readable with `etcdctl get
//! --prefix /kvflow/engines/`. A value read back is used only if it is at most
//! [`MAX_VALUE_LEN`] bytes, decodes, passes [`EngineRecord::validate`], and names the engine
//! of its key; anything else is skipped with a `tracing` warning and counted
//! ([`EtcdDiscovery::bad_records`]), or, for [`Discovery::resolve`] of that engine, returned as
//! [`DiscoveryError::BadRecord`]. Records are hints: the side channel's handshake is what
//! proves a peer (see kv-core's `discovery` module).
//!
//! # Leases and keep-alive
//!
//! [`Discovery::publish`] grants a lease of [`EtcdConfig::ttl`], puts the record with it, and
//! renews it every TTL/3. Publishing again grants a new lease, puts the new record, and revokes
//! the old lease. [`Discovery::withdraw`] revokes the lease, which deletes the key at once.
//! The lease lapses if etcd answers a renewal with TTL 0 (it no longer knows the lease), or if
//! no renewal is answered by a quarter of the TTL before the lease's deadline (the send time of
//! the last answered renewal plus the TTL); then the handle's watches report
//! [`DiscoveryError::Lapsed`] from [`Watch::registration_error`], the error is logged, and
//! renewals stop: the engine must not go on as that incarnation. The quarter is a fence: an
//! engine that stops on `Lapsed` stops before etcd can expire its lease and peers can release
//! what they held for it, so it never trusts bytes a peer freed on that account. A successful
//! publish clears it.
//!
//! Dropping the [`EtcdDiscovery`] stops the renewals and revokes nothing, so the record stays
//! until its lease lapses, exactly as when the host dies; call [`Discovery::withdraw`] first to
//! leave at once.
//!
//! # Watches
//!
//! [`Discovery::watch`] lists every record at one revision R (each one is reported
//! [`Change::Up`] first), then watches the engines' keys from R + 1 with previous values: a put
//! is `Up`, a delete (a withdraw, or a lapsed lease) is `Down` with the incarnation of the value
//! deleted. When the stream breaks, `next` returns the error once, then reconnects by itself,
//! with a backoff of up to 2 s, and resumes from the last revision it took in; where etcd has
//! compacted that revision away (or the stream broke before it delivered anything), it lists
//! afresh and reports the difference: `Down` for engines that vanished meanwhile, `Up` for those
//! new or changed. `next` is cancel-safe, and a watch never ends by itself (it does not return
//! [`DiscoveryError::Closed`]); it lives on after its [`EtcdDiscovery`] is dropped.
//!
//! # Runtime
//!
//! Everything runs on the caller's tokio runtime: [`EtcdDiscovery::connect`] spawns the
//! handle's registration task with `tokio::spawn` (and each publish its keep-alive task), so
//! call it inside the runtime that will keep running them (a current-thread runtime is fine as
//! long as it is being driven). Called outside a tokio runtime, `connect` returns
//! [`ConnectError::NoRuntime`]. Nothing is set process-wide.
//!
//! # Bounds
//!
//! A listing holds at most [`MAX_RECORDS`] records and is refused, naming the count, when etcd
//! holds more keys under the prefix; it is read in pages of [`PAGE_LEN`] keys at one revision.
//! A value is at most [`MAX_VALUE_LEN`] bytes; a gRPC message from etcd at most
//! [`MAX_MESSAGE_LEN`] bytes. A watch remembers at most [`MAX_RECORDS`] engines. Every unary
//! request gives up after [`REQUEST_TIMEOUT`].
//!
//! [`Change::Down`]: kv_core::discovery::Change::Down
//! [`Change::Up`]: kv_core::discovery::Change::Up

mod config;
mod record;
mod registration;
mod watch;

use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, KvClient, WatchClient};
use kv_core::discovery::{Discovery, DiscoveryError, EngineRecord, Watch};
use kv_core::EngineId;
use tokio::sync::{mpsc, oneshot};

pub use config::{ConfigError, EtcdConfig, MAX_TTL, MIN_TTL};

use record::{decode, Keys};
use registration::Command;

/// The most records a listing holds (and a watch remembers): 4096 engines, far more than a
/// deployment runs, few enough that a listing stays small.
pub const MAX_RECORDS: usize = 4096;
/// The largest value read back as a record, 64 KiB; a real record is well under 1 KiB per TP
/// rank.
pub const MAX_VALUE_LEN: usize = 64 << 10;
/// The keys per page of a listing. With etcd's default request limit (1.5 MiB per value), a
/// page fits in [`MAX_MESSAGE_LEN`] even when every value is garbage of the largest size.
pub const PAGE_LEN: i64 = 16;
/// The largest gRPC message accepted from etcd (tonic's default is 4 MiB).
pub const MAX_MESSAGE_LEN: usize = 32 << 20;
/// How long a unary request (grant, put, get, revoke, status) or opening a stream may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings on open streams, so that a dead etcd host is noticed: every 10 s (etcd refuses
/// pings more frequent than 5 s by default), each answered within 5 s.
const PING_INTERVAL: Duration = Duration::from_secs(10);
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Why [`EtcdDiscovery::connect`] failed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum ConnectError {
    /// The configuration cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// etcd cannot be reached, or did not answer.
    #[error(transparent)]
    Registry(#[from] DiscoveryError),
    /// `connect` was not called inside a tokio runtime, which its tasks need.
    #[error("EtcdDiscovery::connect must run inside a tokio runtime, which keeps its registration alive")]
    NoRuntime,
}

/// The [`Discovery`] port over etcd. Its `publish` and `withdraw` calls are carried out one at
/// a time, in order, by its registration task. Not `Clone`: dropping it stops keeping its
/// record alive (see the crate docs); share it behind an `Arc` instead. Its watches live on
/// after it is dropped, and report the lapse of its registration.
pub struct EtcdDiscovery {
    kv: KvClient,
    watch: WatchClient,
    keys: Keys,
    config: EtcdConfig,
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery").field("config", &self.config).finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// Checks `config`, connects to etcd and asks it for its status (so a wrong endpoint fails
    /// here), and spawns the registration task on the current tokio runtime.
    pub async fn connect(config: EtcdConfig) -> Result<Self, ConnectError> {
        config.validate()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConnectError::NoRuntime);
        }
        let shared = Arc::new(Shared {
            endpoint: config.endpoints.join(","),
            registration: Mutex::new(Registration { generation: 0, error: None }),
            bad_records: AtomicU64::new(0),
        });
        let options =
            ConnectOptions::new().with_connect_timeout(REQUEST_TIMEOUT).with_keep_alive(PING_INTERVAL, PING_TIMEOUT);
        let mut client = shared.ask("connecting", Client::connect(&config.endpoints, Some(options))).await?;
        let status = shared.ask("asking for its status", client.status()).await?;
        tracing::debug!(endpoints = shared.endpoint, version = status.version(), "connected to etcd");
        let kv = client.kv_client().max_decoding_message_size(MAX_MESSAGE_LEN);
        let watch = client.watch_client().max_decoding_message_size(MAX_MESSAGE_LEN);
        let keys = Keys::new(&config.prefix);
        let commands = registration::spawn(client, keys.clone(), config.ttl_secs(), shared.clone());
        Ok(EtcdDiscovery { kv, watch, keys, config, commands, shared })
    }

    /// The configuration this handle was made with.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// How many values under the prefix this handle's reads and watches found that were not
    /// engine records (see the crate docs), since it was made.
    pub fn bad_records(&self) -> u64 {
        self.shared.bad_records.load(Ordering::Relaxed)
    }

    /// Hands a command to the registration task and waits for its outcome.
    async fn command(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<(), DiscoveryError>>) -> Command,
    ) -> Result<(), DiscoveryError> {
        let gone = || self.shared.registry("the registration task is gone (its runtime shut down)".into());
        let (reply, outcome) = oneshot::channel();
        self.commands.send(command(reply)).await.map_err(|_| gone())?;
        outcome.await.map_err(|_| gone())?
    }
}

#[async_trait::async_trait]
impl Discovery for EtcdDiscovery {
    async fn publish(&self, record: &EngineRecord) -> Result<(), DiscoveryError> {
        self.command(|reply| Command::Publish(record.clone(), reply)).await
    }

    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        self.command(Command::Withdraw).await
    }

    async fn resolve(&self, engine: &EngineId) -> Result<Option<EngineRecord>, DiscoveryError> {
        let key = self.keys.engine(engine);
        let found = self.shared.ask("reading an engine record", self.kv.clone().get(key, None)).await?;
        let Some(kv) = found.kvs().first() else { return Ok(None) };
        match decode(&self.keys, kv.key(), kv.value()) {
            Ok(record) => Ok(Some(record)),
            Err(why) => {
                self.shared.bad_record(&self.keys, kv.key(), &why);
                Err(DiscoveryError::BadRecord { engine: engine.to_string(), why })
            }
        }
    }

    async fn list(&self) -> Result<Vec<EngineRecord>, DiscoveryError> {
        Ok(read_all(&self.kv, &self.keys, &self.shared).await?.0.into_values().collect())
    }

    async fn watch(&self) -> Result<Box<dyn Watch>, DiscoveryError> {
        let watch =
            watch::EtcdWatch::start(self.kv.clone(), self.watch.clone(), self.keys.clone(), self.shared.clone())
                .await?;
        Ok(Box::new(watch))
    }
}

/// Every record under the engines' prefix at one revision, by key, and that revision. Read in
/// pages of [`PAGE_LEN`] keys; refused when etcd holds more than [`MAX_RECORDS`] keys there.
pub(crate) async fn read_all(
    kv: &KvClient,
    keys: &Keys,
    shared: &Shared,
) -> Result<(BTreeMap<Vec<u8>, EngineRecord>, i64), DiscoveryError> {
    let too_many =
        |count: i64| shared.registry(format!("{count} keys under {}, over the limit of {MAX_RECORDS}", keys.engines()));
    let end = keys.engines_end();
    let mut start = keys.engines().as_bytes().to_vec();
    // 0 asks for the newest revision; every later page is read at the first page's.
    let mut revision = 0;
    let mut seen = 0usize;
    let mut records = BTreeMap::new();
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE_LEN);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let page = shared.ask("listing engine records", kv.clone().get(start.clone(), Some(options))).await?;
        if revision == 0 {
            revision = match page.header() {
                Some(header) if header.revision() > 0 => header.revision(),
                _ => return Err(shared.registry("etcd answered a listing without its revision".into())),
            };
            if page.count() > MAX_RECORDS as i64 {
                return Err(too_many(page.count()));
            }
        }
        seen += page.kvs().len();
        if seen > MAX_RECORDS {
            return Err(too_many(seen as i64));
        }
        for kv in page.kvs() {
            match decode(keys, kv.key(), kv.value()) {
                Ok(record) => {
                    records.insert(kv.key().to_vec(), record);
                }
                Err(why) => shared.bad_record(keys, kv.key(), &why),
            }
        }
        match page.kvs().last() {
            Some(last) if page.more() => {
                start = last.key().to_vec();
                start.push(0);
            }
            _ => return Ok((records, revision)),
        }
    }
}

/// What a handle, its registration task, keep-alive tasks and watches share.
pub(crate) struct Shared {
    /// The endpoints, for errors.
    endpoint: String,
    registration: Mutex<Registration>,
    bad_records: AtomicU64,
}

/// The state of this handle's own registration, as its watches report it.
struct Registration {
    /// Bumped by every publish and withdraw, so that a keep-alive of a replaced lease cannot
    /// report a lapse of the registration that replaced it.
    generation: u64,
    error: Option<DiscoveryError>,
}

impl Shared {
    /// A registry error of these endpoints.
    fn registry(&self, why: String) -> DiscoveryError {
        DiscoveryError::Registry { endpoint: self.endpoint.clone(), why }
    }

    /// Awaits one request to etcd, for at most [`REQUEST_TIMEOUT`].
    async fn ask<T, E: Display>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, E>>,
    ) -> Result<T, DiscoveryError> {
        match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(err)) => Err(self.registry(format!("{what}: {err}"))),
            Err(_) => Err(self.registry(format!("{what}: no answer within {REQUEST_TIMEOUT:?}"))),
        }
    }

    /// The registration's state; a panic elsewhere cannot have left it half-written.
    fn registration(&self) -> std::sync::MutexGuard<'_, Registration> {
        self.registration.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a new registration (a publish or withdraw): clears its error, and returns its
    /// generation.
    fn new_registration(&self) -> u64 {
        let mut registration = self.registration();
        registration.generation += 1;
        registration.error = None;
        registration.generation
    }

    /// Records that registration `generation` failed, unless a newer one replaced it.
    fn registration_failed(&self, generation: u64, err: DiscoveryError) {
        let mut registration = self.registration();
        if registration.generation == generation {
            registration.error = Some(err);
        }
    }

    /// The current registration's error, if it failed.
    fn registration_error(&self) -> Option<DiscoveryError> {
        self.registration().error.clone()
    }

    /// Counts and logs a value under the prefix that is not an engine record.
    fn bad_record(&self, keys: &Keys, key: &[u8], why: &str) {
        self.bad_records.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(engine = %keys.engine_of(key), key = %String::from_utf8_lossy(key), why, "skipping a value that is not an engine record");
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use super::*;

    #[test]
    fn connecting_outside_a_tokio_runtime_is_an_error_not_a_panic() {
        let connect = pin!(EtcdDiscovery::connect(EtcdConfig::default()));
        match connect.poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Err(err)) => assert_eq!(err, ConnectError::NoRuntime),
            Poll::Ready(Ok(_)) => panic!("connected outside a runtime"),
            Poll::Pending => panic!("connect waited outside a runtime"),
        }
    }
}
