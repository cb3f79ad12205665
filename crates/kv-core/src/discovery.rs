//! The discovery port: how engines find each other and learn that one is gone.
//!
//! An engine publishes an [`EngineRecord`] (who it is, its incarnation, where each TP rank's
//! side channel listens, its layout and TP size) for as long as it lives; peers and routers
//! [`resolve`](Discovery::resolve) records and [`watch`](Discovery::watch) for changes. A
//! record that disappears without being replaced by a newer incarnation ([`Change::Down`])
//! means the engine is lost: an adapter backed by a registry with leases (etcd) reports it when
//! the engine's lease lapses, so a host that dies without closing its sockets drops out.
//!
//! Records say who an engine is and where to knock, nothing more: NIXL's agent metadata is a
//! capability and stays on the authenticated side channel (DESIGN.md, Transport). A record is
//! therefore only a hint; the side channel's handshake is what proves a peer.
//!
//! Two adapters: [`StaticDiscovery`] here, a fixed list shared in process (the embedded
//! default, nothing to run; its engines are never lost by discovery), and etcd in the
//! `kv-discovery-etcd` crate.
//!
//! ```
//! use kv_core::discovery::{Change, Discovery, EngineRecord, StaticDiscovery};
//! use kv_core::{EngineId, KvLayout, Role};
//!
//! # fn block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     let mut f = std::pin::pin!(f);
//! #     let waker = std::task::Waker::noop();
//! #     loop {
//! #         if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut std::task::Context::from_waker(&waker)) {
//! #             return v;
//! #         }
//! #     }
//! # }
//! let record = EngineRecord {
//!     engine: EngineId::new("prefill0"),
//!     instance: 1,
//!     role: Role::Prefill,
//!     addresses: vec!["10.0.0.1:5600".into(), "10.0.0.1:5601".into()],
//!     layout: KvLayout::llama3_8b(16),
//!     tp_size: 2,
//! };
//! let discovery = StaticDiscovery::new(vec![record.clone()]);
//! block_on(async {
//!     assert_eq!(discovery.resolve(&EngineId::new("prefill0")).await?, Some(record.clone()));
//!     let mut watch = discovery.watch().await?;
//!     assert_eq!(watch.next().await?, Change::Up(record));
//!     Ok::<(), kv_core::discovery::DiscoveryError>(())
//! })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::{EngineId, KvLayout, Role};

/// What an engine publishes about itself.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct EngineRecord {
    /// The engine.
    pub engine: EngineId,
    /// Its incarnation: a restarted engine publishes a higher one.
    pub instance: u64,
    /// Prefill or decode.
    pub role: Role,
    /// Each TP rank's side-channel address (`host:port`), by rank.
    pub addresses: Vec<String>,
    /// Its KV layout, block size included.
    pub layout: KvLayout,
    /// Its TP size.
    pub tp_size: u32,
}

impl EngineRecord {
    /// Checks that the record is one an engine could have published: a non-empty name, one
    /// address per rank, and a layout that holds together.
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        let bad = |why: String| Err(DiscoveryError::BadRecord { engine: self.engine.to_string(), why });
        if self.engine.as_str().is_empty() {
            return bad("the engine id is empty".into());
        }
        if self.tp_size == 0 || self.addresses.len() != self.tp_size as usize {
            return bad(format!("{} side-channel addresses for TP size {}", self.addresses.len(), self.tp_size));
        }
        if let Some(a) = self.addresses.iter().find(|a| a.is_empty() || a.len() > MAX_ADDRESS_LEN) {
            return bad(format!("side-channel address {a:?} is empty or longer than {MAX_ADDRESS_LEN} bytes"));
        }
        self.layout
            .validate()
            .map_err(|e| DiscoveryError::BadRecord { engine: self.engine.to_string(), why: e.to_string() })
    }
}

/// The longest side-channel address a record may carry (`[v6]:port` fits with room).
pub const MAX_ADDRESS_LEN: usize = 256;

/// A change a watch reports.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Change {
    /// An engine was published, or republished (a new incarnation, new addresses). A watch
    /// first reports every record present when it began.
    Up(EngineRecord),
    /// An engine's record is gone (withdrawn, or its lease lapsed): incarnation `instance` of
    /// `engine` is lost.
    Down {
        /// The engine.
        engine: EngineId,
        /// The incarnation that is gone.
        instance: u64,
    },
}

/// Why discovery failed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The registry cannot be reached or answered with an error.
    #[error("discovery registry {endpoint}: {why}")]
    Registry {
        /// Where the registry is.
        endpoint: String,
        /// What went wrong.
        why: String,
    },
    /// A record does not hold together (or one found in the registry does not).
    #[error("engine record for {engine:?}: {why}")]
    BadRecord {
        /// The engine it names.
        engine: String,
        /// What is wrong, naming the values.
        why: String,
    },
    /// This engine's own registration lapsed: peers have been told it is lost, so it must not
    /// go on as the same incarnation.
    #[error("the registration of {engine} incarnation {instance} lapsed: peers treat it as lost")]
    Lapsed {
        /// This engine.
        engine: String,
        /// Its incarnation.
        instance: u64,
    },
    /// The watch ended (the adapter was shut down).
    #[error("the discovery watch ended")]
    Closed,
}

/// Finding engines and learning that one is gone. Methods wait on the network in adapters
/// that have one; none holds a lock across an await.
#[async_trait::async_trait]
pub trait Discovery: Send + Sync {
    /// Publishes this engine's record, and keeps it published (renewing whatever lease the
    /// registry has) until [`Discovery::withdraw`] or until the process dies. Publishing again
    /// replaces the record.
    async fn publish(&self, record: &EngineRecord) -> Result<(), DiscoveryError>;
    /// Withdraws what this handle published (a clean shutdown); watchers see [`Change::Down`].
    async fn withdraw(&self) -> Result<(), DiscoveryError>;
    /// The record of `engine` now, if there is one.
    async fn resolve(&self, engine: &EngineId) -> Result<Option<EngineRecord>, DiscoveryError>;
    /// Every record now, by engine.
    async fn list(&self) -> Result<Vec<EngineRecord>, DiscoveryError>;
    /// Starts watching: first every record present, as [`Change::Up`], then changes in order.
    async fn watch(&self) -> Result<Box<dyn Watch>, DiscoveryError>;
}

/// The changes of one watch, in order.
#[async_trait::async_trait]
pub trait Watch: Send {
    /// The next change; waits for one. An error that is not [`DiscoveryError::Closed`] may be
    /// followed by more changes (the adapter reconnects); after `Closed` there are none.
    async fn next(&mut self) -> Result<Change, DiscoveryError>;
    /// An error from keeping this engine's own record alive, if one happened: an engine that
    /// sees [`DiscoveryError::Lapsed`] here must stop as this incarnation.
    fn registration_error(&self) -> Option<DiscoveryError> {
        None
    }
}

/// A fixed list of engines, shared in process: the embedded default, with nothing to run.
/// Publishing adds or replaces a record in the list; nothing ever lapses, so its engines are
/// lost only by their side channels.
#[derive(Clone, Debug, Default)]
pub struct StaticDiscovery {
    shared: Arc<Mutex<StaticState>>,
    published: Arc<Mutex<Option<EngineId>>>,
}

#[derive(Debug, Default)]
struct StaticState {
    records: BTreeMap<EngineId, EngineRecord>,
}

impl StaticDiscovery {
    /// A list of `records`, which may be empty; clones share it.
    pub fn new(records: Vec<EngineRecord>) -> Self {
        let records = records.into_iter().map(|r| (r.engine.clone(), r)).collect();
        StaticDiscovery { shared: Arc::new(Mutex::new(StaticState { records })), published: Default::default() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, StaticState> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait::async_trait]
impl Discovery for StaticDiscovery {
    async fn publish(&self, record: &EngineRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        self.state().records.insert(record.engine.clone(), record.clone());
        *self.published.lock().unwrap_or_else(|e| e.into_inner()) = Some(record.engine.clone());
        Ok(())
    }

    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        if let Some(engine) = self.published.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.state().records.remove(&engine);
        }
        Ok(())
    }

    async fn resolve(&self, engine: &EngineId) -> Result<Option<EngineRecord>, DiscoveryError> {
        Ok(self.state().records.get(engine).cloned())
    }

    async fn list(&self) -> Result<Vec<EngineRecord>, DiscoveryError> {
        Ok(self.state().records.values().cloned().collect())
    }

    async fn watch(&self) -> Result<Box<dyn Watch>, DiscoveryError> {
        let initial = self.state().records.values().cloned().map(Change::Up).collect();
        Ok(Box::new(StaticWatch { initial }))
    }
}

/// A static list's watch: the records present when it began, then nothing, ever.
struct StaticWatch {
    initial: std::collections::VecDeque<Change>,
}

#[async_trait::async_trait]
impl Watch for StaticWatch {
    async fn next(&mut self) -> Result<Change, DiscoveryError> {
        match self.initial.pop_front() {
            Some(change) => Ok(change),
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// Polls `f` once: these futures never wait on anything but the list.
    fn now<F: Future>(f: F) -> Option<F::Output> {
        match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        }
    }

    fn record(name: &str, instance: u64, tp: u32) -> EngineRecord {
        EngineRecord {
            engine: EngineId::new(name),
            instance,
            role: Role::Decode,
            addresses: (0..tp).map(|r| format!("127.0.0.1:{}", 5600 + r)).collect(),
            layout: KvLayout::llama3_8b(16),
            tp_size: tp,
        }
    }

    #[test]
    fn a_static_list_resolves_publishes_withdraws_and_its_watch_starts_with_every_record() {
        let list = StaticDiscovery::new(vec![record("p", 1, 2)]);
        let d = list.clone();
        now(d.publish(&record("d", 3, 1))).unwrap().unwrap();
        assert_eq!(now(list.resolve(&EngineId::new("d"))).unwrap().unwrap(), Some(record("d", 3, 1)));
        assert_eq!(now(list.list()).unwrap().unwrap().len(), 2);
        let mut watch = now(list.watch()).unwrap().unwrap();
        assert_eq!(now(watch.next()).unwrap().unwrap(), Change::Up(record("d", 3, 1)));
        assert_eq!(now(watch.next()).unwrap().unwrap(), Change::Up(record("p", 1, 2)));
        assert!(now(watch.next()).is_none(), "a static list never changes");
        now(d.withdraw()).unwrap().unwrap();
        assert_eq!(now(list.resolve(&EngineId::new("d"))).unwrap().unwrap(), None);
        assert_eq!(now(list.resolve(&EngineId::new("p"))).unwrap().unwrap(), Some(record("p", 1, 2)));
    }

    #[test]
    fn a_record_that_does_not_hold_together_is_refused_naming_its_values() {
        let list = StaticDiscovery::default();
        let mut wrong = record("d", 1, 2);
        wrong.addresses.pop();
        let err = now(list.publish(&wrong)).unwrap().unwrap_err();
        assert_eq!(err.to_string(), "engine record for \"d\": 1 side-channel addresses for TP size 2");
        let mut empty = record("", 1, 1);
        empty.engine = EngineId::new("");
        assert!(now(list.publish(&empty)).unwrap().is_err());
        assert_eq!(now(list.list()).unwrap().unwrap(), vec![]);
    }
}
