//! A key holder floods P's rank with heartbeats naming distinct request ids, faster than the
//! rank takes them in (issue 29, item 4): what P holds for it stays bounded. The driver takes
//! at most `MAX_EVENTS_PER_STEP` notifications a step and sends their acknowledgements before it
//! takes more; the worker's tables keep their bounds (the early stage at its capacity).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_core::{
    AgentName, EngineId, KvLayout, Message, Notification, PeerAddress, PeerEvent, PeerInfo, PoolShape, PreparedId,
    PreparedTransfer, Region, RegionBase, RegionId, RequestId, Role, Time, TransferId, TransferRequest, TransferStatus,
    Transport, TransportError,
};
use kv_sched_adapter::driver::{WorkerDriver, MAX_EVENTS_PER_STEP};
use kv_sched_adapter::{Config, LocalPool, PrefillWorker};

/// Distinct ids in each heartbeat, and their length: about 60 KB a heartbeat, as in the attack.
const IDS_PER_BEAT: usize = 250;
const ID_BYTES: usize = 240;

/// What the flood saw of P.
#[derive(Default)]
struct Seen {
    /// Ids P took in, in heartbeats.
    taken: usize,
    /// Ids P acknowledged.
    acked: usize,
    /// The most ids P had taken in and not acknowledged when it sent anything.
    most_unanswered: usize,
}

/// A transport whose one peer, a handshaked D, has `beats` heartbeats queued, each naming ids
/// never named before.
struct Flood {
    me: AgentName,
    events: VecDeque<PeerEvent>,
    beats: usize,
    seen: Arc<Mutex<Seen>>,
}

impl Flood {
    fn new(me: AgentName, peer: PeerInfo, beats: usize, seen: Arc<Mutex<Seen>>) -> Self {
        Flood { me, events: VecDeque::from([PeerEvent::Connected(Box::new(peer))]), beats, seen }
    }

    fn intruder() -> AgentName {
        AgentName::new(EngineId::new("intruder"), 0)
    }
}

impl Transport for Flood {
    fn agent(&self) -> &AgentName {
        &self.me
    }
    fn register(&mut self, _: &Region) -> Result<(), TransportError> {
        Ok(())
    }
    fn deregister(&mut self, _: RegionId) -> Result<(), TransportError> {
        Ok(())
    }
    fn connect(&mut self, _: &PeerAddress) -> Result<(), TransportError> {
        Ok(())
    }
    fn post(&mut self, _: TransferRequest) -> Result<TransferId, TransportError> {
        Err(TransportError::InvalidTransfer("P posts nothing here".into()))
    }
    fn prepare(&mut self, _: Option<&AgentName>, _: &[(u64, u64)]) -> Result<PreparedId, TransportError> {
        Err(TransportError::InvalidTransfer("P prepares nothing here".into()))
    }
    fn post_prepared(&mut self, _: PreparedTransfer) -> Result<TransferId, TransportError> {
        Err(TransportError::InvalidTransfer("P posts nothing here".into()))
    }
    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        TransferStatus::Failed(TransportError::UnknownTransfer(id))
    }
    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError> {
        assert_eq!(*peer, Flood::intruder());
        let Ok(Message::HeartbeatAck { renewals }) = Message::decode(payload) else { panic!("not an acknowledgement") };
        let mut seen = self.seen.lock().unwrap();
        seen.most_unanswered = seen.most_unanswered.max(seen.taken - seen.acked);
        seen.acked += renewals.len();
        Ok(())
    }
    fn poll_event(&mut self) -> Option<PeerEvent> {
        if let Some(event) = self.events.pop_front() {
            return Some(event);
        }
        if self.beats == 0 {
            return None;
        }
        self.beats -= 1;
        let mut seen = self.seen.lock().unwrap();
        let requests: Vec<RequestId> =
            (seen.taken..seen.taken + IDS_PER_BEAT).map(|n| RequestId::new(format!("{n:0>ID_BYTES$}"))).collect();
        seen.taken += IDS_PER_BEAT;
        let payload = Message::Heartbeat { requests }.encode().expect("under the size limit");
        Some(PeerEvent::Notification(Notification { from: Flood::intruder(), payload }))
    }
    fn disconnect(&mut self, _: &AgentName) {}
}

#[test]
fn a_heartbeat_flood_of_distinct_ids_is_answered_as_it_comes_and_leaves_p_bounded() {
    let layout = KvLayout::split_kv(2, 16, 4, 8, kv_core::Dtype::Bfloat16);
    let shape = PoolShape::new(layout, layout.kv_heads, 8).unwrap();
    let pool = LocalPool { shape, regions: vec![RegionBase { addr: 0x10_0000, len: shape.pool_bytes() }] };
    let p = AgentName::new(EngineId::new("prefill0"), 0);
    let config = Config::default();
    let worker = PrefillWorker::new(pool.offer(&p, 1, 1, Role::Prefill, "m"), config, pool.clone()).unwrap();
    let handshake = pool.offer(&Flood::intruder(), 1, 1, Role::Decode, "m");
    let peer =
        PeerInfo { agent: Flood::intruder(), handshake, sent_at: Time::ZERO, received_at: Time::ZERO, dialed: None };
    let beats = 1000;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut driver = WorkerDriver::new(worker, Box::new(Flood::new(p, peer, beats, seen.clone())));
    let mut now = Time::ZERO;
    let mut steps = 0;
    loop {
        driver.step(now);
        steps += 1;
        let book = driver.machine_ref().book();
        assert!(book.staged <= config.early_notification_capacity, "{book:?}");
        assert_eq!((book.exports, book.recent, book.pulled), (0, 0, 0), "{book:?}");
        if !driver.backlogged() {
            break;
        }
        // An engine steps again at once: the flood is not a reason to wait.
        assert_eq!(driver.wait_time(now), Some(Duration::ZERO));
        assert_eq!(driver.poll_timeout(), Some(now));
        now = now + Duration::from_millis(1);
    }
    // Every id was answered (not known yet: staged), and never more than one step's worth of
    // heartbeats waited in P for their acknowledgement. Before the bound, the first
    // acknowledgement went once the whole flood was taken in: 250 000 ids, 60 MB of them.
    let seen = seen.lock().unwrap();
    let most = seen.most_unanswered;
    assert!(most <= MAX_EVENTS_PER_STEP * IDS_PER_BEAT, "{most} ids waited in P for their acknowledgement");
    assert_eq!((seen.taken, seen.acked), (beats * IDS_PER_BEAT, beats * IDS_PER_BEAT), "every id was answered");
    // At most MAX_EVENTS_PER_STEP notifications (and the handshake) a step.
    assert!(steps > beats / MAX_EVENTS_PER_STEP, "{steps} steps");
    let counted = driver.machine_ref().counters();
    assert_eq!(counted.early_staged, (beats * IDS_PER_BEAT) as u64);
    assert_eq!(counted.early_evicted, (beats * IDS_PER_BEAT - config.early_notification_capacity) as u64);
}
