//! [`FakeTransport`]: one agent's [`Transport`] on the fake network.

use kv_core::{
    AgentName, DescriptorPair, PeerAddress, PeerEvent, PreparedId, PreparedLists, PreparedTransfer, Region, RegionId,
    TransferId, TransferOp, TransferRequest, TransferStatus, Transport, TransportError,
};

use super::{validate, Agent, Body, Endpoint, Event, FakeNetwork, Message, Net, Transfer};

/// One agent (one TP rank) on a [`FakeNetwork`]; every method settles the network first.
///
/// Once the agent crashed, or was restarted under a new handle, the calls that act fail with
/// [`TransportError::Backend`], and polls report only what finished before.
#[derive(Debug)]
pub struct FakeTransport {
    me: Endpoint,
    network: FakeNetwork,
    /// Prepared lists' `(address, length)` ranges. They are checked when a transfer posts them, as every fake
    /// transfer is.
    prepared: PreparedLists<Vec<(u64, u64)>>,
}

impl FakeTransport {
    pub(super) fn new(me: Endpoint, network: FakeNetwork) -> Self {
        FakeTransport { me, network, prepared: PreparedLists::default() }
    }

    /// The network this agent is on.
    pub fn network(&self) -> &FakeNetwork {
        &self.network
    }

    fn settled<R>(&self, f: impl FnOnce(&mut Net, &Endpoint) -> R) -> R {
        f(&mut self.network.settled(), &self.me)
    }
}

impl Transport for FakeTransport {
    fn agent(&self) -> &AgentName {
        &self.me.name
    }

    fn register(&mut self, region: &Region) -> Result<(), TransportError> {
        self.settled(|net, me| {
            let agent = net.caller_mut(me)?;
            if !agent.heap.contains(region.addr, region.len) {
                let (addr, len) = (region.addr, region.len);
                return Err(TransportError::Backend(format!("{addr:#x}+{len} is not allocated in {}'s heap", me.name)));
            }
            agent.regions.insert(region.id, *region);
            Ok(())
        })
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError> {
        self.settled(|net, me| match net.caller_mut(me)?.regions.remove(&region) {
            Some(_) => Ok(()),
            None => Err(TransportError::Backend(format!("region {region:?} is not registered by {}", me.name))),
        })
    }

    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError> {
        self.settled(|net, me| {
            net.caller(me)?;
            net.open(me, address);
            Ok(())
        })
    }

    fn prepare(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError> {
        if let Some(peer) = peer {
            self.settled(|net, me| net.caller(me)?.link(peer).map(|_| ()))?;
        }
        Ok(self.prepared.insert(peer.cloned(), ranges.to_vec()))
    }

    fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError> {
        request.check_counts()?;
        let local = self.prepared.get(request.local, None)?;
        let remote = self.prepared.get(request.remote, Some(&request.peer))?;
        let entry = |list: &[(u64, u64)], i: u32| {
            list.get(i as usize).copied().ok_or_else(|| {
                TransportError::InvalidTransfer(format!("entry {i} of a list of {} prepared ranges", list.len()))
            })
        };
        let mut pairs = Vec::with_capacity(request.local_indices.len());
        for (&l, &r) in request.local_indices.iter().zip(&request.remote_indices) {
            let ((local_addr, len), (remote_addr, remote_len)) = (entry(local, l)?, entry(remote, r)?);
            if len != remote_len {
                return Err(TransportError::InvalidTransfer(format!(
                    "entry {l} is {len} bytes, remote entry {r} is {remote_len}"
                )));
            }
            pairs.push(DescriptorPair { local_region: 0, local_addr, remote_region: 0, remote_addr, len });
        }
        self.post(TransferRequest { op: request.op, peer: request.peer, pairs, notification: request.notification })
    }

    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError> {
        self.settled(|net, me| {
            let now = net.clock.now();
            let local = net.caller(me)?;
            let peer = local.link(&request.peer)?;
            check_size(request.notification.as_deref())?;
            let remote = net.agent(&peer).map(|agent| &agent.regions);
            let peer_up = remote.is_some();
            validate(&request.pairs, &local.regions, remote)?;
            let injected = net.transfer_faults.iter_mut().position(|fault| fault(&me.name, &request));
            if let Some(index) = injected {
                // An injected failure fires once.
                drop(net.transfer_faults.remove(index));
            }
            // A part-way failure, for a read only, and only if it touches the ranges picked.
            let mut spoil = Vec::new();
            if injected.is_none() && request.op == TransferOp::Read {
                let picked = net.spoil_faults.iter_mut().enumerate().find_map(|(i, fault)| {
                    let touched = overlaps(&request.pairs, &fault(&me.name, &request).unwrap_or_default());
                    (!touched.is_empty()).then_some((i, touched))
                });
                if let Some((index, touched)) = picked {
                    // It fires once.
                    drop(net.spoil_faults.remove(index));
                    spoil = touched;
                }
            }
            let doom = if injected.is_some() {
                Some("injected transfer failure".to_owned())
            } else if !peer_up {
                Some(format!("peer {} is down", peer.name))
            } else if net.partitioned(&me.name, &peer.name, now) {
                Some(format!("partitioned from {}", peer.name))
            } else {
                None
            };
            // The notification rides sealed for the peer, as every notification does.
            let mut request = request;
            let completes = request.notification.as_deref().and_then(kv_core::Message::completed_request);
            if let Some(payload) = request.notification.take() {
                request.notification = Some(net.seal(me, &peer.name, &payload)?);
            }
            let agent = net.caller_mut(me)?;
            let id = TransferId(agent.next_transfer);
            agent.next_transfer += 1;
            agent.transfers.insert(id, Transfer::InFlight { request, peer, doom, spoil, completes });
            net.schedule(now + net.config.transfer_latency, Event::Complete { poster: me.clone(), id });
            Ok(id)
        })
    }

    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        self.settled(|net, me| {
            // A crashed agent still reports the transfers its crash failed.
            let agent = net.agents.get_mut(&me.name).filter(|agent| agent.generation == me.generation);
            let Some(transfers) = agent.map(|agent| &mut agent.transfers) else {
                return TransferStatus::Failed(TransportError::UnknownTransfer(id));
            };
            match transfers.remove(&id) {
                None => TransferStatus::Failed(TransportError::UnknownTransfer(id)),
                Some(Transfer::Finished(status)) => status,
                Some(in_flight) => {
                    transfers.insert(id, in_flight);
                    TransferStatus::InProgress
                }
            }
        })
    }

    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError> {
        self.settled(|net, me| {
            let to = net.caller(me)?.link(peer)?;
            check_size(Some(payload))?;
            if let Some(index) = net.send_faults.iter_mut().position(|fault| fault(&me.name, peer, payload)) {
                // An injected refusal fires once.
                drop(net.send_faults.remove(index));
                return Err(TransportError::Backend(format!("injected failure sending to {peer}")));
            }
            let sealed = net.seal(me, peer, payload)?;
            let sent_at = net.clock.now();
            net.send(Message { from: me.clone(), to, sent_at, body: Body::Notification(sealed) });
            Ok(())
        })
    }

    fn poll_event(&mut self) -> Option<PeerEvent> {
        self.settled(|net, me| net.agent_mut(me)?.events.pop_front())
    }

    fn disconnect(&mut self, peer: &AgentName) {
        self.settled(|net, me| net.disconnect(me, peer));
    }
}

impl Net {
    /// The calling agent, if it is up.
    fn caller(&self, me: &Endpoint) -> Result<&Agent, TransportError> {
        self.agent(me).ok_or_else(|| down(me))
    }

    fn caller_mut(&mut self, me: &Endpoint) -> Result<&mut Agent, TransportError> {
        self.agent_mut(me).ok_or_else(|| down(me))
    }
}

fn down(me: &Endpoint) -> TransportError {
    TransportError::Backend(format!("agent {} is down", me.name))
}

fn check_size(notification: Option<&[u8]>) -> Result<(), TransportError> {
    let max = kv_core::wire::MAX_MESSAGE_BYTES;
    match notification {
        Some(payload) if payload.len() > max => Err(TransportError::NotificationTooLarge { len: payload.len(), max }),
        _ => Ok(()),
    }
}

/// The parts of `ranges` that the local side of `pairs` covers.
fn overlaps(pairs: &[DescriptorPair], ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for pair in pairs {
        for &(addr, len) in ranges {
            let start = addr.max(pair.local_addr);
            let end = (addr + len).min(pair.local_addr + pair.len);
            if start < end {
                out.push((start, end - start));
            }
        }
    }
    out
}
