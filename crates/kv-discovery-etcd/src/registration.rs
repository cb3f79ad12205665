//! This engine's own record: the task that publishes and withdraws it one command at a time,
//! and the keep-alive task of each lease.
//!
//! One registrar task per [`EtcdDiscovery`](crate::EtcdDiscovery) takes `publish` and
//! `withdraw` in order, so two calls on one handle never interleave their grants, puts and
//! revokes, and a call whose caller stopped waiting still completes. Each published lease has a
//! keep-alive task of its own, so a slow publish never delays the current lease's renewals.
//! When every handle is gone the registrar stops the keep-alive and revokes nothing: the record
//! stays until its lease lapses, as a dead host's would.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use kv_core::discovery::{DiscoveryError, EngineRecord};
use kv_core::EngineId;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout_at, Instant};

use crate::record::{encode, Keys};
use crate::{Shared, MAX_VALUE_LEN, REQUEST_TIMEOUT};

/// What the registrar is asked to do, with where to send the outcome.
pub(crate) enum Command {
    /// Publish this record, replacing what was published.
    Publish(EngineRecord, oneshot::Sender<Result<(), DiscoveryError>>),
    /// Withdraw what was published.
    Withdraw(oneshot::Sender<Result<(), DiscoveryError>>),
}

/// Starts the registrar on the current runtime; it ends when every sender is dropped.
pub(crate) fn spawn(client: Client, keys: Keys, ttl_secs: i64, shared: Arc<Shared>) -> mpsc::Sender<Command> {
    let (commands, inbox) = mpsc::channel(8);
    let registrar = Registrar { client, keys, ttl_secs, shared, current: None };
    tokio::spawn(registrar.run(inbox));
    commands
}

/// The registrar's state: the one publication of its handle.
struct Registrar {
    client: Client,
    keys: Keys,
    ttl_secs: i64,
    shared: Arc<Shared>,
    current: Option<Publication>,
}

/// A published record: its lease, kept alive by `keeper`.
struct Publication {
    engine: EngineId,
    instance: u64,
    lease: i64,
    keeper: JoinHandle<()>,
}

impl Drop for Publication {
    /// Stops the keep-alive (and revokes nothing: that is the registrar's decision).
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

impl Registrar {
    /// Carries out commands in order until every handle is gone.
    async fn run(mut self, mut inbox: mpsc::Receiver<Command>) {
        while let Some(command) = inbox.recv().await {
            match command {
                Command::Publish(record, reply) => {
                    let _ = reply.send(self.publish(record).await);
                }
                Command::Withdraw(reply) => {
                    let _ = reply.send(self.withdraw().await);
                }
            }
        }
        if let Some(publication) = self.current.take() {
            tracing::info!(
                engine = %publication.engine,
                instance = publication.instance,
                lease = publication.lease,
                "discovery handle dropped: no longer keeping the registration alive; it lapses with its lease"
            );
        }
    }

    /// Grants a lease, puts the record under it, starts its keep-alive, then revokes the lease
    /// of what was published before (whose key, if it is the same engine's, is now this lease's).
    async fn publish(&mut self, record: EngineRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        let value = encode(&record);
        if value.len() > MAX_VALUE_LEN {
            return Err(DiscoveryError::BadRecord {
                engine: record.engine.to_string(),
                why: format!("encodes to {} bytes, over the limit of {MAX_VALUE_LEN}", value.len()),
            });
        }
        let requested_at = Instant::now();
        let grant = self.shared.ask("granting a lease", self.client.lease_grant(self.ttl_secs, None)).await?;
        let lease = grant.id();
        if grant.ttl() != self.ttl_secs {
            tracing::warn!(
                requested_s = self.ttl_secs,
                granted_s = grant.ttl(),
                "etcd granted a different lease TTL than configured (it raises TTLs below its minimum)"
            );
        }
        let ttl = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(1).max(1));
        let key = self.keys.engine(&record.engine);
        let put = self.client.put(key.clone(), value, Some(PutOptions::new().with_lease(lease)));
        if let Err(err) = self.shared.ask("putting the engine record", put).await {
            self.revoke(lease, &record.engine, "a lease whose put failed").await;
            return Err(err);
        }
        let generation = self.shared.new_registration();
        let keeper = tokio::spawn(keep_alive(KeepAlive {
            client: self.client.clone(),
            lease,
            ttl,
            granted_at: requested_at,
            engine: record.engine.clone(),
            instance: record.instance,
            generation,
            shared: self.shared.clone(),
        }));
        tracing::info!(engine = %record.engine, instance = record.instance, lease, key, ttl_s = ttl.as_secs(), "published");
        let fresh = Publication { engine: record.engine, instance: record.instance, lease, keeper };
        if let Some(old) = self.current.replace(fresh) {
            let (old_lease, old_engine) = (old.lease, old.engine.clone());
            drop(old);
            self.revoke(old_lease, &old_engine, "the lease of the record this publish replaced").await;
        }
        Ok(())
    }

    /// Revokes the current lease, which deletes its key at once.
    async fn withdraw(&mut self) -> Result<(), DiscoveryError> {
        let Some(publication) = self.current.take() else { return Ok(()) };
        self.shared.new_registration();
        let (lease, engine, instance) = (publication.lease, publication.engine.clone(), publication.instance);
        drop(publication);
        match self.shared.ask("revoking the lease", self.client.lease_revoke(lease)).await {
            Ok(_) => {
                tracing::info!(engine = %engine, instance, lease, "withdrawn");
                Ok(())
            }
            Err(err) if is_lease_not_found(&err) => {
                tracing::info!(engine = %engine, instance, lease, "withdrawn (its lease had already lapsed)");
                Ok(())
            }
            Err(err) => Err(DiscoveryError::Registry {
                endpoint: self.shared.endpoint.clone(),
                why: format!("{err}; no longer kept alive, the record lapses within its TTL"),
            }),
        }
    }

    /// Revokes `lease` where failing to is harmless: nothing keeps it alive, so it lapses.
    async fn revoke(&mut self, lease: i64, engine: &EngineId, what: &str) {
        if let Err(err) = self.shared.ask("revoking a lease", self.client.lease_revoke(lease)).await {
            if !is_lease_not_found(&err) {
                tracing::warn!(engine = %engine, lease, %err, "cannot revoke {what}; it lapses within its TTL");
            }
        }
    }
}

/// Whether etcd said it does not know the lease (it lapsed, or was revoked).
fn is_lease_not_found(err: &DiscoveryError) -> bool {
    matches!(err, DiscoveryError::Registry { why, .. } if why.contains("requested lease not found"))
}

/// What one lease's keep-alive task needs.
struct KeepAlive {
    client: Client,
    lease: i64,
    ttl: Duration,
    /// When the grant was asked for: the lease runs at most `ttl` from then.
    granted_at: Instant,
    engine: EngineId,
    instance: u64,
    generation: u64,
    shared: Arc<Shared>,
}

/// Renews the lease every TTL/3 until it is aborted, or until the lease lapses: etcd answers a
/// renewal with TTL 0, or no renewal is answered before the lease's deadline, less a quarter of
/// the TTL. A lapse is recorded as [`DiscoveryError::Lapsed`] for this handle's watches, and
/// logged.
///
/// The quarter is a fence: an engine that stops when its watch reports `Lapsed` (as it must)
/// stops before etcd can expire the lease and its peers can act on that, releasing what they
/// held for it, so it never trusts a transfer from blocks a peer has already freed.
async fn keep_alive(mut k: KeepAlive) {
    let interval = k.ttl / 3;
    // The latest moment the lease is sure to run until: the send time of the last answered
    // renewal (or of the grant) plus the TTL. etcd may hold it a little longer, never shorter.
    let mut deadline = k.granted_at + k.ttl;
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    // The renewal in flight: when it was sent.
    let mut in_flight: Option<Instant> = None;
    let mut next = k.granted_at + interval;
    loop {
        enum Wake {
            Deadline,
            Tick,
            Answer(Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error>),
        }
        let wake = tokio::select! {
            _ = sleep_until(deadline.checked_sub(k.ttl / 4).unwrap_or(deadline)) => Wake::Deadline,
            _ = sleep_until(next) => Wake::Tick,
            answer = async {
                match stream.as_mut() {
                    Some((_, answers)) => answers.message().await,
                    None => std::future::pending().await,
                }
            } => Wake::Answer(answer),
        };
        match wake {
            Wake::Deadline => {
                lapse(&k, "no keep-alive was answered in time: the lease may lapse within a quarter of its TTL");
                // Best effort, so that peers learn it now rather than when etcd expires it.
                let _ = tokio::time::timeout(REQUEST_TIMEOUT, k.client.lease_revoke(k.lease)).await;
                return;
            }
            Wake::Tick => {
                next = Instant::now() + interval;
                if in_flight.is_some() {
                    // The last renewal went unanswered for a whole interval: start a fresh stream.
                    tracing::warn!(engine = %k.engine, lease = k.lease, "keep-alive unanswered; reopening its stream");
                    stream = None;
                    in_flight = None;
                }
                match stream.as_mut() {
                    Some((keeper, _)) => {
                        let sent = Instant::now();
                        if keeper.keep_alive().await.is_ok() {
                            in_flight = Some(sent);
                        } else {
                            stream = None;
                            next = Instant::now();
                        }
                    }
                    None => {
                        // Opening the stream renews the lease once and waits for etcd's answer.
                        let sent = Instant::now();
                        match timeout_at(deadline.min(sent + REQUEST_TIMEOUT), k.client.lease_keep_alive(k.lease)).await
                        {
                            Ok(Ok(opened)) => {
                                deadline = deadline.max(sent + k.ttl);
                                stream = Some(opened);
                            }
                            Ok(Err(etcd_client::Error::LeaseKeepAliveError(why))) => {
                                lapse(&k, &format!("etcd no longer knows the lease ({why})"));
                                return;
                            }
                            Ok(Err(err)) => {
                                tracing::warn!(engine = %k.engine, lease = k.lease, %err, "cannot open the keep-alive stream; retrying");
                            }
                            Err(_) => {
                                tracing::warn!(engine = %k.engine, lease = k.lease, "the keep-alive stream did not open in time; retrying");
                            }
                        }
                    }
                }
            }
            Wake::Answer(Ok(Some(answer))) if answer.ttl() > 0 => {
                if let Some(sent) = in_flight.take() {
                    let ttl = Duration::from_secs(u64::try_from(answer.ttl()).unwrap_or(0));
                    deadline = deadline.max(sent + ttl);
                }
            }
            Wake::Answer(Ok(Some(_))) => {
                lapse(&k, "etcd answered a keep-alive with TTL 0: the lease is gone");
                return;
            }
            Wake::Answer(end) => {
                let why = match end {
                    Err(err) => err.to_string(),
                    Ok(_) => "etcd closed it".to_owned(),
                };
                tracing::warn!(engine = %k.engine, lease = k.lease, why, "keep-alive stream broke; reopening");
                stream = None;
                in_flight = None;
                next = Instant::now();
            }
        }
    }
}

/// Records and logs that the lease lapsed.
fn lapse(k: &KeepAlive, why: &str) {
    tracing::error!(
        engine = %k.engine,
        instance = k.instance,
        lease = k.lease,
        why,
        "the engine's discovery registration lapsed: peers treat this incarnation as lost"
    );
    k.shared.registration_failed(
        k.generation,
        DiscoveryError::Lapsed { engine: k.engine.to_string(), instance: k.instance },
    );
}
