//! The registration table a transport hands its peers in the handshake's `agent_metadata`: the
//! sender's registered memory (so that a peer types its descriptor lists, and refuses a remote
//! range outside them before it posts), which transport wrote it, and where that transport's
//! own data path listens, if it has one; then whatever bytes of its own the transport adds
//! (NIXL's serialized agent, for kv-transport-nixl).
//!
//! ```text
//! b"KV" | protocol version u16 BE | the table in postcard | the transport's own bytes
//! ```
//!
//! The header is the wire frames' ([`crate::wire`]), so a peer of another protocol version is
//! refused by version. The side channel hands `agent_metadata` only to a peer that proved the
//! cluster key, and bounds it with the handshake ([`crate::wire::MAX_HANDSHAKE_BYTES`]); the
//! table holds at most [`MAX_REGISTRATIONS`] entries. kv-core's handshake treats the field as
//! opaque bytes: only the transports read it, through this one codec.

// `core`'s address type: a value, no socket (kv-core does no I/O).
use core::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::ports::MemoryKind;
use crate::wire::{self, WireError, MAX_HANDSHAKE_BYTES};

/// The most registrations a table may list.
pub const MAX_REGISTRATIONS: usize = 65_536;

/// A registered range of memory, local or a peer's.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Registration {
    /// Its first byte.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// What memory it is.
    pub kind: MemoryKind,
}

impl Registration {
    /// Whether all of `addr..addr + len` lies inside it (neither end overflowing).
    pub fn holds(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.addr.checked_add(self.len)) {
            (Some(end), Some(own_end)) => self.addr <= addr && end <= own_end,
            _ => false,
        }
    }

    /// The kind of the registration among `registrations` that holds all of `addr..addr + len`,
    /// if one does.
    pub fn kind_of(registrations: impl IntoIterator<Item = Registration>, addr: u64, len: u64) -> Option<MemoryKind> {
        registrations.into_iter().find(|r| r.holds(addr, len)).map(|r| r.kind)
    }
}

/// What a transport tells its peers of itself.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct AgentTable {
    /// The transport that wrote it (`"nixl"`, `"tcp"`): a peer running another is refused by
    /// name.
    pub transport: String,
    /// Where the transport's own data path listens, if it has one (kv-transport-tcp's).
    pub data: Option<SocketAddr>,
    /// The sender's registered memory, as of the offer.
    pub registrations: Vec<Registration>,
}

/// Why a peer's agent metadata was refused.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum AgentTableError {
    /// The header or the table did not decode.
    #[error("agent metadata: {0}")]
    Frame(#[from] WireError),
    /// Another transport wrote it.
    #[error("agent metadata written by transport {peer:?}, this side runs {local:?}")]
    Transport {
        /// The peer's.
        peer: String,
        /// This side's.
        local: String,
    },
    /// It lists more registrations than [`MAX_REGISTRATIONS`].
    #[error("agent metadata lists {count} registrations, at most {max} are accepted")]
    TooMany {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
}

const WHAT: &str = "agent metadata";

impl AgentTable {
    /// A table of `transport`'s, with no data address and no registrations yet.
    pub fn new(transport: &str) -> Self {
        AgentTable { transport: transport.to_owned(), data: None, registrations: Vec::new() }
    }

    /// The agent metadata: the table, then `tail` (the transport's own bytes). Fails only if
    /// it would not fit a handshake, or lists more than [`MAX_REGISTRATIONS`].
    pub fn encode(&self, tail: &[u8]) -> Result<Vec<u8>, AgentTableError> {
        self.check_count()?;
        let mut out = wire::encode_frame(self, MAX_HANDSHAKE_BYTES, WHAT)?;
        if out.len() + tail.len() > MAX_HANDSHAKE_BYTES {
            return Err(WireError::Oversized { len: out.len() + tail.len(), max: MAX_HANDSHAKE_BYTES }.into());
        }
        out.extend_from_slice(tail);
        Ok(out)
    }

    /// A peer's table and the transport's own bytes after it, from what [`AgentTable::encode`]
    /// wrote, if `local` (this side's transport) wrote it; never panics.
    pub fn decode<'a>(bytes: &'a [u8], local: &str) -> Result<(AgentTable, &'a [u8]), AgentTableError> {
        let (table, tail): (AgentTable, _) = wire::take_frame(bytes, MAX_HANDSHAKE_BYTES, WHAT)?;
        if table.transport != local {
            return Err(AgentTableError::Transport { peer: table.transport, local: local.to_owned() });
        }
        table.check_count()?;
        Ok((table, tail))
    }

    fn check_count(&self) -> Result<(), AgentTableError> {
        let count = self.registrations.len();
        if count > MAX_REGISTRATIONS {
            return Err(AgentTableError::TooMany { count, max: MAX_REGISTRATIONS });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::PROTOCOL_VERSION;

    fn reg(addr: u64, len: u64, kind: MemoryKind) -> Registration {
        Registration { addr, len, kind }
    }

    fn table() -> AgentTable {
        AgentTable {
            transport: "tcp".into(),
            data: Some("[fe80::1]:7".parse().unwrap()),
            registrations: vec![
                reg(0x1000, 4096, MemoryKind::Host),
                reg(0x7f00_0000_0000, 1 << 30, MemoryKind::PinnedHost),
                reg(0x7e00_0000_0000, 256 << 20, MemoryKind::Device(3)),
            ],
        }
    }

    #[test]
    fn the_table_and_the_transports_bytes_round_trip() {
        let bytes = table().encode(b"nixl agent").unwrap();
        assert_eq!(&bytes[..4], [b'K', b'V', 0, PROTOCOL_VERSION as u8]);
        assert_eq!(AgentTable::decode(&bytes, "tcp").unwrap(), (table(), &b"nixl agent"[..]));
        // The layout docs/side-channel.md gives: header, transport, data address, registrations.
        let tcp = AgentTable { data: Some("127.0.0.1:4242".parse().unwrap()), ..AgentTable::new("tcp") };
        let expected =
            [&b"KV"[..], &[0, PROTOCOL_VERSION as u8, 3], b"tcp", &[1, 0, 127, 0, 0, 1, 0x92, 0x21, 0]].concat();
        assert_eq!(tcp.encode(b"").unwrap(), expected);
        let empty = AgentTable::new("nixl");
        assert_eq!(AgentTable::decode(&empty.encode(b"").unwrap(), "nixl").unwrap(), (empty, &b""[..]));
    }

    #[test]
    fn bad_metadata_is_an_error_that_names_the_values() {
        let good = table().encode(b"").unwrap();
        let err = |bytes: &[u8]| AgentTable::decode(bytes, "tcp").unwrap_err().to_string();
        assert_eq!(err(b"NIXL\x01"), "agent metadata: not a kvflow frame (starts with [4e, 49, 58, 4c])");
        // An older kvflow's table ("KVNX", "KVTC") reads as another version.
        assert_eq!(
            err(b"KVTC\x02"),
            format!("agent metadata: protocol version mismatch: peer 21571, local {PROTOCOL_VERSION}")
        );
        let mut old = good.clone();
        old[3] = 2;
        assert_eq!(err(&old), format!("agent metadata: protocol version mismatch: peer 2, local {PROTOCOL_VERSION}"));
        assert_eq!(
            AgentTable::decode(&good, "nixl").unwrap_err().to_string(),
            "agent metadata written by transport \"tcp\", this side runs \"nixl\""
        );
        // A memory kind this side does not know.
        let kind = good.len() - 1 - 1; // Device(3): variant 2, then 3.
        let mut unknown = good.clone();
        unknown[kind] = 9;
        assert!(err(&unknown).starts_with("agent metadata: malformed agent metadata"), "{}", err(&unknown));
        // Every truncation is an error, never a panic.
        for cut in 0..good.len() {
            assert!(AgentTable::decode(&good[..cut], "tcp").is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn a_table_holds_a_bounded_number_of_registrations() {
        let mut big = AgentTable::new("tcp");
        big.registrations = vec![reg(0, 1, MemoryKind::Host); MAX_REGISTRATIONS + 1];
        let refused = AgentTableError::TooMany { count: MAX_REGISTRATIONS + 1, max: MAX_REGISTRATIONS };
        assert_eq!(big.encode(b"").unwrap_err(), refused);
        // A peer's table past the bound is refused as it is read.
        let bytes = wire::encode_frame(&big, MAX_HANDSHAKE_BYTES, WHAT).unwrap();
        assert_eq!(AgentTable::decode(&bytes, "tcp").unwrap_err(), refused);
        // A declared count the bytes do not hold allocates nothing close to it.
        let mut lie = wire::encode_frame(&AgentTable::new("tcp"), MAX_HANDSHAKE_BYTES, WHAT).unwrap();
        lie.pop();
        lie.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(AgentTable::decode(&lie, "tcp").is_err());
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

    #[test]
    fn a_range_takes_the_kind_of_the_registration_that_holds_all_of_it() {
        let table = [reg(1000, 100, MemoryKind::Host), reg(2000, 100, MemoryKind::Device(1))];
        let kind = |addr, len| Registration::kind_of(table, addr, len);
        assert_eq!(kind(1000, 100), Some(MemoryKind::Host));
        assert_eq!(kind(2050, 50), Some(MemoryKind::Device(1)));
        assert_eq!(kind(2050, 51), None, "runs off the end");
        assert_eq!(kind(999, 2), None, "starts before");
        assert_eq!(kind(1050, 1000), None, "spans two registrations");
        assert_eq!(kind(u64::MAX, 2), None, "overflows");
    }
}
