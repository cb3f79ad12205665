//! The side channel's framing and its clear-text frames (HELLO, CHALLENGE, PROOF, ERROR).
//!
//! A frame is a `u32` big-endian length of what follows, a `u8` kind, and the body
//! ([`FrameHeader`], which the links bound to a session share).
//! [`docs/side-channel.md`] at the workspace root describes every field.

use crate::id::{AgentName, EngineId};
use crate::wire::{Handshake, Role};

use super::crypto::MAC_BYTES;

/// Bytes of the length prefix and the kind.
pub(crate) const HEADER_BYTES: usize = 5;
/// The first bytes of HELLO and CHALLENGE bodies.
pub(crate) const MAGIC: &[u8; 4] = b"KVSC";
/// The longest engine name HELLO and CHALLENGE carry, in bytes.
pub const MAX_ENGINE_NAME_BYTES: usize = 64;
/// The rank a HELLO asks for when it asks for whichever rank listens (a port of the rank's own).
pub const ANY_RANK: u32 = u32::MAX;

/// What a frame is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(crate) enum Kind {
    Hello = 1,
    Challenge = 2,
    Proof = 3,
    Sealed = 4,
    Error = 5,
}

impl Kind {
    pub(crate) fn from_byte(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Hello,
            2 => Kind::Challenge,
            3 => Kind::Proof,
            4 => Kind::Sealed,
            5 => Kind::Error,
            _ => return None,
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Hello => "HELLO",
            Kind::Challenge => "CHALLENGE",
            Kind::Proof => "PROOF",
            Kind::Sealed => "SEALED",
            Kind::Error => "ERROR",
        }
    }
}

/// The record types a SEALED frame carries.
pub(crate) const RECORD_OFFER: u8 = 1;
pub(crate) const RECORD_REFUSE: u8 = 2;

/// The header of every frame on kvflow's own connections, the side channel's and the links
/// an adapter binds to a session (kv-transport-tcp's data path): the length of what follows
/// (the kind and the body) as a `u32` big-endian, then the kind. Each protocol gives its kinds
/// and their bounds; this is only the framing they share.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FrameHeader {
    /// What the frame is, in its protocol's numbering.
    pub kind: u8,
    /// Bytes of the body (after the kind).
    pub body_len: usize,
}

impl FrameHeader {
    /// Bytes of a header.
    pub const BYTES: usize = HEADER_BYTES;

    /// The header's bytes. A body is bounded far below 4 GiB by every protocol's limits; a
    /// longer one is written as the longest length, which every receiver refuses.
    pub fn to_bytes(self) -> [u8; HEADER_BYTES] {
        let mut header = [0u8; HEADER_BYTES];
        let len = u32::try_from(self.body_len).ok().and_then(|n| n.checked_add(1)).unwrap_or(u32::MAX);
        header[..4].copy_from_slice(&len.to_be_bytes());
        header[4] = self.kind;
        header
    }

    /// A header from its bytes; `None` for a length of 0, which leaves no room for the kind.
    pub fn from_bytes(bytes: [u8; HEADER_BYTES]) -> Option<FrameHeader> {
        let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        Some(FrameHeader { kind: bytes[4], body_len: len.checked_sub(1)? })
    }
}

/// The length prefix and kind of a frame whose length field (kind and body) is `len`.
pub(crate) fn header(kind: Kind, len: usize) -> [u8; HEADER_BYTES] {
    FrameHeader { kind: kind as u8, body_len: len.saturating_sub(1) }.to_bytes()
}

/// A whole frame of `kind` around `body`.
pub(crate) fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER_BYTES + body.len());
    frame.extend_from_slice(&header(kind, 1 + body.len()));
    frame.extend_from_slice(body);
    frame
}

/// Who an agent says it is in HELLO or CHALLENGE.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Identity {
    pub(crate) role: Role,
    pub(crate) engine: EngineId,
    pub(crate) rank: u32,
    pub(crate) incarnation: u64,
}

impl Identity {
    pub(crate) fn of(offer: &Handshake) -> Self {
        Identity { role: offer.role, engine: offer.engine.clone(), rank: offer.rank, incarnation: offer.instance }
    }

    pub(crate) fn agent(&self) -> AgentName {
        AgentName::new(self.engine.clone(), self.rank)
    }

    /// Whether `offer` names this identity; else what differs, naming both values.
    pub(crate) fn check(&self, offer: &Handshake, said: &str) -> Result<(), String> {
        let offered = Identity::of(offer);
        if offered == *self {
            return Ok(());
        }
        Err(format!(
            "the offer names {} incarnation {} ({:?}) but the {said} named {} incarnation {} ({:?})",
            offered.agent(),
            offered.incarnation,
            offered.role,
            self.agent(),
            self.incarnation,
            self.role
        ))
    }

    /// The body of a HELLO, or of a CHALLENGE without its MAC: magic, version, the rank the
    /// initiator asks for (`target`, [`ANY_RANK`] for whichever listens), role, engine, rank,
    /// incarnation, nonce.
    pub(crate) fn body(&self, version: u16, target: u32, nonce: &[u8; 32]) -> Vec<u8> {
        let name = self.engine.as_str().as_bytes();
        let mut body = Vec::with_capacity(MAGIC.len() + 2 + 4 + 1 + 1 + name.len() + 4 + 8 + 32 + MAC_BYTES);
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&version.to_be_bytes());
        body.extend_from_slice(&target.to_be_bytes());
        body.push(match self.role {
            Role::Prefill => 0,
            Role::Decode => 1,
        });
        // Offers are checked when set: the name is 1..=64 bytes.
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&self.rank.to_be_bytes());
        body.extend_from_slice(&self.incarnation.to_be_bytes());
        body.extend_from_slice(nonce);
        body
    }
}

/// Why a HELLO or CHALLENGE body does not parse.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum ParseError {
    /// The side protocol version is not this build's.
    Version(u16),
    /// Anything else, as text for the refusal.
    Malformed(String),
}

/// A parsed HELLO or CHALLENGE.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Greeting {
    /// The rank the initiator asks for (a CHALLENGE repeats its HELLO's).
    pub(crate) target: u32,
    pub(crate) identity: Identity,
    pub(crate) nonce: [u8; 32],
    /// The CHALLENGE's MAC; `None` for a HELLO.
    pub(crate) mac: Option<[u8; MAC_BYTES]>,
}

/// Parses a HELLO body (`with_mac` false) or a CHALLENGE body (`with_mac` true).
pub(crate) fn parse_greeting(body: &[u8], version: u16, with_mac: bool) -> Result<Greeting, ParseError> {
    let mut r = Reader(body);
    let magic = r.take(MAGIC.len()).ok_or_else(|| short(body))?;
    if magic != MAGIC {
        return Err(ParseError::Malformed(format!(
            "not a kvflow side channel (starts with {:02x?})",
            &body[..body.len().min(MAGIC.len())]
        )));
    }
    let peer_version = u16::from_be_bytes(r.array().ok_or_else(|| short(body))?);
    if peer_version != version {
        return Err(ParseError::Version(peer_version));
    }
    let target = u32::from_be_bytes(r.array().ok_or_else(|| short(body))?);
    let role = role_of(r.byte().ok_or_else(|| short(body))?).map_err(ParseError::Malformed)?;
    let name_len = usize::from(r.byte().ok_or_else(|| short(body))?);
    if name_len == 0 || name_len > MAX_ENGINE_NAME_BYTES {
        return Err(ParseError::Malformed(format!(
            "engine name of {name_len} bytes is outside 1..={MAX_ENGINE_NAME_BYTES}"
        )));
    }
    let name = r.take(name_len).ok_or_else(|| short(body))?;
    let name =
        std::str::from_utf8(name).map_err(|_| ParseError::Malformed("engine name is not UTF-8".to_owned()))?.to_owned();
    let rank = u32::from_be_bytes(r.array().ok_or_else(|| short(body))?);
    let incarnation = u64::from_be_bytes(r.array().ok_or_else(|| short(body))?);
    let nonce = r.array().ok_or_else(|| short(body))?;
    let mac = if with_mac { Some(r.array().ok_or_else(|| short(body))?) } else { None };
    if !r.0.is_empty() {
        return Err(ParseError::Malformed(format!("{} trailing bytes", r.0.len())));
    }
    Ok(Greeting { target, identity: Identity { role, engine: EngineId::new(name), rank, incarnation }, nonce, mac })
}

/// The role a HELLO or CHALLENGE's role byte names.
pub(crate) fn role_of(byte: u8) -> Result<Role, String> {
    match byte {
        0 => Ok(Role::Prefill),
        1 => Ok(Role::Decode),
        other => Err(format!("role byte {other} is neither 0 nor 1")),
    }
}

fn short(body: &[u8]) -> ParseError {
    ParseError::Malformed(format!("truncated body of {} bytes", body.len()))
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn byte(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).map(|b| b.try_into().expect("took N bytes"))
    }
}

/// Text a peer sent (an ERROR or REFUSE body), made safe to put in an event: at most `max`
/// bytes, invalid UTF-8 replaced, control characters shown as `?`.
pub(crate) fn peer_text(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]);
    text.chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// `text` cut to at most `max` bytes, at a character boundary.
pub(crate) fn truncated(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity { role: Role::Decode, engine: EngineId::new("dec"), rank: 3, incarnation: 9 }
    }

    #[test]
    fn a_header_counts_the_kind_in_its_big_endian_length() {
        let challenge = FrameHeader { kind: 0x84, body_len: 0x0102 };
        assert_eq!(challenge.to_bytes(), [0, 0, 0x01, 0x03, 0x84]);
        assert_eq!(FrameHeader::from_bytes(challenge.to_bytes()), Some(challenge));
        assert_eq!(FrameHeader::from_bytes([0, 0, 0, 0, 1]), None, "no room for the kind");
        assert_eq!(FrameHeader::from_bytes([0, 0, 0, 1, 7]), Some(FrameHeader { kind: 7, body_len: 0 }));
        assert_eq!(header(Kind::Error, 3), [0, 0, 0, 3, 5]);
    }

    #[test]
    fn greetings_round_trip() {
        let body = identity().body(1, 3, &[7; 32]);
        assert_eq!(
            parse_greeting(&body, 1, false),
            Ok(Greeting { target: 3, identity: identity(), nonce: [7; 32], mac: None })
        );
        let mut challenge = body.clone();
        challenge.extend_from_slice(&[5; 32]);
        assert_eq!(parse_greeting(&challenge, 1, true).unwrap().mac, Some([5; 32]));
        assert_eq!(parse_greeting(&challenge, 1, false), Err(ParseError::Malformed("32 trailing bytes".into())));
    }

    #[test]
    fn bad_greetings_say_what_is_wrong() {
        let body = identity().body(1, ANY_RANK, &[7; 32]);
        assert_eq!(parse_greeting(&body, 2, false), Err(ParseError::Version(1)));
        assert_eq!(
            parse_greeting(b"GET / HTTP/1.1", 1, false),
            Err(ParseError::Malformed("not a kvflow side channel (starts with [47, 45, 54, 20])".into()))
        );
        assert_eq!(
            parse_greeting(&body[..20], 1, false),
            Err(ParseError::Malformed("truncated body of 20 bytes".into()))
        );
        let mut role = body.clone();
        role[10] = 7;
        assert_eq!(
            parse_greeting(&role, 1, false),
            Err(ParseError::Malformed("role byte 7 is neither 0 nor 1".into()))
        );
        let mut empty = body.clone();
        empty[11] = 0;
        assert_eq!(
            parse_greeting(&empty, 1, false),
            Err(ParseError::Malformed("engine name of 0 bytes is outside 1..=64".into()))
        );
    }

    #[test]
    fn peer_text_is_bounded_and_printable() {
        assert_eq!(peer_text(b"bad\nthing\xff", 200), "bad?thing\u{fffd}");
        assert_eq!(peer_text(b"abcdef", 3), "abc");
        assert_eq!(truncated("héllo", 2), "h");
    }
}
