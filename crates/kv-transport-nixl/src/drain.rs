//! Taking NIXL's notifications in: on the engine's thread at every poll, and on a thread of the
//! transport's own whenever the engine's falls behind.
//!
//! NIXL's progress thread appends each notification that arrives to a list of NIXL's, which
//! grows until someone fetches it, and only the fetch applies the bounds of [`crate::inbox`]. An
//! engine's thread fetches at every poll, but between two polls it may handle a notification
//! of a flood (decrypt, decode, stage 250 request ids, answer), and on a machine whose cores are
//! busy it waits for one meanwhile. Seen in `cargo xtask attack --only contended` (P's threads
//! confined to one core beside four busy threads, a key holder's heartbeat flood sent from the
//! other core) before this thread existed: fetches found up to 63 MB waiting, and each fetch
//! copies what it finds once more inside NIXL before the bounds see it; P grew by 191 to 307
//! MiB (heaptrack: 65 MB in NIXL's list, 37 MB in a fetch's copy at the peak).
//!
//! So a drainer thread fetches whenever nobody has for a while ([`DRAIN_IDLE_PERIOD`] at most,
//! [`DRAIN_BUSY_PERIOD`] while notifications pour in), and does nothing else: it opens only what
//! the bounds admit and drops the rest unread (a cut-off peer's without even copying it), so
//! that it takes a notification in for less CPU than NIXL spent receiving it. What it queues
//! wakes the engine. Fetches are serialised, so the engine sees each peer's notifications in
//! NIXL's order whoever fetched them. With it, the same flood grew P by 24 to 45 MiB (10 runs).
//!
//! What no fetch bounds: nixl-sys serialises every call on an agent behind one lock, so the
//! drainer also waits while the engine's thread is inside any NIXL call, and under a flood such
//! a call can wait long for UCX's worker lock, which NIXL's progress thread holds nearly
//! throughout while it takes the flood in (an invalidation up to 276 ms, a peer's metadata
//! loaded up to 356 ms). Hence a cut-off peer's agent is invalidated only once it is quiet
//! (`NixlTransport::invalidate_quiet`); a flooder that comes back as a new incarnation after
//! each cut-off still grows P past the bound (docs/security.md, the attack suite).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_core::{Notification, PeerEvent};
use kv_side_tcp::NotificationOpener;
use nixl_sys::{Agent, NotificationMap};

use crate::inbox::{Inbox, Sender};

/// How long the drainer sleeps at most: while notifications trickle or nothing comes, it
/// fetches only when nobody has for this long. An idle engine's thread fetches every 50 ms
/// (kv-engine's `IDLE_WAIT`), so an idle drainer mostly finds a fetch that recent and only
/// wakes: `cargo xtask bench --only idle`, alternated, gave 0.33 to 0.38 % of a core at 50 ms
/// against 0.33 to 0.37 % without a drainer, and 0.48 to 0.55 % at 25 ms.
pub const DRAIN_IDLE_PERIOD: Duration = Duration::from_millis(50);

/// How often the drainer fetches while notifications pour in (a fetch found at least
/// [`BUSY_NOTIFICATIONS`] or [`BUSY_BYTES`]).
pub const DRAIN_BUSY_PERIOD: Duration = Duration::from_micros(500);

/// A fetch that finds this many notifications, or this many bytes of them, means they pour in.
const BUSY_NOTIFICATIONS: usize = 32;
const BUSY_BYTES: usize = 64 << 10;

/// What the engine's thread and the drainer share: the agent, the inbox, and the waker.
pub(crate) struct Fetcher {
    agent: Agent,
    opener: NotificationOpener,
    /// Held across a whole fetch, so that fetches queue what they took in NIXL's order.
    fetching: Mutex<()>,
    inbox: Mutex<Inbox>,
    waker: Mutex<Option<Waker>>,
    epoch: Instant,
    /// When the last fetch began, in nanoseconds since `epoch`.
    last_fetch: AtomicU64,
    /// Whether the last fetch found notifications pouring in.
    busy: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Fetcher {
    pub fn new(agent: Agent, opener: NotificationOpener) -> Self {
        Fetcher {
            agent,
            opener,
            fetching: Mutex::new(()),
            inbox: Mutex::new(Inbox::default()),
            waker: Mutex::new(None),
            epoch: Instant::now(),
            last_fetch: AtomicU64::new(0),
            busy: AtomicBool::new(false),
        }
    }

    /// The inbox, locked.
    pub fn inbox(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inbox)
    }

    /// Wakes `waker` whenever a fetch queues something, and at once if something waits.
    pub fn set_waker(&self, waker: Waker) {
        if !self.inbox().is_empty() {
            waker.wake_by_ref();
        }
        *lock(&self.waker) = Some(waker);
    }

    fn since_last_fetch(&self) -> Duration {
        let last = Duration::from_nanos(self.last_fetch.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(last)
    }

    /// Queues every notification NIXL holds, behind what is queued already, within the bounds of
    /// [`crate::inbox`] (beyond them one is dropped unread). Each must carry the tag of its
    /// sender's side-channel session; one that does not (a sender without a handshake, a forged
    /// name, a replay) is reported refused, never delivered.
    pub fn fetch(&self) {
        let _one = lock(&self.fetching);
        self.last_fetch.store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let Ok(mut map) = NotificationMap::new() else { return };
        if let Err(e) = self.agent.get_notifications(&mut map, None) {
            tracing::debug!(error = %e, "cannot fetch notifications");
            return;
        }
        let (mut count, mut bytes) = (0, 0);
        let agents: Vec<String> = map.agents().filter_map(|a| a.ok().map(str::to_owned)).collect();
        for remote in agents {
            let n = map.get_notifications_size(&remote).unwrap_or(0);
            count += n;
            // Its own statement: a guard in a match's scrutinee lives through the arms.
            let sender = self.inbox().sender(&remote, Instant::now());
            let from = match sender {
                Sender::Peer(from) => from,
                Sender::CutOff => continue,
                Sender::Stranger => {
                    self.inbox().stranger(&remote, n);
                    continue;
                }
            };
            for i in 0..n {
                let Ok(sealed) = map.get_notification_bytes(&remote, i) else { continue };
                bytes += sealed.len();
                let mut inbox = self.inbox();
                if !inbox.admit(&from, sealed.len(), Instant::now()) {
                    if inbox.is_cut(&remote) {
                        // Cut off by this very drop: nothing more of it is taken in.
                        break;
                    }
                    continue;
                }
                drop(inbox);
                // Opened outside the inbox's lock: the engine's thread may take events meanwhile.
                let opened = self.opener.open(&from, &sealed);
                let mut inbox = self.inbox();
                match opened {
                    Ok(payload) => inbox.push_notification(Notification { from: from.clone(), payload }),
                    Err(e) => inbox.push(PeerEvent::Refused {
                        peer: Some(from.clone()),
                        cause: e.cause(),
                        reason: e.to_string(),
                    }),
                }
            }
        }
        self.busy.store(count >= BUSY_NOTIFICATIONS || bytes >= BUSY_BYTES, Ordering::Relaxed);
        if count > 0 {
            if let Some(waker) = &*lock(&self.waker) {
                waker.wake_by_ref();
            }
        }
    }
}

/// The drainer thread; dropping it stops and joins it.
pub(crate) struct Drainer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drainer {
    /// Starts the drainer of `fetcher`'s agent.
    pub fn start(fetcher: Arc<Fetcher>) -> std::io::Result<Drainer> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new().name("kvflow-drain".into()).spawn(move || {
            let mut period = DRAIN_IDLE_PERIOD;
            while !stopped.load(Ordering::Relaxed) {
                std::thread::park_timeout(period);
                if fetcher.since_last_fetch() >= period {
                    fetcher.fetch();
                }
                period = if fetcher.busy.load(Ordering::Relaxed) {
                    DRAIN_BUSY_PERIOD
                } else {
                    (period * 2).min(DRAIN_IDLE_PERIOD)
                };
            }
        })?;
        Ok(Drainer { stop, thread: Some(thread) })
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}
