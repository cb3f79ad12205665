//! Routing a connection on a port that an engine's ranks share: the accepting process reads the
//! first [`ROUTE_BYTES`] of the initiator's HELLO (without taking them off the socket) and
//! hands the connection to the rank it asks for, whose own [`SideEndpoint`](super::SideEndpoint)
//! then runs the handshake from the HELLO's first byte. Nothing here is trusted: the rank's
//! endpoint parses the whole HELLO again and authenticates the peer; routing only picks whom.

use crate::wire::Role;

use super::frame::{frame, role_of, truncated, Kind, HEADER_BYTES, MAGIC};
use super::{ANY_RANK, MAX_CLEAR_FRAME, MAX_ERROR_TEXT, SIDE_PROTOCOL_VERSION};

/// Bytes of a HELLO that decide its route: the frame header, the magic, the version, the rank
/// asked for and the initiator's role.
pub const ROUTE_BYTES: usize = HEADER_BYTES + MAGIC.len() + 2 + 4 + 1;

/// Where a connection on a shared port goes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Route {
    /// Fewer than [`ROUTE_BYTES`] bytes are in: wait for more (within the handshake's deadline).
    Incomplete,
    /// To the listener of this role and rank.
    To {
        /// The listener's role: the other one than the initiator's.
        role: Role,
        /// The rank the HELLO asks for.
        rank: u32,
    },
    /// Nowhere: write `frame` (an ERROR) and close.
    Refuse {
        /// The ERROR frame naming the reason.
        frame: Vec<u8>,
        /// Why, for the log.
        reason: String,
    },
}

/// Routes a connection by the first bytes it sent (at least [`ROUTE_BYTES`], or
/// [`Route::Incomplete`]).
pub fn route(first: &[u8]) -> Route {
    if first.len() < ROUTE_BYTES {
        return Route::Incomplete;
    }
    let len = u32::from_be_bytes([first[0], first[1], first[2], first[3]]) as usize;
    if first[4] != Kind::Hello as u8 || !(ROUTE_BYTES - 4..=MAX_CLEAR_FRAME).contains(&len) {
        return refuse(format!("malformed HELLO: a frame of kind {} and length {len} opens the connection", first[4]));
    }
    let body = &first[HEADER_BYTES..];
    if &body[..MAGIC.len()] != MAGIC {
        return refuse(format!("not a kvflow side channel (starts with {:02x?})", &body[..MAGIC.len()]));
    }
    let version = u16::from_be_bytes([body[4], body[5]]);
    if version != SIDE_PROTOCOL_VERSION {
        return refuse(format!("side protocol version mismatch: peer {version}, local {SIDE_PROTOCOL_VERSION}"));
    }
    let rank = u32::from_be_bytes([body[6], body[7], body[8], body[9]]);
    let initiator = match role_of(body[10]) {
        Ok(role) => role,
        Err(reason) => return refuse(format!("malformed HELLO: {reason}")),
    };
    if rank == ANY_RANK {
        return refuse("this port is shared by an engine's ranks: the address must name one (host:port/tpRANK)".into());
    }
    let role = match initiator {
        Role::Prefill => Role::Decode,
        Role::Decode => Role::Prefill,
    };
    Route::To { role, rank }
}

/// The ERROR frame that tells an initiator `reason` (cut to [`MAX_ERROR_TEXT`] bytes): what a
/// shared port answers for a rank whose process is gone.
pub fn error_frame(reason: &str) -> Vec<u8> {
    frame(Kind::Error, truncated(reason, MAX_ERROR_TEXT).as_bytes())
}

fn refuse(reason: String) -> Route {
    Route::Refuse { frame: error_frame(&reason), reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::side::frame::Identity;
    use crate::{EngineId, Role};

    fn hello(role: Role, target: u32, version: u16) -> Vec<u8> {
        let identity = Identity { role, engine: EngineId::new("decode-b"), rank: 1, incarnation: 7 };
        frame(Kind::Hello, &identity.body(version, target, &[9; 32]))
    }

    #[test]
    fn a_hello_goes_to_the_rank_it_names_of_the_other_role() {
        let bytes = hello(Role::Decode, 3, SIDE_PROTOCOL_VERSION);
        assert_eq!(route(&bytes[..ROUTE_BYTES - 1]), Route::Incomplete);
        assert_eq!(route(&bytes[..ROUTE_BYTES]), Route::To { role: Role::Prefill, rank: 3 });
        assert_eq!(route(&bytes), Route::To { role: Role::Prefill, rank: 3 });
        let bytes = hello(Role::Prefill, 0, SIDE_PROTOCOL_VERSION);
        assert_eq!(route(&bytes), Route::To { role: Role::Decode, rank: 0 });
    }

    fn refused(bytes: &[u8]) -> String {
        match route(bytes) {
            Route::Refuse { frame, reason } => {
                assert_eq!(frame[4], Kind::Error as u8);
                assert_eq!(&frame[HEADER_BYTES..], reason.as_bytes());
                reason
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn what_names_no_rank_or_is_no_hello_is_refused_by_name() {
        assert!(refused(&hello(Role::Decode, ANY_RANK, SIDE_PROTOCOL_VERSION)).contains("must name one"));
        assert!(refused(&hello(Role::Decode, 1, 3)).contains("peer 3, local 2"));
        let mut bytes = hello(Role::Decode, 1, SIDE_PROTOCOL_VERSION);
        bytes[15] = 7;
        assert!(refused(&bytes).contains("role byte 7"));
        bytes = hello(Role::Decode, 1, SIDE_PROTOCOL_VERSION);
        bytes[5] = b'X';
        assert!(refused(&bytes).contains("not a kvflow side channel"));
        assert!(refused(b"GET / HTTP/1.1\r\n\r\n").contains("kind 47"));
        bytes = hello(Role::Decode, 1, SIDE_PROTOCOL_VERSION);
        bytes[..4].copy_from_slice(&1_000_000u32.to_be_bytes());
        assert!(refused(&bytes).contains("length 1000000"));
    }

    #[test]
    fn an_error_frame_is_cut_to_its_bound() {
        let frame = error_frame(&"é".repeat(MAX_ERROR_TEXT));
        assert!(frame.len() <= HEADER_BYTES + MAX_ERROR_TEXT);
        assert!(std::str::from_utf8(&frame[HEADER_BYTES..]).is_ok());
    }
}
