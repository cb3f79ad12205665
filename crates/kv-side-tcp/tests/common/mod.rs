//! What the side channel's integration tests share: an offer, a side channel started without
//! a key, the next event of interest, a free port.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::side::{SideEvent, SideLimits};
use kv_core::{AgentName, Dtype, EngineId, Handshake, KvLayout, Role, TransportError};
use kv_side_tcp::{Item, KeySource, MonotonicClock, PortPlan, SideChannel};

pub fn offer(engine: &str, role: Role, rank: u32, instance: u64) -> Handshake {
    let agent = AgentName::new(EngineId::new(engine), rank);
    Handshake::new(&agent, 2, instance, role, "model", KvLayout::split_kv(1, 16, 2, 8, Dtype::Bfloat16))
}

/// A side channel at `bind` as `plan` says, for `role`'s rank `rank` of `engine`, without a key.
pub fn start(
    bind: SocketAddr,
    plan: PortPlan,
    engine: &str,
    role: Role,
    rank: u32,
    instance: u64,
) -> Result<SideChannel, TransportError> {
    let key = KeySource::None.load().expect("no key");
    let clock = Arc::new(MonotonicClock::start());
    SideChannel::start_on(bind, plan, key, SideLimits::default(), offer(engine, role, rank, instance), clock)
}

/// Waits up to 10 s for `d`'s next event of interest: connected (the agent), or failed, lost
/// or refused (the text).
pub fn outcome(d: &SideChannel) -> String {
    outcome_within(d, Duration::from_secs(10))
}

/// [`outcome`] within `wait`; `nothing` when none came.
pub fn outcome_within(d: &SideChannel, wait: Duration) -> String {
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        match d.poll_item() {
            Some(Item::Event(SideEvent::Connected { info, .. })) => return format!("connected {}", info.agent),
            Some(Item::Event(SideEvent::ConnectFailed { error, .. })) => return format!("failed {error}"),
            Some(Item::Event(SideEvent::Lost { agent, .. })) => return format!("lost {agent}"),
            Some(Item::Event(SideEvent::Refused { cause, reason, .. })) => {
                return format!("refused {cause:?}: {reason}")
            }
            Some(Item::PeerClosed(conn)) => d.peer_closed(conn),
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    "nothing".into()
}

pub fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}
