//! The data connection's frames (laid out in the crate docs) and the socket loops that move
//! them with deadlines: nothing here touches registered memory.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kv_core::side::{MAX_ENGINE_NAME_BYTES, NOTIFICATION_OVERHEAD};
use kv_core::wire::MAX_MESSAGE_BYTES;
use kv_core::{AgentName, EngineId};

use crate::metadata::TOKEN_BYTES;

/// Bytes of a frame header: kind u8, body length u32.
pub(crate) const HEADER_BYTES: usize = 5;
/// The most data bytes one DATA or WRITE frame carries.
pub const MAX_CHUNK: usize = 1 << 20;
/// The most ranges one READ frame names.
pub const MAX_RANGES_PER_READ: usize = 4096;
/// The largest sealed notification a WRITE_END or NOTIFY frame carries.
pub const MAX_SEALED_NOTIFICATION: usize = MAX_MESSAGE_BYTES + NOTIFICATION_OVERHEAD;
/// HELLO's first bytes.
const HELLO_MAGIC: &[u8; 4] = b"KVTD";
/// The data protocol version HELLO carries.
pub(crate) const DATA_PROTOCOL_VERSION: u8 = 1;
/// HELLO's bytes before the engine name.
const HELLO_FIXED: usize = 4 + 1 + TOKEN_BYTES + 8 + 4;
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
    Data = 0x81,
    RangeError = 0x82,
    WriteAck = 0x83,
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
            Kind::Data,
            Kind::RangeError,
            Kind::WriteAck,
        ]
        .into_iter()
        .find(|k| *k as u8 == byte)
    }

    /// The body lengths a frame of this kind may have.
    fn bounds(self) -> (usize, usize) {
        match self {
            Kind::Hello => (HELLO_FIXED + 1, HELLO_FIXED + MAX_ENGINE_NAME_BYTES),
            Kind::Read => (READ_PREFIX + 16, READ_PREFIX + 16 * MAX_RANGES_PER_READ),
            Kind::Write | Kind::Data => (CHUNK_PREFIX + 1, CHUNK_PREFIX + MAX_CHUNK),
            Kind::WriteEnd => (9, 9 + MAX_SEALED_NOTIFICATION),
            Kind::Notify => (1, MAX_SEALED_NOTIFICATION),
            Kind::RangeError => (28, 28),
            Kind::WriteAck => (29, 29),
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
    let kind = Kind::from_byte(bytes[0])
        .filter(|k| allowed.contains(k))
        .ok_or_else(|| format!("frame kind {:#04x} is not one this side accepts here", bytes[0]))?;
    let len = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    let (min, max) = kind.bounds();
    if len < min || len > max {
        return Err(format!("{kind:?} frame of {len} bytes is outside its {min}..={max}"));
    }
    Ok(Header { kind, len })
}

/// A header for a frame of `kind` with a body of `len` bytes.
pub(crate) fn header(kind: Kind, len: usize) -> [u8; HEADER_BYTES] {
    let l = (len as u32).to_le_bytes();
    [kind as u8, l[0], l[1], l[2], l[3]]
}

/// A whole small frame.
fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.extend_from_slice(&header(kind, body.len()));
    out.extend_from_slice(body);
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

/// What HELLO says: the listener's token, and who connects.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Hello {
    pub(crate) token: [u8; TOKEN_BYTES],
    pub(crate) agent: AgentName,
    pub(crate) incarnation: u64,
}

/// HELLO: `"KVTD" | version u8 | token [32] | incarnation u64 | rank u32 | engine name`.
pub(crate) fn hello(token: &[u8; TOKEN_BYTES], agent: &AgentName, incarnation: u64) -> Vec<u8> {
    let mut body = Vec::with_capacity(HELLO_FIXED + agent.engine.as_str().len());
    body.extend_from_slice(HELLO_MAGIC);
    body.push(DATA_PROTOCOL_VERSION);
    body.extend_from_slice(token);
    body.extend_from_slice(&incarnation.to_le_bytes());
    body.extend_from_slice(&agent.rank.to_le_bytes());
    body.extend_from_slice(agent.engine.as_str().as_bytes());
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
    let mut token = [0u8; TOKEN_BYTES];
    token.copy_from_slice(&body[5..5 + TOKEN_BYTES]);
    let incarnation = u64_at(body, 5 + TOKEN_BYTES);
    let rank = u32_at(body, 13 + TOKEN_BYTES);
    let engine = std::str::from_utf8(&body[HELLO_FIXED..]).map_err(|_| "HELLO's engine name is not UTF-8")?;
    Ok(Hello { token, agent: AgentName::new(EngineId::new(engine), rank), incarnation })
}

/// Compares two tokens in time that does not depend on where they differ.
pub(crate) fn same_token(a: &[u8; TOKEN_BYTES], b: &[u8; TOKEN_BYTES]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// READ frames for `ranges` (remote address, length) of `transfer`, at most
/// [`MAX_RANGES_PER_READ`] a frame.
pub(crate) fn reads(transfer: u64, ranges: &[(u64, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ranges.len() * 16 + (ranges.len() / MAX_RANGES_PER_READ + 1) * 21);
    for (i, batch) in ranges.chunks(MAX_RANGES_PER_READ).enumerate() {
        out.extend_from_slice(&header(Kind::Read, READ_PREFIX + 16 * batch.len()));
        out.extend_from_slice(&transfer.to_le_bytes());
        out.extend_from_slice(&((i * MAX_RANGES_PER_READ) as u32).to_le_bytes());
        out.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        for &(addr, len) in batch {
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
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

/// The header and prefix of a DATA or WRITE chunk of `data_len` bytes: `transfer | pair | x`,
/// `x` being the offset within the pair (DATA) or the listener's address (WRITE).
pub(crate) fn chunk_head(
    kind: Kind,
    transfer: u64,
    pair: u32,
    x: u64,
    data_len: usize,
) -> [u8; HEADER_BYTES + CHUNK_PREFIX] {
    let mut out = [0u8; HEADER_BYTES + CHUNK_PREFIX];
    out[..HEADER_BYTES].copy_from_slice(&header(kind, CHUNK_PREFIX + data_len));
    out[5..13].copy_from_slice(&transfer.to_le_bytes());
    out[13..17].copy_from_slice(&pair.to_le_bytes());
    out[17..25].copy_from_slice(&x.to_le_bytes());
    out
}

/// WRITE_END: `transfer | flags u8 (bit 0: aborted by the sender) | sealed notification`.
pub(crate) fn write_end(transfer: u64, aborted: bool, sealed: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(9 + sealed.len());
    body.extend_from_slice(&transfer.to_le_bytes());
    body.push(u8::from(aborted));
    body.extend_from_slice(sealed);
    frame(Kind::WriteEnd, &body)
}

/// NOTIFY: a sealed notification.
pub(crate) fn notify(sealed: &[u8]) -> Vec<u8> {
    frame(Kind::Notify, sealed)
}

/// RANGE_ERROR: `transfer | pair u32 | addr | len`, a READ range the listener refused.
pub(crate) fn range_error(transfer: u64, pair: u32, addr: u64, len: u64) -> Vec<u8> {
    let mut body = Vec::with_capacity(28);
    body.extend_from_slice(&transfer.to_le_bytes());
    body.extend_from_slice(&pair.to_le_bytes());
    body.extend_from_slice(&addr.to_le_bytes());
    body.extend_from_slice(&len.to_le_bytes());
    frame(Kind::RangeError, &body)
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
pub(crate) fn write_ack(transfer: u64, status: AckStatus, refused: (u32, u64, u64)) -> Vec<u8> {
    let mut body = Vec::with_capacity(29);
    body.extend_from_slice(&transfer.to_le_bytes());
    body.push(status as u8);
    body.extend_from_slice(&refused.0.to_le_bytes());
    body.extend_from_slice(&refused.1.to_le_bytes());
    body.extend_from_slice(&refused.2.to_le_bytes());
    frame(Kind::WriteAck, &body)
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

/// Reads and drops `len` bytes (a chunk that may not be stored).
pub(crate) fn discard(stream: &TcpStream, len: usize, stop: &dyn Fn(usize) -> bool) -> io::Result<()> {
    let mut scratch = vec![0u8; len.min(64 * 1024)];
    let deadline = Instant::now() + STALL_TIMEOUT;
    let mut left = len;
    while left > 0 {
        let n = left.min(scratch.len());
        read_full(stream, &mut scratch[..n], Some(deadline), stop)?;
        left -= n;
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
    use super::*;

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
        check([0xff, 0, 0, 0, 0], TO_CONNECTOR, Err("kind 0xff"));
        check(header(Kind::WriteAck, 28), TO_CONNECTOR, Err("outside its 29..=29"));
        check([Kind::Hello as u8, 0xff, 0xff, 0xff, 0xff], &[Kind::Hello], Err("4294967295 bytes"));
    }

    #[test]
    fn the_bounds_are_the_ones_the_crate_docs_state() {
        assert_eq!(MAX_SEALED_NOTIFICATION, 65562);
        assert_eq!(Kind::Hello.bounds(), (50, 113));
        assert_eq!(Kind::Read.bounds(), (32, 16 + 16 * 4096));
        assert_eq!(Kind::Write.bounds(), (21, 20 + (1 << 20)));
        assert_eq!(Kind::WriteEnd.bounds(), (9, 9 + 65562));
        assert_eq!(Kind::Notify.bounds(), (1, 65562));
    }

    #[test]
    fn hello_round_trips_and_refuses_strangers() {
        let agent = AgentName::new(EngineId::new("decode-0"), 3);
        let bytes = hello(&[9; TOKEN_BYTES], &agent, 77);
        let head = parse_header(bytes[..5].try_into().unwrap(), &[Kind::Hello]).unwrap();
        assert_eq!(head.len, bytes.len() - HEADER_BYTES);
        let parsed = parse_hello(&bytes[HEADER_BYTES..]).unwrap();
        assert_eq!(parsed, Hello { token: [9; TOKEN_BYTES], agent, incarnation: 77 });
        let mut other = bytes[HEADER_BYTES..].to_vec();
        other[4] = 2;
        assert!(parse_hello(&other).unwrap_err().contains("version 2"));
        other[0] = b'X';
        assert!(parse_hello(&other).unwrap_err().contains("KVTD"));
        assert!(same_token(&[1; 32], &[1; 32]) && !same_token(&[1; 32], &[2; 32]));
    }

    #[test]
    fn reads_split_into_frames_of_at_most_4096_ranges() {
        let ranges: Vec<(u64, u64)> = (0..MAX_RANGES_PER_READ as u64 + 5).map(|i| (i * 10, 10)).collect();
        let bytes = reads(42, &ranges);
        let first = parse_header(bytes[..5].try_into().unwrap(), TO_LISTENER).unwrap();
        let read = parse_read(&bytes[5..5 + first.len]).unwrap();
        assert_eq!((read.transfer, read.first, read.ranges.len()), (42, 0, MAX_RANGES_PER_READ));
        let rest = &bytes[5 + first.len..];
        let second = parse_header(rest[..5].try_into().unwrap(), TO_LISTENER).unwrap();
        let read = parse_read(&rest[5..5 + second.len]).unwrap();
        assert_eq!((read.first as usize, read.ranges), (MAX_RANGES_PER_READ, ranges[MAX_RANGES_PER_READ..].to_vec()));
        assert!(parse_read(&[0; 32]).unwrap_err().contains("says 0 ranges"));
    }
}
