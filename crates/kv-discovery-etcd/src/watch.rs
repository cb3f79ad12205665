//! [`EtcdWatch`]: one watch's changes, from a listing at revision R and etcd's events after R,
//! across broken streams and compactions.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Event, KvClient, WatchClient, WatchOptions, WatchResponse, WatchStream};
use kv_core::discovery::{Change, DiscoveryError, EngineRecord, Watch};

use crate::record::{decode, Keys};
use crate::{read_all, Shared, MAX_RECORDS};

/// The first wait before reopening a watch that could not be opened; it doubles up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait between attempts to reopen a watch.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// One watch: what it reported, where it is in etcd's history, and its stream.
pub(crate) struct EtcdWatch {
    kv: KvClient,
    watch: WatchClient,
    keys: Keys,
    shared: Arc<Shared>,
    /// The records this watch reported [`Change::Up`] and not yet [`Change::Down`], by key: a
    /// resync reports `Down` for those that vanished meanwhile, and a DELETE whose previous
    /// value etcd left out (compacted) takes its incarnation from here. At most [`MAX_RECORDS`].
    reported: BTreeMap<Vec<u8>, EngineRecord>,
    /// Changes found and not yet handed out.
    queue: VecDeque<Change>,
    /// Every event up to this revision has been taken in.
    revision: i64,
    stream: Option<WatchStream>,
    /// Whether the open stream delivered events: one that breaks after it did is resumed from
    /// [`EtcdWatch::revision`]; one that breaks before, or that etcd cancelled because the
    /// revision was compacted, is replaced by a fresh listing (a resync).
    delivered: bool,
    resync: bool,
    /// Whether this outage's error was already returned from `next` (each outage reports once).
    reported_outage: bool,
    backoff: Duration,
}

impl EtcdWatch {
    /// Lists every record at revision R (each is reported `Up` first), then opens a watch of
    /// the engines' keys from R + 1.
    pub(crate) async fn start(
        kv: KvClient,
        watch: WatchClient,
        keys: Keys,
        shared: Arc<Shared>,
    ) -> Result<Self, DiscoveryError> {
        let (records, revision) = read_all(&kv, &keys, &shared).await?;
        let mut this = EtcdWatch {
            kv,
            watch,
            keys,
            shared,
            queue: records.values().cloned().map(Change::Up).collect(),
            reported: records,
            revision,
            stream: None,
            delivered: false,
            resync: false,
            reported_outage: false,
            backoff: FIRST_BACKOFF,
        };
        this.open().await?;
        Ok(this)
    }

    /// Opens the watch from the revision after the last one taken in, with previous values.
    async fn open(&mut self) -> Result<(), DiscoveryError> {
        let options = WatchOptions::new()
            .with_range(self.keys.engines_end())
            .with_start_revision(self.revision + 1)
            .with_prev_key();
        let opened = self.shared.ask("opening a watch", self.watch.watch(self.keys.engines(), Some(options))).await?;
        self.stream = Some(opened);
        self.delivered = false;
        Ok(())
    }

    /// Lists every record afresh, and queues what changed since this watch last reported: `Down`
    /// for records gone, `Up` for records new or different.
    async fn resync(&mut self) -> Result<(), DiscoveryError> {
        let (fresh, revision) = read_all(&self.kv, &self.keys, &self.shared).await?;
        for (key, old) in &self.reported {
            if !fresh.contains_key(key) {
                self.queue.push_back(Change::Down { engine: old.engine.clone(), instance: old.instance });
            }
        }
        for (key, record) in &fresh {
            if self.reported.get(key) != Some(record) {
                self.queue.push_back(Change::Up(record.clone()));
            }
        }
        tracing::info!(from = self.revision, to = revision, "discovery watch resynced with a fresh listing");
        self.reported = fresh;
        self.revision = revision;
        self.resync = false;
        Ok(())
    }

    /// Takes in one response of the stream.
    fn take(&mut self, response: WatchResponse) -> Result<(), DiscoveryError> {
        if response.canceled() {
            self.stream = None;
            if response.compact_revision() > 0 {
                tracing::info!(
                    wanted = self.revision + 1,
                    compacted = response.compact_revision(),
                    "etcd compacted past this watch's revision; resyncing"
                );
                self.resync = true;
                return Ok(());
            }
            self.resync = !self.delivered;
            return Err(self.shared.registry(format!("etcd cancelled the watch: {:?}", response.cancel_reason())));
        }
        if response.created() {
            self.reported_outage = false;
            self.backoff = FIRST_BACKOFF;
        }
        for event in response.events() {
            self.delivered = true;
            self.take_event(event);
        }
        Ok(())
    }

    /// Takes in one event: a put is `Up` (unless this watch reported that very record), a
    /// delete of a reported engine is `Down`, a value that is not a record is skipped, counted,
    /// and, where it replaced a reported record, `Down` for that one.
    fn take_event(&mut self, event: &Event) {
        let Some(kv) = event.kv() else { return };
        self.revision = self.revision.max(kv.mod_revision());
        let key = kv.key();
        // etcd marks a deletion by a key with no creation revision (that is how its own
        // watchable store tells the two apart); `Event::event_type` would panic on a type it
        // does not know, so the type field is not read.
        if kv.create_revision() == 0 {
            let Some(reported) = self.reported.remove(key) else { return };
            // The value deleted, which etcd sends when asked (`prev_kv`) unless it was compacted.
            let deleted = event.prev_kv().and_then(|prev| decode(&self.keys, key, prev.value()).ok());
            let instance = deleted.map_or(reported.instance, |record| record.instance);
            self.queue.push_back(Change::Down { engine: reported.engine, instance });
            return;
        }
        match decode(&self.keys, key, kv.value()) {
            Ok(record) => {
                if self.reported.get(key) == Some(&record) {
                    return;
                }
                if !self.reported.contains_key(key) && self.reported.len() >= MAX_RECORDS {
                    tracing::warn!(
                        engine = %record.engine,
                        "more than {MAX_RECORDS} engines under {}; this one is not reported",
                        self.keys.engines()
                    );
                    return;
                }
                self.reported.insert(key.to_vec(), record.clone());
                self.queue.push_back(Change::Up(record));
            }
            Err(why) => {
                self.shared.bad_record(&self.keys, key, &why);
                // What was there is gone just as surely as if it had been deleted.
                if let Some(old) = self.reported.remove(key) {
                    self.queue.push_back(Change::Down { engine: old.engine, instance: old.instance });
                }
            }
        }
    }

    /// Returns `err` if this outage has not reported one yet; else logs it and waits before
    /// the next attempt.
    async fn outage(&mut self, err: DiscoveryError) -> Result<(), DiscoveryError> {
        if !self.reported_outage {
            self.reported_outage = true;
            return Err(err);
        }
        tracing::debug!(%err, retry_in = ?self.backoff, "discovery watch still cannot reach etcd");
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        Ok(())
    }
}

#[async_trait::async_trait]
impl Watch for EtcdWatch {
    /// The next change. Cancel-safe: a call dropped while it waits loses nothing.
    async fn next(&mut self) -> Result<Change, DiscoveryError> {
        loop {
            if let Some(change) = self.queue.pop_front() {
                return Ok(change);
            }
            if self.resync {
                if let Err(err) = self.resync().await {
                    self.outage(err).await?;
                }
                continue;
            }
            let Some(stream) = self.stream.as_mut() else {
                if let Err(err) = self.open().await {
                    self.outage(err).await?;
                }
                continue;
            };
            let broken = match stream.message().await {
                Ok(Some(response)) => match self.take(response) {
                    Ok(()) => continue,
                    Err(err) => err,
                },
                Ok(None) => self.shared.registry("etcd ended the watch stream".into()),
                Err(err) => self.shared.registry(format!("the watch stream broke: {err}")),
            };
            if self.stream.take().is_some() {
                self.resync = !self.delivered;
            }
            tracing::warn!(err = %broken, revision = self.revision, resync = self.resync, "discovery watch broke; reconnecting");
            self.outage(broken).await?;
        }
    }

    fn registration_error(&self) -> Option<DiscoveryError> {
        self.shared.registration_error()
    }
}
