//! The engine's registration with a [`Discovery`] registry, on a thread of its own: it
//! publishes the engine's record (the adapter keeps it alive), watches the other engines, and
//! tells the engine's thread which engine incarnations are lost (their registration is gone:
//! withdrawn, or lapsed because their host stopped renewing it). The engine's own registration
//! lapsing is fatal: peers have released what they held for it, so it must not go on as the
//! same incarnation.
//!
//! The thread runs a current-thread tokio runtime of its own, because the registry's adapters
//! are async (etcd's client) and an engine's loop is not (as vLLM's is not).

use std::future::Future;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use kv_core::discovery::{Change, Discovery, DiscoveryError, EngineRecord};
use kv_core::EngineId;

/// What the registration thread tells the engine's.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Found {
    /// Incarnation `instance` of `engine`, and every older one, is gone: hand it to every
    /// rank ([`crate::RankThread::engine_lost`]).
    Lost {
        /// The engine.
        engine: EngineId,
        /// Its incarnation.
        instance: u64,
    },
    /// The registration cannot go on (its own record lapsed or was removed, or the registry's
    /// watch ended): the engine must stop as this incarnation.
    Fatal(String),
}

/// Why a registration did not start.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The thread or its runtime could not be made.
    #[error("the discovery thread: {0}")]
    Thread(String),
    /// Connecting to the registry failed.
    #[error("connecting to the registry to publish {engine}: {error}")]
    Connect {
        /// This engine.
        engine: EngineId,
        /// What the adapter said.
        error: String,
    },
    /// Publishing or watching failed.
    #[error("publishing {engine} in the registry: {error}")]
    Publish {
        /// This engine.
        engine: EngineId,
        /// What the registry said.
        error: DiscoveryError,
    },
    /// No answer in time.
    #[error("publishing {engine} in the registry: no answer within {timeout:?}")]
    Timeout {
        /// This engine.
        engine: EngineId,
        /// How long it waited.
        timeout: Duration,
    },
}

/// How often the thread asks the watch whether this engine's own record still stands: well
/// within the quarter of a TTL by which an adapter reports a lapse early, so that the engine
/// stops before the registry expires its record and peers release what they hold for it.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// The registration thread, seen from the engine's; dropping it withdraws the record.
pub struct Registration {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Registration {
    /// Connects to the registry (`connect`, run on the registration's own runtime), publishes
    /// `record` and starts watching; returns once the record is published, or fails after
    /// `timeout`. What it finds goes to the returned receiver and unparks `engine`.
    pub fn start<D, E, F, Fut>(
        connect: F,
        record: EngineRecord,
        engine: Thread,
        timeout: Duration,
    ) -> Result<(Registration, Receiver<Found>), RegistrationError>
    where
        D: Discovery + 'static,
        E: std::fmt::Display,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<D, E>>,
    {
        let me = record.engine.clone();
        let (found, rx) = mpsc::channel();
        let (started, up) = mpsc::channel::<Result<(), RegistrationError>>();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let join = std::thread::Builder::new()
            .name("kvflow-discovery".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => return drop(started.send(Err(RegistrationError::Thread(e.to_string())))),
                };
                runtime.block_on(serve(connect, record, started, found, engine, stopped));
            })
            .map_err(|e| RegistrationError::Thread(e.to_string()))?;
        let registration = Registration { stop: Some(stop), join: Some(join) };
        match up.recv_timeout(timeout) {
            Ok(Ok(())) => Ok((registration, rx)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RegistrationError::Timeout { engine: me, timeout }),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

/// Publishes, then watches until told to stop (withdrawing) or the registration fails.
async fn serve<D, E, F, Fut>(
    connect: F,
    record: EngineRecord,
    started: Sender<Result<(), RegistrationError>>,
    found: Sender<Found>,
    engine: Thread,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) where
    D: Discovery,
    E: std::fmt::Display,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<D, E>>,
{
    let me = record.engine.clone();
    let discovery = match connect().await {
        Ok(discovery) => discovery,
        Err(e) => return drop(started.send(Err(RegistrationError::Connect { engine: me, error: e.to_string() }))),
    };
    let setup = async {
        discovery.publish(&record).await?;
        let watch = discovery.watch().await?;
        Ok::<_, DiscoveryError>(watch)
    };
    let mut watch = match setup.await {
        Ok(ready) => {
            let _ = started.send(Ok(()));
            ready
        }
        Err(error) => return drop(started.send(Err(RegistrationError::Publish { engine: me, error }))),
    };
    let tell = |what: Found| {
        let _ = found.send(what);
        engine.unpark();
    };
    let mut check = tokio::time::interval(CHECK_EVERY);
    loop {
        tokio::select! {
            _ = &mut stop => {
                if let Err(e) = discovery.withdraw().await {
                    tracing::warn!(%e, "could not withdraw the registration");
                }
                return;
            }
            _ = check.tick() => {
                if let Some(e) = watch.registration_error() {
                    return tell(Found::Fatal(e.to_string()));
                }
            }
            change = watch.next() => match change {
                Ok(Change::Down { engine, instance }) if engine == me => {
                    if instance == record.instance {
                        return tell(Found::Fatal(format!("the registration of {me} incarnation {instance} was removed")));
                    }
                }
                Ok(Change::Down { engine, instance }) => {
                    tracing::info!(lost = %engine, instance, "registration gone");
                    tell(Found::Lost { engine, instance });
                }
                Ok(_) => {}
                Err(DiscoveryError::Closed) => return tell(Found::Fatal("the discovery watch ended".into())),
                Err(e) => tracing::warn!(%e, "discovery watch"),
            },
        }
    }
}
