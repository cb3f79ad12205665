//! The agent metadata a [`crate::TcpTransport`] hands its peers in the handshake's
//! `agent_metadata`, which only a peer that proved the cluster key ever sees: kvflow's
//! registration table ([`kv_core::agent::AgentTable`], transport `"tcp"`) with the address the
//! data listener listens at, and the sender's registered regions (host memory only), so that a
//! peer refuses a remote range outside them before it posts. Nothing follows the table. A data
//! connection proves the side-channel session it belongs to (see `frame`); the metadata carries
//! no token.

use std::net::SocketAddr;

pub(crate) use kv_core::agent::Registration;
use kv_core::agent::{AgentTable, AgentTableError};

/// The name this transport's tables carry.
const TRANSPORT: &str = "tcp";

/// What a peer's metadata says.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct PeerMetadata {
    /// Where its data listener listens.
    pub(crate) data: SocketAddr,
    /// Its registered regions.
    pub(crate) memory: Vec<Registration>,
}

/// Encodes the metadata of a transport whose data listener is `data`.
pub(crate) fn encode(data: SocketAddr, memory: &[Registration]) -> Result<Vec<u8>, AgentTableError> {
    AgentTable { transport: TRANSPORT.to_owned(), data: Some(data), registrations: memory.to_vec() }.encode(&[])
}

/// A peer's metadata, from what [`encode`] wrote; never panics.
pub(crate) fn decode(bytes: &[u8]) -> Result<PeerMetadata, String> {
    let (table, rest) = AgentTable::decode(bytes, TRANSPORT).map_err(|e| e.to_string())?;
    if !rest.is_empty() {
        return Err(format!(
            "agent metadata has {} bytes after its table, where kv-transport-tcp writes none",
            rest.len()
        ));
    }
    let data = table.data.ok_or("agent metadata names no data address")?;
    Ok(PeerMetadata { data, memory: table.registrations })
}

#[cfg(test)]
mod tests {
    use kv_core::MemoryKind;

    use super::*;

    fn reg(addr: u64, len: u64, kind: MemoryKind) -> Registration {
        Registration { addr, len, kind }
    }

    #[test]
    fn metadata_round_trips_for_both_address_families() {
        let memory = [reg(0x1000, 4096, MemoryKind::Host), reg(0x7f00_0000_0000, 1 << 30, MemoryKind::PinnedHost)];
        for data in ["127.0.0.1:4242", "[fe80::1]:7"] {
            let data: SocketAddr = data.parse().unwrap();
            let bytes = encode(data, &memory).unwrap();
            let decoded = decode(&bytes).unwrap();
            assert_eq!(decoded, PeerMetadata { data, memory: memory.to_vec() });
        }
        let empty = encode("10.0.0.1:1".parse().unwrap(), &[]).unwrap();
        assert!(decode(&empty).unwrap().memory.is_empty());
    }

    #[test]
    fn bad_metadata_is_an_error_that_says_why() {
        let good = encode("127.0.0.1:9".parse().unwrap(), &[reg(0, 8, MemoryKind::Host)]).unwrap();
        let check = |bytes: &[u8], expected: &str| {
            let err = decode(bytes).unwrap_err();
            assert!(err.contains(expected), "{err:?} does not say {expected:?}");
        };
        let nixl = AgentTable::new("nixl").encode(b"nixl agent").unwrap();
        check(&nixl, "written by transport \"nixl\", this side runs \"tcp\"");
        let no_address = AgentTable::new(TRANSPORT).encode(&[]).unwrap();
        check(&no_address, "names no data address");
        let mut extra = good.clone();
        extra.push(0);
        check(&extra, "1 bytes after its table");
        // Every truncation is an error, never a panic.
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err());
        }
    }
}
