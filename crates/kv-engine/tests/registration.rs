//! The registration thread over a scripted registry: what it publishes, the losses it tells the
//! engine, its own lapse as fatal, the withdrawal when dropped, and a registry it cannot reach.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_core::discovery::{Change, Discovery, DiscoveryError, EngineRecord, Watch};
use kv_core::{EngineId, KvLayout, Role};
use kv_engine::{Found, Registration, RegistrationError};
use tokio::sync::mpsc;

/// A registry whose watch yields what the test sends, and which records what it was asked.
#[derive(Clone)]
struct Scripted {
    log: Arc<Mutex<Vec<String>>>,
    changes: Arc<Mutex<Option<mpsc::UnboundedReceiver<Change>>>>,
}

struct ScriptedWatch(mpsc::UnboundedReceiver<Change>);

#[async_trait::async_trait]
impl Watch for ScriptedWatch {
    async fn next(&mut self) -> Result<Change, DiscoveryError> {
        self.0.recv().await.ok_or(DiscoveryError::Closed)
    }
}

#[async_trait::async_trait]
impl Discovery for Scripted {
    async fn publish(&self, record: &EngineRecord) -> Result<(), DiscoveryError> {
        self.log.lock().unwrap().push(format!("publish {}#{}", record.engine, record.instance));
        Ok(())
    }
    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        self.log.lock().unwrap().push("withdraw".into());
        Ok(())
    }
    async fn resolve(&self, _: &EngineId) -> Result<Option<EngineRecord>, DiscoveryError> {
        Ok(None)
    }
    async fn list(&self) -> Result<Vec<EngineRecord>, DiscoveryError> {
        Ok(Vec::new())
    }
    async fn watch(&self) -> Result<Box<dyn Watch>, DiscoveryError> {
        let rx = self.changes.lock().unwrap().take().ok_or(DiscoveryError::Closed)?;
        Ok(Box::new(ScriptedWatch(rx)))
    }
}

fn record() -> EngineRecord {
    EngineRecord {
        engine: EngineId::new("decode0"),
        instance: 2,
        role: Role::Decode,
        addresses: vec!["127.0.0.1:5600".into()],
        layout: KvLayout::llama3_8b(16),
        tp_size: 1,
    }
}

/// Waits for what the registration thread tells the engine (it unparks this thread).
fn next(found: &std::sync::mpsc::Receiver<Found>) -> Found {
    found.recv_timeout(Duration::from_secs(5)).expect("the registration thread told nothing within 5 s")
}

#[test]
fn losses_reach_the_engine_its_own_removal_is_fatal_and_dropping_it_withdraws() {
    let (tx, rx) = mpsc::unbounded_channel();
    let registry = Scripted { log: Arc::default(), changes: Arc::new(Mutex::new(Some(rx))) };
    let handle = registry.clone();
    let connect = move || async move { Ok::<_, DiscoveryError>(handle) };
    let (registration, found) =
        Registration::start(connect, record(), std::thread::current(), Duration::from_secs(5)).expect("starts");
    assert_eq!(*registry.log.lock().unwrap(), ["publish decode0#2"]);

    tx.send(Change::Down { engine: EngineId::new("prefill0"), instance: 3 }).unwrap();
    assert_eq!(next(&found), Found::Lost { engine: EngineId::new("prefill0"), instance: 3 });
    // An older incarnation of this engine going is not this one's loss.
    tx.send(Change::Down { engine: EngineId::new("decode0"), instance: 1 }).unwrap();
    tx.send(Change::Down { engine: EngineId::new("decode0"), instance: 2 }).unwrap();
    assert_eq!(next(&found), Found::Fatal("the registration of decode0 incarnation 2 was removed".into()));
    drop(registration);
    // The thread ended on the fatal removal; a registration that is still serving withdraws.
    let (tx, rx) = mpsc::unbounded_channel();
    let registry = Scripted { log: Arc::default(), changes: Arc::new(Mutex::new(Some(rx))) };
    let handle = registry.clone();
    let connect = move || async move { Ok::<_, DiscoveryError>(handle) };
    let (registration, _found) =
        Registration::start(connect, record(), std::thread::current(), Duration::from_secs(5)).expect("starts");
    drop(registration);
    assert_eq!(*registry.log.lock().unwrap(), ["publish decode0#2", "withdraw"]);
    drop(tx);
}

#[test]
fn a_registry_that_cannot_be_reached_is_an_error_naming_the_engine() {
    let connect = || async { Err::<Scripted, _>("connection refused by 127.0.0.1:2379") };
    let err = Registration::start(connect, record(), std::thread::current(), Duration::from_secs(5))
        .err()
        .expect("no registry");
    assert!(matches!(err, RegistrationError::Connect { .. }), "{err}");
    assert_eq!(err.to_string(), "connecting to the registry to publish decode0: connection refused by 127.0.0.1:2379");
}
