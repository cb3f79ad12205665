//! The engine's registration in etcd, on a thread of its own: it publishes the engine's record
//! under a lease that the adapter keeps alive, watches the other engines, and tells the
//! engine's thread which engine incarnations are lost (their registration is gone: withdrawn,
//! or lapsed because their host stopped renewing it). The engine's own registration lapsing
//! is fatal: peers have released what they held for it, so it must not go on as the same
//! incarnation.
//!
//! The thread runs a current-thread tokio runtime of its own, because etcd's client is async
//! and the engine's loop is not (as vLLM's is not); it is the only runtime in the process.

use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use kv_core::discovery::{Change, Discovery, EngineRecord};
use kv_core::EngineId;
use kv_discovery_etcd::{EtcdConfig, EtcdDiscovery};

use crate::proto::EtcdSettings;

/// What the registration thread tells the engine's.
pub(super) enum Found {
    /// Incarnation `instance` of `engine`, and every older one, is gone.
    Lost {
        /// The engine.
        engine: EngineId,
        /// Its incarnation.
        instance: u64,
    },
    /// The registration cannot go on (its lease lapsed, or the registry refused it).
    Fatal(String),
}

/// How long the engine waits for its first publication before it gives up starting.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(15);

/// The registration thread, seen from the engine's; dropping it withdraws the record.
pub(super) struct Registration {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Registration {
    /// Publishes `record` in the registry `settings` name and starts watching; returns once
    /// the record is published. What it finds goes to the returned receiver and unparks
    /// `engine`.
    pub(super) fn start(
        settings: &EtcdSettings,
        record: EngineRecord,
        engine: Thread,
    ) -> Result<(Registration, Receiver<Found>)> {
        let config = settings.config();
        let (found, rx) = mpsc::channel();
        let (started, up) = mpsc::channel::<Result<(), String>>();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let join = std::thread::Builder::new()
            .name("kvflow-discovery".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => return drop(started.send(Err(format!("a runtime for etcd's client: {e}")))),
                };
                runtime.block_on(serve(config, record, started, found, engine, stopped));
            })
            .context("the discovery thread")?;
        let registration = Registration { stop: Some(stop), join: Some(join) };
        match up.recv_timeout(PUBLISH_TIMEOUT) {
            Ok(Ok(())) => Ok((registration, rx)),
            Ok(Err(message)) => Err(anyhow!("publishing in etcd: {message}")),
            Err(_) => Err(anyhow!("publishing in etcd {:?}: no answer within {PUBLISH_TIMEOUT:?}", settings.endpoints)),
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
async fn serve(
    config: EtcdConfig,
    record: EngineRecord,
    started: Sender<Result<(), String>>,
    found: Sender<Found>,
    engine: Thread,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let me = record.engine.clone();
    let setup = async {
        let discovery = EtcdDiscovery::connect(config).await.map_err(|e| e.to_string())?;
        discovery.publish(&record).await.map_err(|e| e.to_string())?;
        let watch = discovery.watch().await.map_err(|e| e.to_string())?;
        Ok::<_, String>((discovery, watch))
    };
    let (discovery, mut watch) = match setup.await {
        Ok(ready) => {
            let _ = started.send(Ok(()));
            ready
        }
        Err(e) => return drop(started.send(Err(e))),
    };
    let tell = |what: Found| {
        let _ = found.send(what);
        engine.unpark();
    };
    // Well within the quarter of the TTL by which the adapter reports a lapse early: the engine
    // stops before etcd can expire its lease and peers release what they hold for it.
    let mut check = tokio::time::interval(Duration::from_millis(100));
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
                Err(kv_core::discovery::DiscoveryError::Closed) => {
                    return tell(Found::Fatal("the discovery watch ended".into()));
                }
                Err(e) => tracing::warn!(%e, "discovery watch"),
            },
        }
    }
}
