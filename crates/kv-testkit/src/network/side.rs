//! The fake network's side channels: every agent runs kv-core's [`SideEndpoint`], and the
//! network moves its bytes as a TCP stream would (in order, one latency per frame, held through
//! partitions and pauses, lost only with a crash), reports connections opening and closing,
//! and wakes the endpoint when it asks. Notifications are sealed and opened by the endpoints.
//! Each endpoint is handed its engine's clock ([`FakeNetwork::set_clock_offset`]), so the clock
//! it stamps its offer with, and the round trip its peer measures, are that engine's.
//!
//! [`FakeNetwork::set_clock_offset`]: super::FakeNetwork::set_clock_offset

use kv_core::side::{ClusterKey, ConnId, SideEvent, CLUSTER_KEY_BYTES};
use kv_core::{AgentName, Notification, PeerAddress, PeerEvent, Time, TransportError};

use super::{Body, Endpoint, Event, Link, Message, Net};
use crate::Rng;

/// One end of a side-channel connection: who is at the other end, under which id there.
#[derive(Clone, Debug)]
pub(super) struct Conn {
    pub peer: Endpoint,
    pub peer_conn: ConnId,
    /// The peer closed it first: no close goes back.
    pub peer_closed: bool,
}

/// A key drawn from the seed.
pub(super) fn random_key(rng: &mut Rng) -> ClusterKey {
    let mut bytes = [0u8; CLUSTER_KEY_BYTES];
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    ClusterKey::from_bytes(&bytes).expect("32 bytes")
}

impl Net {
    fn nonce(&mut self) -> [u8; 32] {
        let mut nonce = [0u8; 32];
        for chunk in nonce.chunks_mut(8) {
            chunk.copy_from_slice(&self.rng.next_u64().to_le_bytes());
        }
        nonce
    }

    fn next_conn(&mut self) -> ConnId {
        self.next_conn += 1;
        ConnId(self.next_conn)
    }

    /// `who` opens a side-channel connection to the listener at `address`.
    pub(super) fn open(&mut self, who: &Endpoint, address: &PeerAddress) {
        let now = self.clock.now();
        let (mine, theirs, nonce) = (self.next_conn(), self.next_conn(), self.nonce());
        let listener = self.listeners.get(address).and_then(|name| {
            self.agents.get(name).map(|agent| Endpoint { name: name.clone(), generation: agent.generation })
        });
        let local = self.local_time(&who.name, now);
        let Some(agent) = self.agent_mut(who) else { return };
        agent.side.handle_connect(local, mine, address.clone(), nonce);
        match listener {
            Some(to) => {
                agent.conns.insert(mine, Conn { peer: to.clone(), peer_conn: theirs, peer_closed: false });
                let body = Body::Open { initiator_conn: mine, listener_conn: theirs };
                self.send(Message { from: who.clone(), to, sent_at: now, body });
            }
            None => {
                // Nobody listens: refused after one round trip, as a TCP connect would be.
                self.schedule(now + self.config.latency * 2, Event::Unreachable { to: who.clone(), conn: mine });
            }
        }
        self.pump_side(who, now);
    }

    pub(super) fn side_open(&mut self, at: Time, from: &Endpoint, to: &Endpoint, initiator: ConnId, listener: ConnId) {
        let nonce = self.nonce();
        let local = self.local_time(&to.name, at);
        let Some(agent) = self.agent_mut(to) else { return };
        agent.conns.insert(listener, Conn { peer: from.clone(), peer_conn: initiator, peer_closed: false });
        // The simulated cluster lives on one host, as the demo's engines do on loopback.
        agent.side.handle_accept(local, listener, std::net::Ipv4Addr::LOCALHOST.into(), nonce);
        self.pump_side(to, at);
    }

    pub(super) fn side_bytes(&mut self, at: Time, to: &Endpoint, conn: ConnId, bytes: &[u8]) {
        let local = self.local_time(&to.name, at);
        let Some(agent) = self.agent_mut(to) else { return };
        if !agent.conns.contains_key(&conn) {
            return;
        }
        agent.side.handle_bytes(local, conn, bytes);
        self.pump_side(to, at);
    }

    pub(super) fn side_peer_closed(&mut self, at: Time, to: &Endpoint, conn: ConnId) {
        let local = self.local_time(&to.name, at);
        let Some(agent) = self.agent_mut(to) else { return };
        let Some(c) = agent.conns.get_mut(&conn) else { return };
        c.peer_closed = true;
        agent.side.handle_closed(local, conn);
        self.pump_side(to, at);
    }

    /// A connection `to` opened never reached a listener.
    pub(super) fn side_closed(&mut self, at: Time, to: &Endpoint, conn: ConnId) {
        let local = self.local_time(&to.name, at);
        let Some(agent) = self.agent_mut(to) else { return };
        if let Some(c) = agent.conns.get_mut(&conn) {
            c.peer_closed = true;
        }
        agent.side.handle_closed(local, conn);
        self.pump_side(to, at);
    }

    /// `who` drops its established peer `peer`: its side endpoint reports the peer lost, behind
    /// the events already queued, and the close travels behind everything `who` sent the peer.
    /// A peer not established: nothing happens.
    pub(super) fn disconnect(&mut self, who: &Endpoint, peer: &AgentName) {
        let now = self.clock.now();
        let local = self.local_time(&who.name, now);
        let Some(agent) = self.agent_mut(who) else { return };
        let Some(established) = agent.side.peer(peer) else { return };
        // Taken out first, so that the close goes behind what was sent, not with the endpoint's.
        let conn = agent.conns.remove(&established.conn);
        agent.side.handle_closed(local, established.conn);
        self.pump_side(who, now);
        if let Some(conn) = conn.filter(|c| !c.peer_closed) {
            self.close_behind(who, conn, now);
        }
    }

    /// Sends the close of `conn` from `from`, behind everything `from` sent its peer before,
    /// as on one TCP stream.
    pub(super) fn close_behind(&mut self, from: &Endpoint, conn: Conn, now: Time) {
        let behind = self
            .queue
            .iter()
            .filter(|(_, event)| matches!(event, Event::Arrive(m) if m.from == *from && m.to == conn.peer))
            .map(|((at, _), _)| *at)
            .max();
        let at = behind.map_or(now + self.config.latency, |t| t.max(now + self.config.latency));
        let body = Body::Close { conn: conn.peer_conn };
        self.schedule(at, Event::Arrive(Message { from: from.clone(), to: conn.peer, sent_at: now, body }));
    }

    /// Why a transfer between `poster` and `peer`, both up, cannot complete: one of them saw
    /// the other lost while it was up (it disconnected the other, or heard it did).
    pub(super) fn severed(&self, poster: &Endpoint, peer: &Endpoint) -> Option<String> {
        let dropped = |by: &Endpoint, whom: &Endpoint| {
            self.agent(by)
                .and_then(|agent| agent.peers.get(&whom.name))
                .is_some_and(|link| link.lost && link.generation == whom.generation)
        };
        let (poster_up, peer_up) = (self.agent(poster).is_some(), self.agent(peer).is_some());
        (poster_up && peer_up && (dropped(poster, peer) || dropped(peer, poster)))
            .then(|| format!("the connection between {} and {} was dropped", poster.name, peer.name))
    }

    pub(super) fn side_timer(&mut self, at: Time, to: &Endpoint) {
        let local = self.local_time(&to.name, at);
        let Some(agent) = self.agent_mut(to) else { return };
        agent.side_timer = None;
        agent.side.handle_timeout(local);
        self.pump_side(to, at);
    }

    /// Carries out what `who`'s side endpoint asked for: its events become the agent's peer
    /// events, its bytes and closes travel, and its next wake-up is scheduled.
    fn pump_side(&mut self, who: &Endpoint, now: Time) {
        let offset = self.clock_offset(&who.name);
        let Some(agent) = self.agent_mut(who) else { return };
        while let Some(event) = agent.side.poll_event() {
            let event = match event {
                SideEvent::Connected { conn, info } => {
                    let Some(c) = agent.conns.get(&conn) else { continue };
                    agent.peers.insert(info.agent.clone(), Link { generation: c.peer.generation, lost: false });
                    // A newer incarnation says every older one of its engine is gone.
                    if let Some(below) = info.handshake.instance.checked_sub(1) {
                        agent.heard_gone.push((now, info.handshake.engine.clone(), below));
                    }
                    PeerEvent::Connected(info)
                }
                SideEvent::Lost { agent: lost, instance, .. } => {
                    if let Some(link) = agent.peers.get_mut(&lost) {
                        link.lost = true;
                    }
                    agent.heard_gone.push((now, lost.engine.clone(), instance));
                    PeerEvent::Lost(lost)
                }
                SideEvent::Refused { claimed, cause, reason, .. } => {
                    PeerEvent::Refused { peer: claimed, cause, reason }
                }
                SideEvent::ConnectFailed { address, error, .. } => PeerEvent::ConnectFailed { address, error },
            };
            agent.events.push_back(event);
        }
        let mut out = Vec::new();
        while let Some(t) = agent.side.poll_transmit() {
            if let Some(c) = agent.conns.get(&t.conn).filter(|c| !c.peer_closed) {
                out.push(Message {
                    from: who.clone(),
                    to: c.peer.clone(),
                    sent_at: now,
                    body: Body::Side { conn: c.peer_conn, bytes: t.bytes },
                });
            }
        }
        while let Some(conn) = agent.side.poll_close() {
            if let Some(c) = agent.conns.remove(&conn).filter(|c| !c.peer_closed) {
                out.push(Message {
                    from: who.clone(),
                    to: c.peer,
                    sent_at: now,
                    body: Body::Close { conn: c.peer_conn },
                });
            }
        }
        // One wake-up scheduled per agent, moved when the endpoint wants another, so that no
        // stale wake-up lingers in the queue. The endpoint asks on its engine's clock.
        let wanted = agent.side.poll_timeout().map(|t| t.shifted(offset.saturating_neg()).max(now));
        let scheduled = agent.side_timer;
        for message in out {
            self.send(message);
        }
        if scheduled.map(|(t, _)| t) != wanted {
            if let Some(key) = scheduled {
                self.queue.remove(&key);
            }
            let key = wanted.map(|t| self.schedule_keyed(t, Event::SideTimer { to: who.clone() }));
            if let Some(agent) = self.agent_mut(who) {
                agent.side_timer = key;
            }
        }
    }

    /// Seals `payload` for `to` with `from`'s session with it.
    pub(super) fn seal(&mut self, from: &Endpoint, to: &AgentName, payload: &[u8]) -> Result<Vec<u8>, TransportError> {
        let agent =
            self.agent_mut(from).ok_or_else(|| TransportError::Backend(format!("agent {} is down", from.name)))?;
        Ok(agent.side.seal_notification(to, payload)?)
    }

    pub(super) fn notification_arrived(&mut self, _at: Time, from: &Endpoint, to: &Endpoint, sealed: &[u8]) {
        let Some(agent) = self.agent_mut(to) else { return };
        let event = match agent.side.open_notification(&from.name, sealed) {
            Ok(payload) => PeerEvent::Notification(Notification { from: from.name.clone(), payload }),
            Err(e) => PeerEvent::Refused { peer: Some(from.name.clone()), cause: e.cause(), reason: e.to_string() },
        };
        agent.events.push_back(event);
        self.stats.delivered += 1;
    }
}
