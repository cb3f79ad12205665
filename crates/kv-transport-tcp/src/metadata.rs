//! The agent metadata a [`crate::TcpTransport`] hands its peers in the handshake's
//! `agent_metadata`, which only a peer that proved the cluster key ever sees:
//!
//! ```text
//! "KVTC" | version u8 = 2 | family u8 (4 or 6) | IP (4 or 16 bytes) | port u16
//!        | count u32 | count x (addr u64, len u64, kind u8)
//! ```
//!
//! Integers are little-endian. The address is where the data listener listens; the table lists
//! the sender's registered regions (kind 0: pageable host memory, 1: pinned host memory), so
//! that a peer refuses a remote range outside them before it posts. Version 1 also carried a
//! capability token that data connections presented in clear; version 2 has none: a data
//! connection proves the side-channel session it belongs to instead (see `frame`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use kv_core::MemoryKind;

use crate::frame::u64_at;

/// The first bytes of this transport's agent metadata.
const MAGIC: &[u8; 4] = b"KVTC";
/// The layout this module writes.
const VERSION: u8 = 2;
/// Bytes of one table entry.
const ENTRY_BYTES: usize = 8 + 8 + 1;

/// A registered range of memory, local or a peer's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Registration {
    /// Its first byte.
    pub(crate) addr: u64,
    /// Its length in bytes.
    pub(crate) len: u64,
    /// What memory it is (host memory only).
    pub(crate) kind: MemoryKind,
}

impl Registration {
    /// Whether all of `addr..addr + len` lies inside it.
    pub(crate) fn holds(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.addr.checked_add(self.len)) {
            (Some(end), Some(own_end)) => self.addr <= addr && end <= own_end,
            _ => false,
        }
    }
}

/// What a peer's metadata says.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct PeerMetadata {
    /// Where its data listener listens.
    pub(crate) data: SocketAddr,
    /// Its registered regions.
    pub(crate) memory: Vec<Registration>,
}

/// Encodes the metadata of a transport whose data listener is `data`.
pub(crate) fn encode(data: SocketAddr, memory: &[Registration]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + memory.len() * ENTRY_BYTES);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    match data.ip() {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&ip.octets());
        }
    }
    out.extend_from_slice(&data.port().to_le_bytes());
    out.extend_from_slice(&(memory.len() as u32).to_le_bytes());
    for r in memory {
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.push(match r.kind {
            MemoryKind::PinnedHost => 1,
            // Device memory is never registered (see `TcpTransport::register`).
            MemoryKind::Host | MemoryKind::Device(_) => 0,
        });
    }
    out
}

/// Takes `n` bytes off the front of `rest`, or says what ended early.
fn take<'a>(rest: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], String> {
    if rest.len() < n {
        return Err(format!("agent metadata ends before its {what}"));
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Ok(head)
}

/// A peer's metadata, from what [`encode`] wrote; never panics.
pub(crate) fn decode(bytes: &[u8]) -> Result<PeerMetadata, String> {
    let mut rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| "agent metadata is not kv-transport-tcp's (a peer running another transport?)".to_owned())?;
    let version = take(&mut rest, 1, "version")?[0];
    if version != VERSION {
        return Err(format!("agent metadata version {version}, this side reads version {VERSION}"));
    }
    let ip = match take(&mut rest, 1, "address family")?[0] {
        4 => {
            let o = take(&mut rest, 4, "IPv4 address")?;
            IpAddr::V4(Ipv4Addr::new(o[0], o[1], o[2], o[3]))
        }
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(take(&mut rest, 16, "IPv6 address")?);
            IpAddr::V6(Ipv6Addr::from(o))
        }
        family => return Err(format!("agent metadata names address family {family}, not 4 or 6")),
    };
    let port = take(&mut rest, 2, "port")?;
    let data = SocketAddr::new(ip, u16::from_le_bytes([port[0], port[1]]));
    let count = take(&mut rest, 4, "registration count")?;
    let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
    if count.checked_mul(ENTRY_BYTES) != Some(rest.len()) {
        return Err(format!("agent metadata lists {count} registrations in {} bytes", rest.len()));
    }
    let mut memory = Vec::with_capacity(count);
    for entry in rest.chunks_exact(ENTRY_BYTES) {
        let kind = match entry[16] {
            0 => MemoryKind::Host,
            1 => MemoryKind::PinnedHost,
            tag => return Err(format!("agent metadata names memory kind {tag}, which this side does not know")),
        };
        memory.push(Registration { addr: u64_at(entry, 0), len: u64_at(entry, 8), kind });
    }
    Ok(PeerMetadata { data, memory })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(addr: u64, len: u64, kind: MemoryKind) -> Registration {
        Registration { addr, len, kind }
    }

    #[test]
    fn metadata_round_trips_for_both_address_families() {
        let memory = [reg(0x1000, 4096, MemoryKind::Host), reg(0x7f00_0000_0000, 1 << 30, MemoryKind::PinnedHost)];
        for data in ["127.0.0.1:4242", "[fe80::1]:7"] {
            let data: SocketAddr = data.parse().unwrap();
            let bytes = encode(data, &memory);
            let decoded = decode(&bytes).unwrap();
            assert_eq!(decoded, PeerMetadata { data, memory: memory.to_vec() });
        }
        let empty = encode("10.0.0.1:1".parse().unwrap(), &[]);
        assert!(decode(&empty).unwrap().memory.is_empty());
    }

    #[test]
    fn bad_metadata_is_an_error_that_says_why() {
        let good = encode("127.0.0.1:9".parse().unwrap(), &[reg(0, 8, MemoryKind::Host)]);
        let check = |bytes: &[u8], expected: &str| {
            let err = decode(bytes).unwrap_err();
            assert!(err.contains(expected), "{err:?} does not say {expected:?}");
        };
        check(b"KVNX\x01", "is not kv-transport-tcp's");
        check(b"KVTC", "ends before its version");
        check(b"KVTC\x01", "version 1, this side reads version 2");
        check(b"KVTC\x02\x05", "address family 5");
        check(b"KVTC\x02\x04\x7f\x00", "ends before its IPv4 address");
        check(&good[..good.len() - 1], "lists 1 registrations in 16 bytes");
        let mut extra = good.clone();
        extra.push(0);
        check(&extra, "lists 1 registrations in 18 bytes");
        let mut kind = good.clone();
        *kind.last_mut().unwrap() = 9;
        check(&kind, "memory kind 9");
        // Every truncation is an error, never a panic.
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err());
        }
    }

    #[test]
    fn a_registration_holds_only_ranges_inside_it() {
        let r = reg(1000, 100, MemoryKind::Host);
        assert!(r.holds(1000, 100) && r.holds(1050, 50));
        assert!(!r.holds(1050, 51), "runs off the end");
        assert!(!r.holds(999, 2), "starts before");
        assert!(!r.holds(u64::MAX, 2), "overflows");
        assert!(!reg(u64::MAX - 1, 4, MemoryKind::Host).holds(u64::MAX - 1, 1), "a registration that overflows");
    }
}
