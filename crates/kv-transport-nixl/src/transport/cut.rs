//! Peers cut off ([`crate::inbox`] says which): their side channels closed, and their NIXL
//! agents invalidated once quiet.

use std::time::Duration;

use kv_core::PeerEvent;

use super::NixlTransport;

impl NixlTransport {
    /// Closes the side channel of each peer the inbox cut off (if the NIXL agent it was cut
    /// off under is still the peer's): its `CutOff` is queued, and its `Lost` follows once the
    /// endpoint reports it. Logs each at WARNING, once per peer. Whether any was closed.
    pub(super) fn cut_off_flooders(&mut self) -> bool {
        let cut = self.fetcher.inbox().take_cut();
        let mut closed = false;
        for (peer, nixl, reason) in cut {
            let Some(conn) = self.peers.get(&peer).filter(|p| p.nixl == nixl).map(|p| p.conn) else { continue };
            let refused = self.penalties.strike(&peer.engine, std::time::Instant::now());
            if self.warned.contains(&peer) {
                tracing::debug!(%peer, reason = reason.as_str(), refused_ms = refused.as_millis() as u64, "peer cut off again");
            } else {
                tracing::warn!(
                    %peer,
                    reason = reason.as_str(),
                    "peer cut off: its notifications outran what this engine takes in (more than {} bytes dropped \
                     unread since its queue was last empty); its side channel is closed, and its engine's \
                     connections are refused for {} ms",
                    crate::inbox::CUT_OFF_AFTER_DROPPED_BYTES,
                    refused.as_millis()
                );
                if self.warned.len() == WARNED_PEERS {
                    self.warned.pop_front();
                }
                self.warned.push_back(peer.clone());
            }
            self.fetcher.inbox().push(PeerEvent::CutOff { peer, reason });
            if self.cut_agents.len() == CUT_AGENTS_PENDING {
                let oldest = self.cut_agents.remove(0);
                let _ = self.agent.invalidate_remote_md(&oldest);
            }
            self.cut_agents.push(nixl);
            self.side.peer_closed(conn);
            closed = true;
        }
        closed
    }

    /// Invalidates the NIXL agent of each peer cut off once nothing of it has come for
    /// [`CUT_QUIET_BEFORE_INVALIDATE`]. Not at once: what a flooder queued in its own UCX
    /// before it learnt of its cut-off still flows in, and while it does, NIXL's progress
    /// thread holds UCX's worker lock nearly throughout, so an invalidation (which closes UCX's
    /// endpoint under that lock) waited 64 to 276 ms for it, holding NIXL's agent lock, and no
    /// fetch could take the flood's notifications meanwhile (P grew by 34 MB in one such wait,
    /// in `cargo xtask attack --only contended`).
    pub(super) fn invalidate_quiet(&mut self) {
        if self.cut_agents.is_empty() {
            return;
        }
        let now = std::time::Instant::now();
        let quiet: Vec<String> = {
            let inbox = self.fetcher.inbox();
            self.cut_agents
                .iter()
                .filter(|n| inbox.cut_quiet_for(n, now).is_none_or(|q| q >= CUT_QUIET_BEFORE_INVALIDATE))
                .cloned()
                .collect()
        };
        for nixl in quiet {
            self.cut_agents.retain(|n| *n != nixl);
            // Unless a newer connection loaded the same agent again (a peer cut off reconnects
            // as a newer incarnation, so under another NIXL name).
            if !self.peers.values().any(|p| p.nixl == nixl) {
                let _ = self.agent.invalidate_remote_md(&nixl);
            }
        }
    }
}

/// How long nothing may come from a peer cut off before its NIXL agent is invalidated.
const CUT_QUIET_BEFORE_INVALIDATE: Duration = Duration::from_millis(100);

/// At most this many NIXL agents of peers cut off wait to be invalidated; past that, the
/// oldest is invalidated at once.
const CUT_AGENTS_PENDING: usize = 64;

/// Peers cut off that the transport remembers having logged at WARNING.
const WARNED_PEERS: usize = 256;
