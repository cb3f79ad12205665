//! The fake network's behaviour as an engine sees it through the `Transport` port: bytes move,
//! and every fault really happens, deterministically from the seed.

use std::time::Duration;

use kv_core::{
    AgentName, DescriptorPair, EngineId, KvLayout, Memory, MemoryKind, Notification, PeerAddress, PeerEvent,
    PreparedTransfer, RefusalCause, Region, Role, Time, TransferId, TransferOp, TransferRequest, TransferStatus,
    Transport, TransportError,
};
use kv_testkit::{offer, FakeHeap, FakeNetwork, FakeTransport, InMemoryMemory, ManualClock, NetConfig, NetStats};

const POOL_BYTES: u64 = 64 * 1024;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn layout(block_tokens: u32) -> KvLayout {
    KvLayout::split_kv(2, block_tokens, 4, 16, kv_core::Dtype::Bfloat16)
}

/// One engine rank: its agent on the network and its pool, one registered region.
struct Rank {
    name: AgentName,
    address: PeerAddress,
    transport: FakeTransport,
    pool: InMemoryMemory,
    region: Region,
    /// What `poll_event` returned that a test has not asked for yet: notifications, and the rest.
    notes: Vec<Notification>,
    others: Vec<PeerEvent>,
}

impl Rank {
    fn start(net: &FakeNetwork, engine: &str, role: Role, block_tokens: u32) -> Rank {
        Rank::restart(net, engine, role, block_tokens, 0)
    }

    /// An agent as incarnation `instance` of its engine.
    fn restart(net: &FakeNetwork, engine: &str, role: Role, block_tokens: u32, instance: u64) -> Rank {
        let name = AgentName::new(EngineId::new(engine), 0);
        let address = PeerAddress(format!("{engine}:5600"));
        // Distinct bases per engine, so that swapped addresses would not go unnoticed.
        let base = 0x1000_0000 + u64::from(engine.bytes().map(u32::from).sum::<u32>()) * 0x100_0000;
        let heap = FakeHeap::with_base(base);
        let mut pool = InMemoryMemory::new(heap.clone());
        let mut handshake = offer(&name, role, 1, layout(block_tokens));
        handshake.instance = instance;
        let mut transport = net.transport(name.clone(), address.clone(), heap, handshake).unwrap();
        let region = pool.allocate(MemoryKind::Host, POOL_BYTES).unwrap();
        transport.register(&region).unwrap();
        Rank { name, address, transport, pool, region, notes: Vec::new(), others: Vec::new() }
    }

    fn write(&mut self, offset: u64, bytes: &[u8]) {
        self.pool.write(self.region.id, offset, bytes).unwrap();
    }

    fn bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.pool.read(self.region.id, offset, &mut out).unwrap();
        out
    }

    /// A descriptor pair from this rank's point of view.
    fn pair(&self, local_offset: u64, peer: &Rank, remote_offset: u64, len: u64) -> DescriptorPair {
        DescriptorPair {
            local_region: 0,
            local_addr: self.region.addr + local_offset,
            remote_region: 0,
            remote_addr: peer.region.addr + remote_offset,
            len,
        }
    }

    fn post(&mut self, op: TransferOp, peer: &Rank, pairs: Vec<DescriptorPair>) -> Result<TransferId, TransportError> {
        let notification = Some(format!("{op:?} done").into_bytes());
        self.transport.post(TransferRequest { op, peer: peer.name.clone(), pairs, notification })
    }

    /// Reads `len` bytes at `offset` of `peer`'s pool into the same offset of this rank's.
    fn read(&mut self, peer: &Rank, offset: u64, len: u64) -> TransferId {
        self.post(TransferOp::Read, peer, vec![self.pair(offset, peer, offset, len)]).unwrap()
    }

    fn send(&mut self, to: &Rank, payload: &str) {
        self.transport.send_notification(&to.name, payload.as_bytes()).unwrap();
    }

    fn received(&mut self) -> Vec<String> {
        self.notifications().into_iter().map(|n| String::from_utf8_lossy(&n.payload).into_owned()).collect()
    }

    fn poll(&mut self) {
        while let Some(event) = self.transport.poll_event() {
            match event {
                PeerEvent::Notification(n) => self.notes.push(n),
                other => self.others.push(other),
            }
        }
    }

    fn notifications(&mut self) -> Vec<Notification> {
        self.poll();
        std::mem::take(&mut self.notes)
    }

    fn events(&mut self) -> Vec<PeerEvent> {
        self.poll();
        std::mem::take(&mut self.others)
    }
}

struct World {
    clock: ManualClock,
    net: FakeNetwork,
}

impl World {
    fn new(seed: u64, config: NetConfig) -> World {
        let clock = ManualClock::default();
        World { net: FakeNetwork::new(seed, clock.clone(), config), clock }
    }

    /// Moves time on and runs what fell due.
    fn run(&self, by: Duration) {
        self.clock.advance(by);
        self.net.settle();
    }

    /// A prefill and a decode rank, with the handshake done (decode initiates).
    fn pair(&self) -> (Rank, Rank) {
        let mut p = Rank::start(&self.net, "prefill0", Role::Prefill, 16);
        let mut d = Rank::start(&self.net, "decode0", Role::Decode, 16);
        d.transport.connect(&p.address).unwrap();
        self.run(ms(4));
        assert!(matches!(d.events()[..], [PeerEvent::Connected(_)]));
        assert!(matches!(p.events()[..], [PeerEvent::Connected(_)]));
        (p, d)
    }
}

fn engine(rank: &Rank) -> EngineId {
    rank.name.engine.clone()
}

#[test]
fn the_authenticated_handshake_takes_four_steps_and_samples_both_clock_offsets() {
    let world = World::new(1, NetConfig::default());
    let mut p = Rank::start(&world.net, "prefill0", Role::Prefill, 16);
    let mut d = Rank::start(&world.net, "decode0", Role::Decode, 16);
    d.transport.connect(&p.address).unwrap();
    assert_eq!(world.net.next_event_time(), Some(Time::from_millis(1)));
    // HELLO at 1 ms, CHALLENGE back at 2, PROOF and D's sealed offer at 3: P is connected.
    world.run(ms(3));
    assert!(d.events().is_empty(), "decode hears P's offer one latency later");
    let [PeerEvent::Connected(on_p)] = &p.events()[..] else { panic!("prefill should be connected at 3 ms") };
    world.run(ms(1));
    let [PeerEvent::Connected(on_d)] = &d.events()[..] else { panic!("decode should be connected at 4 ms") };
    assert_eq!(
        (on_d.agent.clone(), on_d.sent_at, on_d.received_at),
        (p.name.clone(), Time::from_millis(2), Time::from_millis(4))
    );
    assert_eq!(
        (on_p.agent.clone(), on_p.sent_at, on_p.received_at),
        (d.name.clone(), Time::from_millis(1), Time::from_millis(3))
    );
    assert_eq!((on_d.handshake.role, on_p.handshake.role), (Role::Prefill, Role::Decode));
    assert_eq!((on_d.clock_offset_nanos(), on_p.clock_offset_nanos()), (0, 0), "one shared clock");
    assert_eq!(world.net.next_event_time(), None);
}

#[test]
fn each_engine_reads_its_own_clock_and_the_handshake_samples_how_far_they_disagree() {
    let world = World::new(1, NetConfig::default());
    // P's clock reads 40 s ahead of the network's, D's 7.5 s: P is 32.5 s ahead of D.
    world.net.set_clock_offset(EngineId::new("prefill0"), 40_000_000_000);
    world.net.set_clock_offset(EngineId::new("decode0"), 7_500_000_000);
    let mut p = Rank::start(&world.net, "prefill0", Role::Prefill, 16);
    let mut d = Rank::start(&world.net, "decode0", Role::Decode, 16);
    d.transport.connect(&p.address).unwrap();
    world.run(ms(3));
    let [PeerEvent::Connected(on_p)] = &p.events()[..] else { panic!("prefill should be connected at 3 ms") };
    world.run(ms(1));
    let [PeerEvent::Connected(on_d)] = &d.events()[..] else { panic!("decode should be connected at 4 ms") };
    // The same steps as with one clock, each read on its own engine's clock.
    assert_eq!((on_d.sent_at, on_d.received_at), (Time::from_millis(7_502), Time::from_millis(7_504)));
    assert_eq!((on_p.sent_at, on_p.received_at), (Time::from_millis(40_001), Time::from_millis(40_003)));
    // P stamped its offer when it sent it, at 3 ms, and D its own at 2 ms.
    assert_eq!((on_d.handshake.clock, on_p.handshake.clock), (Time::from_millis(40_003), Time::from_millis(7_502)));
    assert_eq!((on_d.clock_offset_nanos(), on_p.clock_offset_nanos()), (32_500_000_000, -32_500_000_000));
    assert_eq!((on_d.round_trip(), on_p.round_trip()), (ms(2), ms(2)));

    // A wake-up an endpoint asks for on its own clock falls due when that clock reads it: D's
    // handshake with a stopped P gives up after the 5 s authentication timeout, not 7.5 s later.
    let world = World::new(1, NetConfig::default());
    world.net.set_clock_offset(EngineId::new("decode0"), 7_500_000_000);
    let p = Rank::start(&world.net, "prefill0", Role::Prefill, 16);
    let mut d = Rank::start(&world.net, "decode0", Role::Decode, 16);
    world.net.pause(engine(&p), Time::from_millis(60_000));
    d.transport.connect(&p.address).unwrap();
    world.run(ms(4_999));
    assert_eq!(d.events(), []);
    world.run(ms(1));
    assert!(matches!(d.events()[..], [PeerEvent::ConnectFailed { .. }]), "the handshake should time out at 5 s");
}

#[test]
fn a_simulator_can_jump_from_event_to_event() {
    let world = World::new(1, NetConfig::default());
    let p = Rank::start(&world.net, "prefill0", Role::Prefill, 16);
    let mut d = Rank::start(&world.net, "decode0", Role::Decode, 16);
    d.transport.connect(&p.address).unwrap();
    let mut steps = Vec::new();
    while let Some(next) = world.net.next_event_time() {
        steps.push(world.clock.advance_to(next));
        world.net.settle();
    }
    assert_eq!(steps, [1, 2, 3, 4].map(Time::from_millis));
    assert!(matches!(d.events()[..], [PeerEvent::Connected(_)]));
}

#[test]
fn a_read_copies_the_peers_bytes_into_local_regions() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    let first: Vec<u8> = (0..=255).collect();
    let second: Vec<u8> = (0..=255).rev().collect();
    p.write(0, &first);
    p.write(1024, &second);
    let pairs = vec![d.pair(4096, &p, 0, 256), d.pair(0, &p, 1024, 256)];
    let read = d.post(TransferOp::Read, &p, pairs).unwrap();
    world.run(ms(4));
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::InProgress);
    assert_eq!(d.bytes(0, 256), vec![0; 256], "nothing moves before completion");
    world.run(ms(1));
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::Done);
    assert_eq!((d.bytes(4096, 256), d.bytes(0, 256)), (first, second));
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::Failed(TransportError::UnknownTransfer(read)));
    assert!(p.received().is_empty(), "the notification leaves at completion and takes one latency");
    world.run(ms(1));
    assert_eq!(p.received(), ["Read done"]);
}

#[test]
fn a_read_by_prepared_indices_moves_the_entries_it_names() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    // Four 256-byte blocks on each side; P's block i holds the byte i.
    for i in 0..4u8 {
        p.write(u64::from(i) * 256, &[i + 1; 256]);
    }
    let blocks = |rank: &Rank| (0..4).map(|i| (rank.region.addr + i * 256, 256)).collect::<Vec<_>>();
    let local = d.transport.prepare(None, &blocks(&d)).unwrap();
    let remote = d.transport.prepare(Some(&p.name), &blocks(&p)).unwrap();
    let request = PreparedTransfer {
        op: TransferOp::Read,
        peer: p.name.clone(),
        local,
        local_indices: vec![0, 1],
        remote,
        remote_indices: vec![3, 2],
        notification: Some(b"prepared done".to_vec()),
    };
    // Lists are for one side only, and indices must pair up.
    let swapped = PreparedTransfer { local: remote, remote: local, ..request.clone() };
    assert!(matches!(d.transport.post_prepared(swapped), Err(TransportError::InvalidTransfer(_))));
    let short = PreparedTransfer { remote_indices: vec![3], ..request.clone() };
    assert!(matches!(d.transport.post_prepared(short), Err(TransportError::InvalidTransfer(_))));
    let outside = PreparedTransfer { remote_indices: vec![3, 4], ..request.clone() };
    assert!(matches!(d.transport.post_prepared(outside), Err(TransportError::InvalidTransfer(_))));
    let read = d.transport.post_prepared(request).unwrap();
    world.run(ms(6));
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::Done);
    assert_eq!((d.bytes(0, 256), d.bytes(256, 256), d.bytes(512, 256)), (vec![4; 256], vec![3; 256], vec![0; 256]));
    assert_eq!(p.received(), ["prepared done"]);
}

#[test]
fn a_write_copies_local_bytes_into_the_peer() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    p.write(100, b"pushed kv");
    let write = p.post(TransferOp::Write, &d, vec![p.pair(100, &d, 8192, 9)]).unwrap();
    world.run(ms(6));
    assert_eq!(p.transport.poll_transfer(write), TransferStatus::Done);
    assert_eq!(d.bytes(8192, 9), b"pushed kv");
    assert_eq!(d.received(), ["Write done"]);
}

#[test]
fn bytes_are_read_at_completion_not_at_post() {
    // A read that outlives the export sees whatever P put in the block meanwhile.
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    p.write(0, b"request A");
    let read = d.read(&p, 0, 9);
    world.run(ms(2));
    p.write(0, b"request B");
    world.run(ms(3));
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::Done);
    assert_eq!(d.bytes(0, 9), b"request B");
}

#[test]
fn ranges_outside_registered_regions_are_refused() {
    let world = World::new(1, NetConfig::default());
    let (p, mut d) = world.pair();
    // A good pair first: one bad pair refuses the whole request.
    let check = |d: &mut Rank, local_offset, remote_offset, len, expected| {
        let pairs = vec![d.pair(0, &p, 0, 8), d.pair(local_offset, &p, remote_offset, len)];
        assert_eq!(d.post(TransferOp::Read, &p, pairs), Err(expected));
    };
    let (local, remote) = (d.region.addr, p.region.addr);
    let not_registered = |side, addr, len| TransportError::NotRegistered { side, addr, len };
    check(&mut d, POOL_BYTES - 4, 0, 8, not_registered("local", local + POOL_BYTES - 4, 8));
    check(&mut d, 0, POOL_BYTES, 1, not_registered("remote", remote + POOL_BYTES, 1));
    let overflow = DescriptorPair { local_addr: u64::MAX - 2, ..d.pair(0, &p, 0, 8) };
    let refused = d.post(TransferOp::Read, &p, vec![overflow]);
    assert!(matches!(refused, Err(TransportError::InvalidTransfer(m)) if m.contains("overflows")));
    let empty = d.post(TransferOp::Read, &p, vec![d.pair(0, &p, 0, 0)]);
    assert!(matches!(empty, Err(TransportError::InvalidTransfer(_))));

    d.transport.deregister(d.region.id).unwrap();
    check(&mut d, 16, 0, 8, not_registered("local", local, 8));
    assert!(d.transport.deregister(d.region.id).is_err());
}

#[test]
fn a_region_deregistered_in_flight_fails_the_transfer() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    p.write(0, b"gone");
    let read = d.read(&p, 0, 4);
    p.transport.deregister(p.region.id).unwrap();
    world.run(ms(5));
    assert!(matches!(d.transport.poll_transfer(read), TransferStatus::Failed(TransportError::TransferFailed(_))));
    assert_eq!(d.bytes(0, 4), [0; 4]);
    world.run(ms(5));
    assert!(p.received().is_empty(), "a failed transfer sends no notification");
}

#[test]
fn only_connected_peers_are_reachable_and_notifications_have_a_limit() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    let stranger = Rank::start(&world.net, "decode9", Role::Decode, 16);
    assert_eq!(p.post(TransferOp::Write, &stranger, vec![]), Err(TransportError::UnknownPeer(stranger.name.clone())));
    assert_eq!(
        p.transport.send_notification(&stranger.name, b"hi"),
        Err(TransportError::UnknownPeer(stranger.name.clone()))
    );
    let max = kv_core::wire::MAX_MESSAGE_BYTES;
    let huge = vec![0; max + 1];
    assert_eq!(
        d.transport.send_notification(&p.name, &huge),
        Err(TransportError::NotificationTooLarge { len: max + 1, max })
    );
    let request =
        TransferRequest { op: TransferOp::Read, peer: p.name.clone(), pairs: vec![], notification: Some(huge) };
    assert_eq!(d.transport.post(request), Err(TransportError::NotificationTooLarge { len: max + 1, max }));
    d.transport.send_notification(&p.name, &vec![7; max]).unwrap();
    world.run(ms(1));
    assert_eq!(p.notifications()[0].payload.len(), max);
}

#[test]
fn unknown_addresses_are_unreachable_after_a_round_trip() {
    let world = World::new(1, NetConfig::default());
    let mut d = Rank::start(&world.net, "decode0", Role::Decode, 16);
    let nowhere = PeerAddress("nowhere:5600".into());
    d.transport.connect(&nowhere).unwrap();
    world.run(ms(1));
    assert!(d.events().is_empty());
    world.run(ms(1));
    assert_eq!(
        d.events(),
        [PeerEvent::ConnectFailed { address: nowhere.clone(), error: TransportError::Unreachable(nowhere) }]
    );
}

#[test]
fn a_refused_handshake_names_both_block_sizes_and_the_listener_keeps_serving() {
    let world = World::new(1, NetConfig::default());
    let mut p = Rank::start(&world.net, "prefill0", Role::Prefill, 32);
    let mut d24 = Rank::start(&world.net, "decode0", Role::Decode, 24);
    d24.transport.connect(&p.address).unwrap();
    world.run(ms(10));
    let [PeerEvent::ConnectFailed { address, error }] = &d24.events()[..] else { panic!("the connect should fail") };
    assert_eq!(*address, p.address);
    assert_eq!(
        error.to_string(),
        "transport backend: prefill0:5600 refused the handshake: block size mismatch: neither the prefill block of 32 tokens nor the decode block of 24 tokens is a multiple of the other"
    );
    // The listener refuses too, with the same values, and the initiator is no peer of it.
    let [PeerEvent::Refused { peer, cause, reason }] = &p.events()[..] else {
        panic!("the listener should report the refusal")
    };
    assert_eq!(*peer, Some(d24.name.clone()));
    assert_eq!(*cause, RefusalCause::Incompatible);
    assert_eq!(
        reason,
        "block size mismatch: neither the prefill block of 32 tokens nor the decode block of 24 tokens is a multiple of the other"
    );
    assert_eq!(d24.transport.send_notification(&p.name, b"x"), Err(TransportError::UnknownPeer(p.name.clone())));

    let mut d16 = Rank::start(&world.net, "decode1", Role::Decode, 16);
    d16.transport.connect(&p.address).unwrap();
    world.run(ms(4));
    assert!(matches!(d16.events()[..], [PeerEvent::Connected(_)]));
    let [PeerEvent::Connected(info)] = &p.events()[..] else { panic!("the listener should accept a compatible peer") };
    assert_eq!(info.agent, d16.name);
}

#[test]
fn drop_rate_one_loses_every_notification() {
    let world = World::new(1, NetConfig { drop_rate: 1.0, ..NetConfig::default() });
    let (mut p, mut d) = world.pair();
    for i in 0..10 {
        d.send(&p, &format!("n{i}"));
    }
    let read = d.read(&p, 0, 8);
    world.run(Duration::from_secs(1));
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::Done, "transfers are not dropped");
    assert!(p.received().is_empty());
    assert_eq!(world.net.stats(), NetStats { dropped: 11, transfers_done: 1, ..NetStats::default() });
}

#[test]
fn a_partition_drops_messages_both_ways_until_it_heals() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    let start = world.clock.now();
    d.send(&p, "in flight when the partition starts");
    world.net.partition(engine(&d), engine(&p), start + ms(100));
    d.send(&p, "d to p during");
    p.send(&d, "p to d during");
    world.run(ms(99));
    d.send(&p, "sent during, due after");
    world.run(ms(1));
    d.send(&p, "healed");
    world.run(ms(5));
    assert_eq!(p.received(), ["healed"]);
    assert!(d.received().is_empty());
    assert_eq!((world.net.stats().dropped, world.net.stats().delivered), (4, 1));
}

#[test]
fn a_partition_fails_transfers_in_flight_and_posted_during_it_and_refuses_connects() {
    let world = World::new(1, NetConfig::default());
    let (p, mut d) = world.pair();
    let in_flight = d.read(&p, 0, 8);
    world.run(ms(1));
    world.net.partition(engine(&p), engine(&d), world.clock.now() + ms(50));
    let during = d.read(&p, 0, 8);
    let mut late = Rank::start(&world.net, "decode1", Role::Decode, 16);
    world.net.partition(engine(&p), engine(&late), world.clock.now() + ms(50));
    late.transport.connect(&p.address).unwrap();
    world.run(ms(10));
    for id in [in_flight, during] {
        assert!(matches!(d.transport.poll_transfer(id), TransferStatus::Failed(TransportError::TransferFailed(_))));
    }
    assert!(matches!(&late.events()[..], [PeerEvent::ConnectFailed { error: TransportError::Unreachable(_), .. }]));
    world.run(ms(50));
    let after = d.read(&p, 0, 8);
    world.run(ms(5));
    assert_eq!(d.transport.poll_transfer(after), TransferStatus::Done);
}

#[test]
fn duplicate_rate_one_sends_every_notification_twice_and_the_copy_is_refused_as_a_replay() {
    let world = World::new(1, NetConfig { duplicate_rate: 1.0, ..NetConfig::default() });
    let (mut p, mut d) = world.pair();
    for payload in ["a", "b", "c"] {
        d.send(&p, payload);
    }
    world.run(ms(1));
    assert_eq!(p.received(), ["a", "b", "c"]);
    let refused = p.events();
    assert_eq!(refused.len(), 3);
    assert!(refused.iter().all(|e| matches!(e, PeerEvent::Refused { cause: RefusalCause::Replayed, .. })));
    assert_eq!((world.net.stats().duplicated, world.net.stats().delivered), (3, 6));
}

/// Sends 20 numbered notifications at once and returns the order they arrived in.
fn arrival_order(seed: u64, jitter: Duration) -> Vec<String> {
    let world = World::new(seed, NetConfig { reorder_jitter: jitter, ..NetConfig::default() });
    let (mut p, mut d) = world.pair();
    for i in 0..20 {
        d.send(&p, &i.to_string());
    }
    world.run(ms(1) + jitter);
    p.received()
}

#[test]
fn jitter_reorders_and_the_same_seed_reorders_the_same_way() {
    let in_order: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    assert_eq!(arrival_order(3, Duration::ZERO), in_order, "without jitter, messages keep their order");
    let orders: Vec<Vec<String>> = (0..5).map(|seed| arrival_order(seed, ms(10))).collect();
    assert!(orders.iter().any(|order| *order != in_order), "10 ms of jitter should reorder 20 messages");
    for (seed, order) in orders.iter().enumerate() {
        let mut sorted = order.clone();
        sorted.sort_by_key(|n| n.parse::<u32>().unwrap());
        assert_eq!(sorted, in_order, "seed {seed}: every message arrives once");
        assert_eq!(*order, arrival_order(seed as u64, ms(10)), "seed {seed} replays");
    }
}

#[test]
fn a_delay_holds_back_one_direction_until_it_ends() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    world.net.delay(engine(&d), engine(&p), ms(7), world.clock.now() + ms(20));
    d.send(&p, "delayed");
    p.send(&d, "on time");
    world.run(ms(1));
    assert_eq!(d.received(), ["on time"]);
    world.run(Duration::from_micros(6_999));
    assert!(p.received().is_empty());
    world.run(Duration::from_micros(1));
    assert_eq!(p.received(), ["delayed"]);
    world.run(ms(20));
    d.send(&p, "after");
    world.run(ms(1));
    assert_eq!(p.received(), ["after"]);
}

#[test]
fn a_detected_crash_reports_the_peer_lost_and_fails_its_transfers() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    p.write(0, b"block");
    let read = d.read(&p, 0, 5);
    world.run(ms(1));
    world.net.crash(engine(&p), true);
    assert!(d.events().is_empty(), "the side channel closes one latency later");
    world.run(ms(1));
    assert_eq!(d.events(), [PeerEvent::Lost(p.name.clone())]);
    assert_eq!(d.transport.poll_transfer(read), TransferStatus::InProgress);
    world.run(ms(3));
    assert!(matches!(d.transport.poll_transfer(read), TransferStatus::Failed(TransportError::TransferFailed(_))));
    assert_eq!(d.bytes(0, 5), [0; 5]);
    assert_eq!(d.transport.send_notification(&p.name, b"x"), Err(TransportError::PeerLost(p.name.clone())));
    assert!(matches!(p.transport.register(&p.region), Err(TransportError::Backend(_))), "a crashed agent does nothing");
}

#[test]
fn a_disconnect_is_a_loss_on_both_sides_behind_what_was_sent_and_cuts_transfers_both_ways() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    p.write(0, b"prefill");
    d.write(8, b"decode");
    let (d_read, p_read) = (d.read(&p, 0, 7), p.read(&d, 8, 6));
    p.send(&d, "before");
    // What decode sends prefill now arrives 5 ms late: the close it sends next goes behind it.
    world.net.delay(engine(&d), engine(&p), ms(5), world.clock.now() + ms(1));
    d.send(&p, "late, but before");
    world.run(ms(1));
    d.transport.disconnect(&p.name);
    d.transport.disconnect(&p.name);
    let events: Vec<PeerEvent> = std::iter::from_fn(|| d.transport.poll_event()).collect();
    let before = PeerEvent::Notification(Notification { from: p.name.clone(), payload: b"before".to_vec() });
    assert_eq!(events, [before, PeerEvent::Lost(p.name.clone())], "a second disconnect does nothing");
    assert_eq!(d.transport.send_notification(&p.name, b"x"), Err(TransportError::PeerLost(p.name.clone())));
    // Prefill has not heard yet, and its transfers posted now fail too.
    let p_late = p.read(&d, 8, 6);
    world.run(ms(4));
    assert!(p.transport.poll_event().is_none(), "prefill hears of it only when the close arrives");
    for (rank, id) in [(&mut d, d_read), (&mut p, p_read)] {
        assert!(matches!(rank.transport.poll_transfer(id), TransferStatus::Failed(TransportError::TransferFailed(_))));
    }
    assert_eq!((d.bytes(0, 7), p.bytes(8, 6)), (vec![0; 7], vec![0; 6]), "a cut transfer copies nothing");
    world.run(ms(1));
    let events: Vec<PeerEvent> = std::iter::from_fn(|| p.transport.poll_event()).collect();
    let late = PeerEvent::Notification(Notification { from: d.name.clone(), payload: b"late, but before".to_vec() });
    assert_eq!(events, [late, PeerEvent::Lost(d.name.clone())]);
    world.run(ms(1));
    assert!(matches!(p.transport.poll_transfer(p_late), TransferStatus::Failed(TransportError::TransferFailed(_))));
    assert_eq!(p.transport.send_notification(&d.name, b"x"), Err(TransportError::PeerLost(d.name.clone())));
    assert_eq!((world.net.stats().transfers_failed, world.net.stats().transfers_done), (3, 0));
}

#[test]
fn an_undetected_crash_is_silent_and_the_restarted_agent_is_a_new_peer() {
    let world = World::new(1, NetConfig::default());
    let (p, mut d) = world.pair();
    world.net.crash(&p.name, false);
    d.send(&p, "into the void");
    let read = d.read(&p, 0, 8);
    world.run(Duration::from_secs(1));
    assert!(d.events().is_empty(), "nobody tells decode");
    assert!(matches!(d.transport.poll_transfer(read), TransferStatus::Failed(TransportError::TransferFailed(_))));
    assert_eq!(world.net.stats().dropped, 1);

    let mut p2 = Rank::restart(&world.net, "prefill0", Role::Prefill, 16, 2);
    d.send(&p2, "to the old incarnation");
    world.run(ms(1));
    assert!(p2.received().is_empty(), "old connections are not revived");
    d.transport.connect(&p2.address).unwrap();
    world.run(ms(4));
    // A newer incarnation under the old name replaces the silent one: lost, then connected.
    let events = d.events();
    let [PeerEvent::Lost(old), PeerEvent::Connected(new)] = &events[..] else { panic!("{events:?}") };
    assert_eq!((old, &new.agent, new.handshake.instance), (&p2.name, &p2.name, 2));
    d.send(&p2, "hello again");
    world.run(ms(1));
    assert_eq!(p2.received(), ["hello again"]);
}

#[test]
fn injected_garbage_and_forged_senders_are_refused_not_delivered() {
    let world = World::new(1, NetConfig::default());
    let (mut p, d) = world.pair();
    let mallory = AgentName::new(EngineId::new("mallory"), 0);
    world.net.inject(&mallory, &p.name, b"\xff\x00not a frame".to_vec());
    // Even under a connected peer's name, bytes without that session's tag do not pass.
    world.net.inject(&d.name, &p.name, b"KT\0\0\0\0\0\0\0\0done0123456789abcdef".to_vec());
    world.run(ms(1));
    assert!(p.notifications().is_empty());
    let events = p.events();
    let [PeerEvent::Refused { peer: first, cause: c1, .. }, PeerEvent::Refused { peer: second, cause: c2, .. }] =
        &events[..]
    else {
        panic!("both should be refused: {events:?}")
    };
    assert_eq!((first.clone(), *c1), (Some(mallory), RefusalCause::Unauthenticated));
    assert_eq!((second.clone(), *c2), (Some(d.name.clone()), RefusalCause::Unauthenticated));
}

#[test]
fn an_intruder_without_the_key_is_refused_once_and_the_real_peer_stays() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    // It claims decode0's name, as a newer incarnation, which would replace the real one if it
    // could authenticate.
    let mut claim = offer(&d.name, Role::Decode, 1, layout(16));
    claim.instance = 7;
    world.net.intrude(&p.address, claim).unwrap();
    world.run(ms(10));
    let events = p.events();
    let [PeerEvent::Refused { peer, cause: RefusalCause::Unauthenticated, .. }] = &events[..] else {
        panic!("the intruder should be refused once: {events:?}")
    };
    assert_eq!(*peer, Some(d.name.clone()));
    assert!(d.events().is_empty(), "decode's connection is untouched");
    d.send(&p, "still here");
    world.run(ms(1));
    assert_eq!(p.received(), ["still here"]);
}

#[test]
fn an_injected_transfer_failure_hits_the_next_transfer_only() {
    let world = World::new(1, NetConfig::default());
    let (mut p, mut d) = world.pair();
    p.write(0, b"kv");
    world.net.fail_next_transfer(engine(&d));
    let first = d.read(&p, 0, 2);
    let second = d.post(TransferOp::Read, &p, vec![d.pair(8, &p, 0, 2)]).unwrap();
    world.run(ms(6));
    assert!(matches!(d.transport.poll_transfer(first), TransferStatus::Failed(TransportError::TransferFailed(_))));
    assert_eq!(d.transport.poll_transfer(second), TransferStatus::Done);
    assert_eq!((d.bytes(0, 2), d.bytes(8, 2)), (vec![0, 0], b"kv".to_vec()));
    assert_eq!(p.received(), ["Read done"], "only the transfer that succeeded notifies");
}

/// A run with every random fault on: what prefill received, in order, and the counters.
fn faulty_trace(seed: u64) -> (Vec<String>, NetStats) {
    let config = NetConfig { drop_rate: 0.2, duplicate_rate: 0.2, reorder_jitter: ms(3), ..NetConfig::default() };
    let world = World::new(seed, config);
    let (mut p, mut d) = world.pair();
    let mut received = Vec::new();
    for i in 0..40 {
        d.send(&p, &format!("n{i}"));
        if i % 10 == 0 {
            d.read(&p, 0, 64);
        }
        world.run(Duration::from_micros(700));
        received.extend(p.received());
    }
    world.run(ms(20));
    received.extend(p.received());
    (received, world.net.stats())
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    let trace = faulty_trace(11);
    assert_eq!(trace, faulty_trace(11));
    let stats = trace.1;
    assert!(stats.dropped > 0 && stats.duplicated > 0, "{stats:?}");
    assert!((12..20).map(faulty_trace).any(|other| other != trace), "other seeds should differ");
}

/// The fake network's pair for kv-core's Transport contract: A is decode0, B is prefill0.
struct FakePair {
    world: World,
    a: Rank,
    b: Rank,
}

impl kv_core::contract::TransportPair for FakePair {
    fn transport(&mut self, side: kv_core::contract::Side) -> &mut dyn Transport {
        match side {
            kv_core::contract::Side::A => &mut self.a.transport,
            kv_core::contract::Side::B => &mut self.b.transport,
        }
    }

    fn region(&self, side: kv_core::contract::Side) -> Region {
        match side {
            kv_core::contract::Side::A => self.a.region,
            kv_core::contract::Side::B => self.b.region,
        }
    }

    fn write(&mut self, side: kv_core::contract::Side, offset: u64, bytes: &[u8]) {
        match side {
            kv_core::contract::Side::A => self.a.write(offset, bytes),
            kv_core::contract::Side::B => self.b.write(offset, bytes),
        }
    }

    fn read(&mut self, side: kv_core::contract::Side, offset: u64, out: &mut [u8]) {
        let rank = if side == kv_core::contract::Side::A { &self.a } else { &self.b };
        out.copy_from_slice(&rank.bytes(offset, out.len()));
    }

    fn wait(&mut self) {
        self.world.run(ms(1));
    }

    fn kill_b(&mut self) {
        self.world.net.crash(&self.b.name, true);
    }
}

#[test]
fn the_fake_transport_keeps_the_transport_contract() {
    kv_core::contract::transport(&mut || {
        let world = World::new(7, NetConfig::default());
        let (b, a) = world.pair();
        Box::new(FakePair { world, a, b })
    });
}
