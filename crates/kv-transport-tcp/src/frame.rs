//! The data connection's frames (laid out in the crate docs) and the socket loops that move
//! them with deadlines: nothing here touches registered memory.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kv_core::side::{
    FrameHeader, FrameTags, LINK_MAC_BYTES, LINK_TAG_BYTES, MAX_ENGINE_NAME_BYTES, NOTIFICATION_OVERHEAD,
};
use kv_core::wire::MAX_MESSAGE_BYTES;
use kv_core::{AgentName, EngineId};

/// The label data links derive their secret from the side-channel session under
/// (`kv_core::side::SideEndpoint::link_secret`).
pub(crate) const LINK_LABEL: &str = "kvflow-tcp-data-v2";
/// Bytes of a frame header: the side channel's ([`FrameHeader`]), length u32 BE, kind u8.
pub(crate) const HEADER_BYTES: usize = FrameHeader::BYTES;
/// Bytes of a frame tag.
pub(crate) const TAG_BYTES: usize = LINK_TAG_BYTES;
/// Bytes of a link nonce.
pub(crate) const NONCE_BYTES: usize = 32;
/// HELLO and CHALLENGE flag: tag the payload bytes of what you send me (DATA, WRITE).
pub(crate) const FLAG_PAYLOAD_TAGS: u8 = 1;
/// The most data bytes one DATA or WRITE frame carries.
pub const MAX_CHUNK: usize = 1 << 20;
/// The most ranges one READ frame names.
pub const MAX_RANGES_PER_READ: usize = 4096;
/// The largest sealed notification a WRITE_END or NOTIFY frame carries.
pub const MAX_SEALED_NOTIFICATION: usize = MAX_MESSAGE_BYTES + NOTIFICATION_OVERHEAD;
/// HELLO's first bytes.
const HELLO_MAGIC: &[u8; 4] = b"KVTD";
/// The data protocol version HELLO carries.
pub(crate) const DATA_PROTOCOL_VERSION: u8 = 3;
/// HELLO's bytes before the engine name: magic, version, flags, nonce, incarnation, rank.
const HELLO_FIXED: usize = 4 + 1 + 1 + NONCE_BYTES + 8 + 4;
/// The most bytes a HELLO's body has.
pub(crate) const MAX_HELLO_BYTES: usize = HELLO_FIXED + MAX_ENGINE_NAME_BYTES;
/// CHALLENGE's body: the listener's nonce, its flags, its MAC.
const CHALLENGE_BYTES: usize = NONCE_BYTES + 1 + LINK_MAC_BYTES;
/// Bytes before the data in DATA (transfer, pair, offset) and WRITE (transfer, pair, address).
pub(crate) const CHUNK_PREFIX: usize = 8 + 4 + 8;
/// READ's bytes before its ranges.
const READ_PREFIX: usize = 8 + 4 + 4;

/// How often a blocked socket call comes back to check whether it should stop.
pub(crate) const TICK: Duration = Duration::from_millis(100);
/// How long the rest of a frame may take once its header arrived, and how long a write may
/// block: registered memory is held (against `deregister`) for at most about this long.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A frame's kind.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    Hello = 0x01,
    Read = 0x02,
    Write = 0x03,
    WriteEnd = 0x04,
    Notify = 0x05,
    Proof = 0x06,
    Data = 0x81,
    RangeError = 0x82,
    WriteAck = 0x83,
    Challenge = 0x84,
}

/// The kinds a listener accepts after HELLO.
pub(crate) const TO_LISTENER: &[Kind] = &[Kind::Read, Kind::Write, Kind::WriteEnd, Kind::Notify];
/// The kinds a connecting agent accepts.
pub(crate) const TO_CONNECTOR: &[Kind] = &[Kind::Data, Kind::RangeError, Kind::WriteAck];

impl Kind {
    fn from_byte(byte: u8) -> Option<Kind> {
        [
            Kind::Hello,
            Kind::Read,
            Kind::Write,
            Kind::WriteEnd,
            Kind::Notify,
            Kind::Proof,
            Kind::Data,
            Kind::RangeError,
            Kind::WriteAck,
            Kind::Challenge,
        ]
        .into_iter()
        .find(|k| *k as u8 == byte)
    }

    /// The body lengths a frame of this kind may have.
    fn bounds(self) -> (usize, usize) {
        match self {
            Kind::Hello => (HELLO_FIXED + 1, MAX_HELLO_BYTES),
            Kind::Read => (READ_PREFIX + 16, READ_PREFIX + 16 * MAX_RANGES_PER_READ),
            Kind::Write | Kind::Data => (CHUNK_PREFIX + 1, CHUNK_PREFIX + MAX_CHUNK),
            Kind::WriteEnd => (9, 9 + MAX_SEALED_NOTIFICATION),
            Kind::Notify => (1, MAX_SEALED_NOTIFICATION),
            Kind::RangeError => (28, 28),
            Kind::WriteAck => (29, 29),
            Kind::Challenge => (CHALLENGE_BYTES, CHALLENGE_BYTES),
            Kind::Proof => (LINK_MAC_BYTES, LINK_MAC_BYTES),
        }
    }

    /// Bytes of a body that its tag covers with the header: all of it, but for the chunks,
    /// whose data follows their tag (and carries a tag of its own when asked for).
    pub(crate) fn control_len(self, len: usize) -> usize {
        match self {
            Kind::Write | Kind::Data => CHUNK_PREFIX,
            _ => len,
        }
    }
}

/// A frame header, checked against what the receiver accepts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) len: usize,
}

/// Parses a header; the error says what is wrong, for the refusal.
pub(crate) fn parse_header(bytes: [u8; HEADER_BYTES], allowed: &[Kind]) -> Result<Header, String> {
    let header = FrameHeader::from_bytes(bytes).ok_or("a frame of length 0, with no room for its kind")?;
    let kind = Kind::from_byte(header.kind)
        .filter(|k| allowed.contains(k))
        .ok_or_else(|| format!("frame kind {:#04x} is not one this side accepts here", header.kind))?;
    let len = header.body_len;
    let (min, max) = kind.bounds();
    if len < min || len > max {
        return Err(format!("{kind:?} frame of {len} bytes is outside its {min}..={max}"));
    }
    Ok(Header { kind, len })
}

/// A header for a frame of `kind` with a body of `len` bytes: the side channel's framing.
pub(crate) fn header(kind: Kind, len: usize) -> [u8; HEADER_BYTES] {
    FrameHeader { kind: kind as u8, body_len: len }.to_bytes()
}

/// A whole small frame, untagged: the link's greetings, before it has keys.
fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.extend_from_slice(&header(kind, body.len()));
    out.extend_from_slice(body);
    out
}

/// Appends a tagged frame of `kind` with `body` (all of it control) to `out`.
fn push_tagged(out: &mut Vec<u8>, tags: &mut FrameTags, kind: Kind, body: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&header(kind, body.len()));
    out.extend_from_slice(body);
    let tag = tags.tag(&out[start..]);
    out.extend_from_slice(&tag);
}

/// A whole tagged frame of `kind` with `body` (all of it control).
fn tagged(tags: &mut FrameTags, kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len() + TAG_BYTES);
    push_tagged(&mut out, tags, kind, body);
    out
}

pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// What HELLO says: who connects, its nonce, and whether it wants its payloads tagged.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Hello {
    pub(crate) agent: AgentName,
    pub(crate) incarnation: u64,
    pub(crate) nonce: [u8; NONCE_BYTES],
    pub(crate) payload_tags: bool,
}

/// HELLO: `"KVTD" | version u8 | flags u8 | nonce [32] | incarnation u64 | rank u32 | engine`.
pub(crate) fn hello(hello: &Hello) -> Vec<u8> {
    let mut body = Vec::with_capacity(HELLO_FIXED + hello.agent.engine.as_str().len());
    body.extend_from_slice(HELLO_MAGIC);
    body.push(DATA_PROTOCOL_VERSION);
    body.push(if hello.payload_tags { FLAG_PAYLOAD_TAGS } else { 0 });
    body.extend_from_slice(&hello.nonce);
    body.extend_from_slice(&hello.incarnation.to_le_bytes());
    body.extend_from_slice(&hello.agent.rank.to_le_bytes());
    body.extend_from_slice(hello.agent.engine.as_str().as_bytes());
    frame(Kind::Hello, &body)
}

/// Parses HELLO's body (its length already checked).
pub(crate) fn parse_hello(body: &[u8]) -> Result<Hello, String> {
    if &body[..4] != HELLO_MAGIC {
        return Err("HELLO does not start with \"KVTD\"".into());
    }
    if body[4] != DATA_PROTOCOL_VERSION {
        return Err(format!("data protocol version {}, this side speaks {DATA_PROTOCOL_VERSION}", body[4]));
    }
    let flags = body[5];
    if flags & !FLAG_PAYLOAD_TAGS != 0 {
        return Err(format!("HELLO flags {flags:#04x} name options this side does not know"));
    }
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&body[6..6 + NONCE_BYTES]);
    let incarnation = u64_at(body, 6 + NONCE_BYTES);
    let rank = u32_at(body, 14 + NONCE_BYTES);
    let engine = std::str::from_utf8(&body[HELLO_FIXED..]).map_err(|_| "HELLO's engine name is not UTF-8")?;
    let agent = AgentName::new(EngineId::new(engine), rank);
    Ok(Hello { agent, incarnation, nonce, payload_tags: flags & FLAG_PAYLOAD_TAGS != 0 })
}

/// What CHALLENGE says: the listener's nonce, whether it wants its payloads tagged, its MAC.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Challenge {
    pub(crate) nonce: [u8; NONCE_BYTES],
    pub(crate) payload_tags: bool,
    pub(crate) mac: [u8; LINK_MAC_BYTES],
}

/// CHALLENGE without its MAC, as the transcript takes it: header, nonce, flags.
pub(crate) fn challenge_unmacked(nonce: &[u8; NONCE_BYTES], payload_tags: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + CHALLENGE_BYTES);
    out.extend_from_slice(&header(Kind::Challenge, CHALLENGE_BYTES));
    out.extend_from_slice(nonce);
    out.push(if payload_tags { FLAG_PAYLOAD_TAGS } else { 0 });
    out
}

/// Parses CHALLENGE's body (its length already checked).
pub(crate) fn parse_challenge(body: &[u8]) -> Result<Challenge, String> {
    let flags = body[NONCE_BYTES];
    if flags & !FLAG_PAYLOAD_TAGS != 0 {
        return Err(format!("CHALLENGE flags {flags:#04x} name options this side does not know"));
    }
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&body[..NONCE_BYTES]);
    let mut mac = [0u8; LINK_MAC_BYTES];
    mac.copy_from_slice(&body[NONCE_BYTES + 1..]);
    Ok(Challenge { nonce, payload_tags: flags & FLAG_PAYLOAD_TAGS != 0, mac })
}

/// PROOF: the connector's MAC.
pub(crate) fn proof(mac: &[u8; LINK_MAC_BYTES]) -> Vec<u8> {
    frame(Kind::Proof, mac)
}

/// READ frames for `ranges` (remote address, length) of `transfer`, at most
/// [`MAX_RANGES_PER_READ`] a frame, each tagged.
pub(crate) fn reads(tags: &mut FrameTags, transfer: u64, ranges: &[(u64, u64)]) -> Vec<u8> {
    let frames = ranges.len() / MAX_RANGES_PER_READ + 1;
    let mut out = Vec::with_capacity(ranges.len() * 16 + frames * (HEADER_BYTES + READ_PREFIX + TAG_BYTES));
    let mut body = Vec::with_capacity(READ_PREFIX + 16 * ranges.len().min(MAX_RANGES_PER_READ));
    for (i, batch) in ranges.chunks(MAX_RANGES_PER_READ).enumerate() {
        body.clear();
        body.extend_from_slice(&transfer.to_le_bytes());
        body.extend_from_slice(&((i * MAX_RANGES_PER_READ) as u32).to_le_bytes());
        body.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        for &(addr, len) in batch {
            body.extend_from_slice(&addr.to_le_bytes());
            body.extend_from_slice(&len.to_le_bytes());
        }
        push_tagged(&mut out, tags, Kind::Read, &body);
    }
    out
}

/// What a READ frame asks for.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct ReadRequest {
    pub(crate) transfer: u64,
    /// The pair index of the first range; the others follow it.
    pub(crate) first: u32,
    /// (listener's address, length) per range.
    pub(crate) ranges: Vec<(u64, u64)>,
}

/// Parses a READ frame's body; its length must match its count.
pub(crate) fn parse_read(body: &[u8]) -> Result<ReadRequest, String> {
    let count = u32_at(body, 12) as usize;
    if count == 0 || body.len() != READ_PREFIX + 16 * count {
        return Err(format!("READ frame of {} bytes says {count} ranges", body.len()));
    }
    let ranges = body[READ_PREFIX..].chunks_exact(16).map(|r| (u64_at(r, 0), u64_at(r, 8))).collect();
    Ok(ReadRequest { transfer: u64_at(body, 0), first: u32_at(body, 8), ranges })
}

/// Bytes of a chunk's head: header, prefix and the tag of both.
pub(crate) const CHUNK_HEAD_BYTES: usize = HEADER_BYTES + CHUNK_PREFIX + TAG_BYTES;

/// The head of a DATA or WRITE chunk of `data_len` bytes: header, `transfer | pair | x` (`x`
/// being the offset within the pair for DATA, the listener's address for WRITE) and their tag.
/// The data follows, then its own tag if the receiver asked for payload tags.
pub(crate) fn chunk_head(
    tags: &mut FrameTags,
    kind: Kind,
    transfer: u64,
    pair: u32,
    x: u64,
    data_len: usize,
) -> [u8; CHUNK_HEAD_BYTES] {
    let mut out = [0u8; CHUNK_HEAD_BYTES];
    out[..HEADER_BYTES].copy_from_slice(&header(kind, CHUNK_PREFIX + data_len));
    out[5..13].copy_from_slice(&transfer.to_le_bytes());
    out[13..17].copy_from_slice(&pair.to_le_bytes());
    out[17..25].copy_from_slice(&x.to_le_bytes());
    let tag = tags.tag(&out[..HEADER_BYTES + CHUNK_PREFIX]);
    out[HEADER_BYTES + CHUNK_PREFIX..].copy_from_slice(&tag);
    out
}

/// WRITE_END: `transfer | flags u8 (bit 0: aborted by the sender) | sealed notification`.
pub(crate) fn write_end(tags: &mut FrameTags, transfer: u64, aborted: bool, sealed: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(9 + sealed.len());
    body.extend_from_slice(&transfer.to_le_bytes());
    body.push(u8::from(aborted));
    body.extend_from_slice(sealed);
    tagged(tags, Kind::WriteEnd, &body)
}

/// NOTIFY: a sealed notification.
pub(crate) fn notify(tags: &mut FrameTags, sealed: &[u8]) -> Vec<u8> {
    tagged(tags, Kind::Notify, sealed)
}

/// RANGE_ERROR: `transfer | pair u32 | addr | len`, a READ range the listener refused.
pub(crate) fn range_error(tags: &mut FrameTags, transfer: u64, pair: u32, addr: u64, len: u64) -> Vec<u8> {
    let mut body = Vec::with_capacity(28);
    body.extend_from_slice(&transfer.to_le_bytes());
    body.extend_from_slice(&pair.to_le_bytes());
    body.extend_from_slice(&addr.to_le_bytes());
    body.extend_from_slice(&len.to_le_bytes());
    tagged(tags, Kind::RangeError, &body)
}

/// How a WRITE ended at the listener.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum AckStatus {
    /// Every byte is in the listener's memory.
    Written = 0,
    /// A range was not inside the listener's registrations: `(pair, addr, len)`.
    NotRegistered = 1,
    /// The sender aborted it.
    Aborted = 2,
}

/// WRITE_ACK: `transfer | status u8 | pair u32 | addr | len` (zeros unless NotRegistered).
pub(crate) fn write_ack(tags: &mut FrameTags, transfer: u64, status: AckStatus, refused: (u32, u64, u64)) -> Vec<u8> {
    let mut body = Vec::with_capacity(29);
    body.extend_from_slice(&transfer.to_le_bytes());
    body.push(status as u8);
    body.extend_from_slice(&refused.0.to_le_bytes());
    body.extend_from_slice(&refused.1.to_le_bytes());
    body.extend_from_slice(&refused.2.to_le_bytes());
    tagged(tags, Kind::WriteAck, &body)
}

/// Why a frame was not taken.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The socket failed, timed out, or was told to stop.
    Io(io::Error),
    /// The frame broke the protocol (kind, length, body).
    Malformed(String),
    /// Its tag is not the one the link's session makes next: forged, replayed or altered.
    Forged(String),
}

impl From<io::Error> for Refused {
    fn from(e: io::Error) -> Self {
        Refused::Io(e)
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Io(e) => write!(f, "{e}"),
            Refused::Malformed(reason) => write!(f, "{reason}"),
            Refused::Forged(reason) => write!(f, "{reason}"),
        }
    }
}

/// A frame's header and control bytes, its tag verified.
pub(crate) struct Control {
    pub(crate) header: Header,
    /// The body, or for a chunk its prefix.
    pub(crate) body: Vec<u8>,
    /// When the rest of the frame must have arrived.
    pub(crate) deadline: Instant,
}

/// Reads the next frame's header (waiting as long as `stop` allows) and its control bytes (within
/// [`STALL_TIMEOUT`]), and checks their tag: nothing of a frame is acted on before that.
pub(crate) fn read_control(
    stream: &TcpStream,
    allowed: &[Kind],
    tags: &mut FrameTags,
    stop: &dyn Fn(usize) -> bool,
) -> Result<Control, Refused> {
    let mut head = [0u8; HEADER_BYTES];
    read_full(stream, &mut head, None, stop)?;
    let header = parse_header(head, allowed).map_err(Refused::Malformed)?;
    let deadline = Instant::now() + STALL_TIMEOUT;
    let control = header.kind.control_len(header.len);
    let mut bytes = vec![0u8; HEADER_BYTES + control + TAG_BYTES];
    bytes[..HEADER_BYTES].copy_from_slice(&head);
    read_full(stream, &mut bytes[HEADER_BYTES..], Some(deadline), stop)?;
    let (covered, tag) = bytes.split_at(HEADER_BYTES + control);
    if !tags.verify(covered, tag) {
        return Err(Refused::Forged(format!(
            "{:?} frame {} of this link has a bad tag (forged, replayed or altered)",
            header.kind,
            tags.count()
        )));
    }
    bytes.truncate(HEADER_BYTES + control);
    bytes.drain(..HEADER_BYTES);
    Ok(Control { header, body: bytes, deadline })
}

/// Reads a payload's tag, if the link tags payloads, and checks it over `payload`.
pub(crate) fn check_payload(
    stream: &TcpStream,
    tags: Option<&mut FrameTags>,
    payload: &[u8],
    deadline: Instant,
    stop: &dyn Fn(usize) -> bool,
) -> Result<(), Refused> {
    let Some(tags) = tags else { return Ok(()) };
    let mut tag = [0u8; TAG_BYTES];
    read_full(stream, &mut tag, Some(deadline), stop)?;
    if tags.verify(payload, &tag) {
        Ok(())
    } else {
        Err(Refused::Forged(format!("a payload of {} bytes has a bad tag (altered on the way)", payload.len())))
    }
}

/// Reads all of `buf`. A blocked read comes back every [`TICK`] to ask `stop` (given the bytes
/// read so far) whether to give up, and gives up with `TimedOut` past `deadline`.
pub(crate) fn read_full(
    stream: &TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: &dyn Fn(usize) -> bool,
) -> io::Result<()> {
    let mut reader = stream;
    let mut at = 0;
    while at < buf.len() {
        match reader.read(&mut buf[at..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if stop(at) {
                    return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "stopped"));
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer stalled within a frame"));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf`, giving up with `TimedOut` after [`STALL_TIMEOUT`] or when `stop` says.
pub(crate) fn write_full(stream: &TcpStream, buf: &[u8], stop: &dyn Fn() -> bool) -> io::Result<()> {
    let mut writer = stream;
    let deadline = Instant::now() + STALL_TIMEOUT;
    let mut at = 0;
    while at < buf.len() {
        match writer.write(&buf[at..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => at += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if stop() {
                    return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "stopped"));
                }
                if Instant::now() >= deadline {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer stopped reading"));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops `len` bytes of a chunk that may not be stored, and its payload tag if the
/// link tags payloads (stepped over unchecked: nothing acts on the bytes it covers).
pub(crate) fn discard(
    stream: &TcpStream,
    len: usize,
    tags: Option<&mut FrameTags>,
    stop: &dyn Fn(usize) -> bool,
) -> io::Result<()> {
    let left = len + tags.as_ref().map_or(0, |_| TAG_BYTES);
    let mut scratch = vec![0u8; left.min(64 * 1024)];
    let deadline = Instant::now() + STALL_TIMEOUT;
    let mut left = left;
    while left > 0 {
        let n = left.min(scratch.len());
        read_full(stream, &mut scratch[..n], Some(deadline), stop)?;
        left -= n;
    }
    if let Some(tags) = tags {
        tags.skip();
    }
    Ok(())
}

/// Sets a data socket up: no Nagle delay, and blocking calls that come back every [`TICK`].
pub(crate) fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(TICK))?;
    stream.set_write_timeout(Some(TICK))
}

#[cfg(test)]
mod tests {
    use kv_core::side::{LinkRole, LinkSecret};

    use super::*;

    /// Both ends' tags of one link: the connector's (out, in), the listener's (out, in).
    fn link() -> ((FrameTags, FrameTags), (FrameTags, FrameTags)) {
        let secret = LinkSecret::from_bytes([5; 32], 1);
        let connector = secret.frame_tags(LinkRole::Connector, &[1; 32], &[2; 32], b"transcript");
        let listener = secret.frame_tags(LinkRole::Listener, &[1; 32], &[2; 32], b"transcript");
        (connector, listener)
    }

    #[test]
    fn headers_outside_their_kind_bounds_are_refused() {
        let check = |bytes: [u8; 5], allowed: &[Kind], expected: Result<Header, &str>| {
            let got = parse_header(bytes, allowed);
            match expected {
                Ok(h) => assert_eq!(got, Ok(h)),
                Err(text) => assert!(got.as_ref().unwrap_err().contains(text), "{got:?} does not say {text:?}"),
            }
        };
        check(header(Kind::Notify, 10), TO_LISTENER, Ok(Header { kind: Kind::Notify, len: 10 }));
        check(header(Kind::Notify, MAX_SEALED_NOTIFICATION + 1), TO_LISTENER, Err("outside its 1..="));
        check(header(Kind::Write, CHUNK_PREFIX + MAX_CHUNK + 1), TO_LISTENER, Err("Write frame of"));
        check(header(Kind::Data, 100), TO_LISTENER, Err("kind 0x81 is not one"));
        check(header(Kind::Hello, 60), TO_LISTENER, Err("kind 0x01 is not one"));
        check([0, 0, 0, 1, 0xff], TO_CONNECTOR, Err("kind 0xff"));
        check([0, 0, 0, 0, Kind::Notify as u8], TO_LISTENER, Err("length 0"));
        check(header(Kind::WriteAck, 28), TO_CONNECTOR, Err("outside its 29..=29"));
        check([0xff, 0xff, 0xff, 0xff, Kind::Hello as u8], &[Kind::Hello], Err("4294967294 bytes"));
        // The side channel's framing: the length, big-endian, counts the kind.
        assert_eq!(header(Kind::Notify, 10), [0, 0, 0, 11, 0x05]);
    }

    #[test]
    fn the_bounds_are_the_ones_the_crate_docs_state() {
        assert_eq!(MAX_SEALED_NOTIFICATION, 65562);
        assert_eq!(Kind::Hello.bounds(), (51, 114));
        assert_eq!(Kind::Challenge.bounds(), (65, 65));
        assert_eq!(Kind::Proof.bounds(), (32, 32));
        assert_eq!(Kind::Read.bounds(), (32, 16 + 16 * 4096));
        assert_eq!(Kind::Write.bounds(), (21, 20 + (1 << 20)));
        assert_eq!(Kind::WriteEnd.bounds(), (9, 9 + 65562));
        assert_eq!(Kind::Notify.bounds(), (1, 65562));
        assert_eq!(CHUNK_HEAD_BYTES, 41);
    }

    #[test]
    fn greetings_round_trip_and_refuse_strangers() {
        let agent = AgentName::new(EngineId::new("decode-0"), 3);
        let sent = Hello { agent, incarnation: 77, nonce: [9; NONCE_BYTES], payload_tags: true };
        let bytes = hello(&sent);
        let head = parse_header(bytes[..5].try_into().unwrap(), &[Kind::Hello]).unwrap();
        assert_eq!(head.len, bytes.len() - HEADER_BYTES);
        assert_eq!(parse_hello(&bytes[HEADER_BYTES..]).unwrap(), sent);
        let mut other = bytes[HEADER_BYTES..].to_vec();
        other[5] = 0x82;
        assert!(parse_hello(&other).unwrap_err().contains("flags 0x82"));
        other[4] = 1;
        assert!(parse_hello(&other).unwrap_err().contains("version 1, this side speaks 3"));
        other[0] = b'X';
        assert!(parse_hello(&other).unwrap_err().contains("KVTD"));

        let mut challenge = challenge_unmacked(&[4; NONCE_BYTES], false);
        challenge.extend_from_slice(&[6; LINK_MAC_BYTES]);
        let head = parse_header(challenge[..5].try_into().unwrap(), &[Kind::Challenge]).unwrap();
        assert_eq!(head.len, challenge.len() - HEADER_BYTES);
        let parsed = parse_challenge(&challenge[HEADER_BYTES..]).unwrap();
        assert_eq!(parsed, Challenge { nonce: [4; NONCE_BYTES], payload_tags: false, mac: [6; LINK_MAC_BYTES] });
        assert_eq!(proof(&[3; LINK_MAC_BYTES]).len(), HEADER_BYTES + LINK_MAC_BYTES);
    }

    #[test]
    fn reads_split_into_tagged_frames_of_at_most_4096_ranges() {
        let ((mut out, _), (_, mut verify)) = link();
        let ranges: Vec<(u64, u64)> = (0..MAX_RANGES_PER_READ as u64 + 5).map(|i| (i * 10, 10)).collect();
        let bytes = reads(&mut out, 42, &ranges);
        let first = parse_header(bytes[..5].try_into().unwrap(), TO_LISTENER).unwrap();
        let end = 5 + first.len;
        assert!(verify.verify(&bytes[..end], &bytes[end..end + TAG_BYTES]), "the first frame's tag");
        let read = parse_read(&bytes[5..end]).unwrap();
        assert_eq!((read.transfer, read.first, read.ranges.len()), (42, 0, MAX_RANGES_PER_READ));
        let rest = &bytes[end + TAG_BYTES..];
        let second = parse_header(rest[..5].try_into().unwrap(), TO_LISTENER).unwrap();
        assert!(verify.verify(&rest[..5 + second.len], &rest[5 + second.len..]), "the second frame's tag");
        let read = parse_read(&rest[5..5 + second.len]).unwrap();
        assert_eq!((read.first as usize, read.ranges), (MAX_RANGES_PER_READ, ranges[MAX_RANGES_PER_READ..].to_vec()));
        assert!(parse_read(&[0; 32]).unwrap_err().contains("says 0 ranges"));
    }

    #[test]
    fn a_frame_is_taken_only_with_the_next_tag_of_its_link() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut sender = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (receiver, _) = listener.accept().unwrap();
        configure(&receiver).unwrap();
        let ((mut out, _), (_, mut incoming)) = link();
        let never = |_: usize| false;
        let first = notify(&mut out, b"first");
        let second = notify(&mut out, b"second");
        // The second frame first: its tag is not the next one.
        sender.write_all(&second).unwrap();
        let refused = read_control(&receiver, TO_LISTENER, &mut incoming, &never).err().unwrap();
        assert!(matches!(refused, Refused::Forged(ref r) if r.contains("bad tag")), "{refused}");
        // In order, both are taken; a replay of the first is not.
        let (receiver, mut sender) = {
            let mut sender = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (receiver, _) = listener.accept().unwrap();
            configure(&receiver).unwrap();
            sender.write_all(&first).unwrap();
            (receiver, sender)
        };
        let ((_, _), (_, mut incoming)) = link();
        assert_eq!(read_control(&receiver, TO_LISTENER, &mut incoming, &never).unwrap().body, b"first");
        sender.write_all(&second).unwrap();
        assert_eq!(read_control(&receiver, TO_LISTENER, &mut incoming, &never).unwrap().body, b"second");
        sender.write_all(&first).unwrap();
        assert!(matches!(read_control(&receiver, TO_LISTENER, &mut incoming, &never), Err(Refused::Forged(_))));
        // An altered byte anywhere the tag covers is refused too.
        let ((mut out, _), (_, mut incoming)) = link();
        let mut altered = notify(&mut out, b"payload");
        altered[HEADER_BYTES] ^= 1;
        sender.write_all(&altered).unwrap();
        assert!(matches!(read_control(&receiver, TO_LISTENER, &mut incoming, &never), Err(Refused::Forged(_))));
    }
}
