//! The data listener: accepts connections (at most `max_data_connections` at once), makes
//! each prove the token and name an established peer in HELLO, then serves its frames with
//! the peer treated as untrusted: every range is checked against the registrations of the
//! moment before a byte is touched, every length against its bound.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kv_core::{AgentName, PeerEvent, RefusalCause};

use crate::frame::{self, AckStatus, Hello, Kind, CHUNK_PREFIX, HEADER_BYTES, MAX_CHUNK, STALL_TIMEOUT, TO_LISTENER};
use crate::shared::{lock, Counters, Incoming, Shared};

/// Accepts data connections until the transport stops.
pub(crate) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    let mut next = 0u64;
    for stream in listener.incoming() {
        if shared.stopping() {
            break;
        }
        let stream = match stream {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "data listener accept failed");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        shared.reap_incoming();
        let open = shared.counters.incoming_open.load(Ordering::Relaxed);
        if open >= shared.max_incoming {
            shared.refuse_connection(&format!("{open} data connections open, the most this transport holds"));
            continue;
        }
        next += 1;
        let stream = Arc::new(stream);
        shared.counters.incoming_open.fetch_add(1, Ordering::Relaxed);
        let (sh, st) = (shared.clone(), stream.clone());
        match std::thread::Builder::new().name("kvflow-tcp-serve".into()).spawn(move || serve(&sh, &st)) {
            Ok(thread) => {
                lock(&shared.incoming).insert(next, Incoming { stream, thread });
            }
            Err(e) => {
                shared.counters.incoming_open.fetch_sub(1, Ordering::Relaxed);
                shared.refuse_connection(&format!("no thread for a data connection: {e}"));
            }
        }
    }
}

/// One accepted connection, from HELLO to its end.
fn serve(shared: &Shared, stream: &TcpStream) {
    match authenticate(shared, stream) {
        Ok((agent, incarnation)) => {
            let result = serve_frames(shared, stream, &agent, incarnation);
            if let Err(e) = &result {
                tracing::debug!(peer = %agent, error = %e, "data connection from peer ended");
            }
            let _ = stream.shutdown(Shutdown::Both);
            shared.counters.incoming_open.fetch_sub(1, Ordering::Relaxed);
            shared.incoming_ended(&agent, incarnation);
        }
        Err(reason) => {
            shared.refuse_connection(&reason);
            let _ = stream.shutdown(Shutdown::Both);
            shared.counters.incoming_open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// HELLO within `auth_timeout`, with this transport's token, from an established peer of that
/// name and incarnation; the error is why not.
fn authenticate(shared: &Shared, stream: &TcpStream) -> Result<(AgentName, u64), String> {
    frame::configure(stream).map_err(|e| format!("socket setup: {e}"))?;
    let timeout = shared.limits.auth_timeout;
    let deadline = Instant::now() + timeout;
    let stop = |_: usize| shared.stopping();
    let late = |e: io::Error| match e.kind() {
        io::ErrorKind::TimedOut => format!("no HELLO within {timeout:?}"),
        _ => format!("before HELLO: {e}"),
    };
    let mut head = [0u8; HEADER_BYTES];
    frame::read_full(stream, &mut head, Some(deadline), &stop).map_err(late)?;
    let refused_frame = |reason: String| {
        Counters::add(&shared.counters.frames_refused, 1);
        reason
    };
    let header = frame::parse_header(head, &[Kind::Hello]).map_err(refused_frame)?;
    let mut body = vec![0u8; header.len];
    frame::read_full(stream, &mut body, Some(deadline), &stop).map_err(late)?;
    let Hello { token, agent, incarnation } = frame::parse_hello(&body).map_err(refused_frame)?;
    if !frame::same_token(&token, &shared.token) {
        return Err(format!("HELLO claiming {agent} incarnation {incarnation} has a wrong token"));
    }
    // The peer's handshake may have completed on its side before this engine took it in:
    // wait for it (until the deadline) rather than refuse a peer that is merely early.
    let mut peers = lock(&shared.peers);
    loop {
        if shared.stopping() {
            return Err("the transport is stopping".into());
        }
        match peers.get_mut(&agent) {
            Some(e) if e.incarnation == incarnation && e.closing_since.is_none() => {
                e.incoming += 1;
                return Ok((agent, incarnation));
            }
            Some(e) if e.incarnation == incarnation => {
                return Err(format!("{agent} incarnation {incarnation} closed its side channel"));
            }
            Some(e) if e.incarnation > incarnation => {
                return Err(format!(
                    "{agent} incarnation {incarnation} is stale: incarnation {} is established",
                    e.incarnation
                ));
            }
            _ => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(format!("{agent} incarnation {incarnation} is not an established side-channel peer"));
        }
        peers = shared.peers_changed.wait_timeout(peers, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// A connection broke the protocol: counted, reported as the peer's, and closed.
fn broke(shared: &Shared, agent: &AgentName, reason: String) -> io::Error {
    Counters::add(&shared.counters.frames_refused, 1);
    shared.queue_event(PeerEvent::Refused {
        peer: Some(agent.clone()),
        cause: RefusalCause::Malformed,
        reason: format!("data connection: {reason}"),
    });
    io::Error::new(io::ErrorKind::InvalidData, reason)
}

/// The WRITE a connection is in the middle of: its chunks come in order, then WRITE_END.
struct Writing {
    transfer: u64,
    /// The first range refused: pair, address, length. Nothing more of it is written.
    refused: Option<(u32, u64, u64)>,
}

/// Serves an authenticated peer's frames until it closes, breaks the protocol, or stops
/// being an established peer.
fn serve_frames(shared: &Shared, stream: &TcpStream, agent: &AgentName, incarnation: u64) -> io::Result<()> {
    let stop = |read: usize| !shared.keep_serving(agent, incarnation, read == 0);
    let out = Replies { stream, stop: &|| !shared.keep_serving(agent, incarnation, false) };
    let mut writing: Option<Writing> = None;
    loop {
        if !shared.keep_serving(agent, incarnation, false) {
            return Ok(());
        }
        let mut head = [0u8; HEADER_BYTES];
        frame::read_full(stream, &mut head, None, &stop)?;
        let header = frame::parse_header(head, TO_LISTENER).map_err(|r| broke(shared, agent, r))?;
        let deadline = Some(Instant::now() + STALL_TIMEOUT);
        match header.kind {
            Kind::Read => {
                let mut body = vec![0u8; header.len];
                frame::read_full(stream, &mut body, deadline, &stop)?;
                let read = frame::parse_read(&body).map_err(|r| broke(shared, agent, r))?;
                for (i, &(addr, len)) in read.ranges.iter().enumerate() {
                    serve_read(shared, &out, read.transfer, read.first.wrapping_add(i as u32), addr, len)?;
                }
            }
            Kind::Write => {
                let mut prefix = [0u8; CHUNK_PREFIX];
                frame::read_full(stream, &mut prefix, deadline, &stop)?;
                let transfer = frame::u64_at(&prefix, 0);
                let (pair, addr) = (frame::u32_at(&prefix, 8), frame::u64_at(&prefix, 12));
                let n = header.len - CHUNK_PREFIX;
                let w = writing.get_or_insert(Writing { transfer, refused: None });
                if w.transfer != transfer {
                    let reason = format!("WRITE for transfer {transfer} inside transfer {}", w.transfer);
                    return Err(broke(shared, agent, reason));
                }
                if w.refused.is_none() {
                    let filled = shared
                        .registry
                        .with_bytes_mut(addr, n, |bytes| frame::read_full(stream, bytes, deadline, &stop));
                    match filled {
                        Some(result) => result?,
                        None => {
                            Counters::add(&shared.counters.ranges_refused, 1);
                            w.refused = Some((pair, addr, n as u64));
                        }
                    }
                }
                if w.refused.is_some() {
                    frame::discard(stream, n, &stop)?;
                }
                Counters::add(&shared.counters.bytes_received, n as u64);
            }
            Kind::WriteEnd => {
                let mut body = vec![0u8; header.len];
                frame::read_full(stream, &mut body, deadline, &stop)?;
                let (transfer, flags, sealed) = (frame::u64_at(&body, 0), body[8], &body[9..]);
                if flags > 1 {
                    return Err(broke(shared, agent, format!("WRITE_END flags {flags:#04x}")));
                }
                let w = writing.take().unwrap_or(Writing { transfer, refused: None });
                if w.transfer != transfer {
                    let reason = format!("WRITE_END for transfer {transfer} inside transfer {}", w.transfer);
                    return Err(broke(shared, agent, reason));
                }
                let (status, refused) = match (flags & 1 == 1, w.refused) {
                    (true, _) => (AckStatus::Aborted, (0, 0, 0)),
                    (false, Some(refused)) => (AckStatus::NotRegistered, refused),
                    (false, None) => {
                        // Every byte is in memory: only now may the peer's notification count.
                        if !sealed.is_empty() {
                            shared.deliver(agent, sealed);
                        }
                        (AckStatus::Written, (0, 0, 0))
                    }
                };
                out.write(&frame::write_ack(transfer, status, refused))?;
            }
            Kind::Notify => {
                let mut body = vec![0u8; header.len];
                frame::read_full(stream, &mut body, deadline, &stop)?;
                shared.deliver(agent, &body);
            }
            kind => return Err(broke(shared, agent, format!("{kind:?} is not a request"))),
        }
    }
}

/// Where a connection's replies go, and when to give up writing them.
struct Replies<'a> {
    stream: &'a TcpStream,
    /// The transport stops, or the peer is gone (past its grace, if its side channel closed).
    stop: &'a dyn Fn() -> bool,
}

impl Replies<'_> {
    fn write(&self, bytes: &[u8]) -> io::Result<()> {
        frame::write_full(self.stream, bytes, self.stop)
    }
}

/// Answers one range of a READ: its bytes in chunks straight from memory, or RANGE_ERROR when
/// it is not (or stops being) inside one registration.
fn serve_read(shared: &Shared, out: &Replies<'_>, transfer: u64, pair: u32, addr: u64, len: u64) -> io::Result<()> {
    let refuse = || {
        Counters::add(&shared.counters.ranges_refused, 1);
        out.write(&frame::range_error(transfer, pair, addr, len))
    };
    if len == 0 || !shared.registry.holds(addr, len) {
        return refuse();
    }
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(MAX_CHUNK as u64) as usize;
        let head = frame::chunk_head(Kind::Data, transfer, pair, offset, n);
        let sent = shared.registry.with_bytes(addr + offset, n, |bytes| {
            out.write(&head)?;
            out.write(bytes)
        });
        match sent {
            Some(result) => result?,
            // Deregistered while it was being sent: what went out is void.
            None => return refuse(),
        }
        Counters::add(&shared.counters.bytes_sent, n as u64);
        offset += n as u64;
    }
    Ok(())
}
