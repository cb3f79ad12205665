//! The outgoing data connection to one peer: it proves, by the link handshake, that it belongs
//! to this agent's side-channel session with the peer (and makes the listener prove the same),
//! then everything this agent originates toward the peer (READ requests, WRITE chunks,
//! notifications) goes out in order on it, tagged, written by one thread from a queue; a second
//! thread reads the peer's replies (DATA straight into local memory, RANGE_ERROR, WRITE_ACK),
//! checks each one's tag before acting on it, and settles the transfers they belong to.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use kv_core::side::{FrameTags, LinkRole};
use kv_core::{AgentName, TransferId, TransferStatus, TransportError};

use crate::frame::{
    self, AckStatus, Hello, Kind, Refused, CHUNK_PREFIX, HEADER_BYTES, LINK_LABEL, MAX_CHUNK, NONCE_BYTES, TO_CONNECTOR,
};
use crate::shared::{lock, Counters, Pair, Settled, Shared};

/// What the writer thread sends.
pub(crate) enum Job {
    /// READ frames for a read's pairs.
    Read { id: TransferId, pairs: Arc<[Pair]> },
    /// A write's chunks, then WRITE_END with its sealed notification.
    Write { id: TransferId, pairs: Arc<[Pair]>, sealed: Option<Vec<u8>> },
    /// A sealed notification.
    Notify(Vec<u8>),
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The writer's jobs; once closed, nothing more is taken or sent.
#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

impl Queue {
    fn push(&self, job: Job) -> bool {
        let mut state = lock(&self.state);
        if state.closed {
            return false;
        }
        state.jobs.push_back(job);
        self.ready.notify_one();
        true
    }

    /// The next job, waiting for one; `None` once closed.
    fn next(&self) -> Option<Job> {
        let mut state = lock(&self.state);
        loop {
            if state.closed {
                return None;
            }
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            state = self.ready.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn close(&self) {
        let mut state = lock(&self.state);
        state.closed = true;
        state.jobs.clear();
        self.ready.notify_all();
    }

    fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }
}

/// The socket once connected, and why the transport closed the connection, if it did.
#[derive(Default)]
struct Slot {
    stream: Option<Arc<TcpStream>>,
    closed: Option<TransportError>,
}

/// Who connects, to whom.
pub(crate) struct Target {
    pub(crate) peer: AgentName,
    pub(crate) peer_incarnation: u64,
    pub(crate) addr: SocketAddr,
    /// Whether this side asks for tags on the payloads the peer sends it (DATA).
    pub(crate) payload_tags: bool,
    pub(crate) me: AgentName,
    pub(crate) incarnation: u64,
}

/// One outgoing data connection, and its threads.
pub(crate) struct OutConn {
    pub(crate) id: u64,
    queue: Arc<Queue>,
    slot: Arc<Mutex<Slot>>,
    thread: Option<JoinHandle<()>>,
}

impl OutConn {
    /// Starts connecting to `target` on a thread of its own; jobs queue meanwhile.
    pub(crate) fn open(shared: &Arc<Shared>, id: u64, target: Target) -> Result<OutConn, TransportError> {
        let queue = Arc::new(Queue::default());
        let slot = Arc::new(Mutex::new(Slot::default()));
        let (q, s, sh) = (queue.clone(), slot.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("kvflow-tcp-conn".into())
            .spawn(move || run(&sh, id, &target, &q, &s))
            .map_err(|e| TransportError::backend("data connection thread", e))?;
        Ok(OutConn { id, queue, slot, thread: Some(thread) })
    }

    /// Queues a job; `false` when the connection is closed.
    pub(crate) fn send(&self, job: Job) -> bool {
        self.queue.push(job)
    }

    /// Whether jobs can still be queued.
    pub(crate) fn is_open(&self) -> bool {
        !self.queue.is_closed()
    }

    /// Closes the connection, failing what it carries with `why`. Returns once its threads
    /// have ended, unless it is still connecting: then its thread is handed back, to be
    /// joined later; it touches no memory once it connects and sees the close.
    pub(crate) fn close(&mut self, shared: &Shared, why: TransportError) -> Option<JoinHandle<()>> {
        let connected = {
            let mut slot = lock(&self.slot);
            slot.closed.get_or_insert(why.clone());
            if let Some(stream) = &slot.stream {
                let _ = stream.shutdown(Shutdown::Both);
            }
            slot.stream.is_some()
        };
        self.queue.close();
        shared.peers_changed_notify();
        let thread = self.thread.take()?;
        if connected || thread.is_finished() {
            let _ = thread.join();
            shared.fail_flights(self.id, &why);
            return None;
        }
        shared.fail_flights(self.id, &why);
        Some(thread)
    }
}

impl Drop for OutConn {
    /// A connection the transport did not close (it is being unwound) is stopped anyway; its
    /// threads end on their own.
    fn drop(&mut self) {
        if self.thread.is_some() {
            let mut slot = lock(&self.slot);
            slot.closed.get_or_insert_with(|| TransportError::Backend("the data connection was dropped".into()));
            if let Some(stream) = &slot.stream {
                let _ = stream.shutdown(Shutdown::Both);
            }
            drop(slot);
            self.queue.close();
        }
    }
}

/// The connection's thread: connect, start the writer, read replies until either ends; then
/// fail what the connection carried.
fn run(shared: &Arc<Shared>, id: u64, target: &Target, queue: &Arc<Queue>, slot: &Arc<Mutex<Slot>>) {
    let mut writer = None;
    let result = connect(shared, id, target, queue, slot, &mut writer);
    if let Err(e) = &result {
        tracing::debug!(peer = %target.peer, addr = %target.addr, error = %e, "data connection ended");
    }
    queue.close();
    let stream = lock(slot).stream.clone();
    if let Some(stream) = &stream {
        let _ = stream.shutdown(Shutdown::Both);
    }
    if let Some(writer) = writer {
        let _ = writer.join();
    }
    if stream.is_some() {
        shared.counters.outgoing_open.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
    // A connection that broke by itself most often broke because the peer died: its side
    // channel says so a moment later, and the transfers then fail as the peer's loss.
    let closed = || lock(slot).closed.is_some();
    let peer_gone = stream.is_some() && shared.await_peer_gone(&target.peer, target.peer_incarnation, &closed);
    let why = lock(slot).closed.clone().unwrap_or_else(|| {
        if peer_gone {
            return TransportError::PeerLost(target.peer.clone());
        }
        let reason = match &result {
            Ok(()) => "closed".to_owned(),
            Err(e) => e.to_string(),
        };
        TransportError::TransferFailed(format!("data connection to {} at {}: {reason}", target.peer, target.addr))
    });
    shared.fail_flights(id, &why);
}

fn connect(
    shared: &Arc<Shared>,
    id: u64,
    target: &Target,
    queue: &Arc<Queue>,
    slot: &Arc<Mutex<Slot>>,
    writer: &mut Option<JoinHandle<()>>,
) -> io::Result<()> {
    let stream = TcpStream::connect_timeout(&target.addr, shared.limits.auth_timeout)?;
    frame::configure(&stream)?;
    let stream = Arc::new(stream);
    {
        let mut slot = lock(slot);
        if slot.closed.is_some() {
            return Ok(());
        }
        slot.stream = Some(stream.clone());
    }
    shared.counters.outgoing_open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let link = prove(shared, target, &stream, queue)?;
    let (sh, st, q) = (shared.clone(), stream.clone(), queue.clone());
    let (mut out, tag_writes) = (link.out, link.tag_out_payloads);
    *writer = Some(
        std::thread::Builder::new()
            .name("kvflow-tcp-send".into())
            .spawn(move || {
                if let Err(e) = send_loop(&sh, &st, &q, &mut out, tag_writes) {
                    tracing::debug!(error = %e, "data connection writer ended");
                    let _ = st.shutdown(Shutdown::Both);
                }
            })
            .map_err(io::Error::other)?,
    );
    let mut incoming = link.incoming;
    match receive_loop(shared, id, &stream, queue, &mut incoming, target.payload_tags) {
        Err(Refused::Forged(reason)) => {
            Counters::add(&shared.counters.frames_forged, 1);
            tracing::warn!(peer = %target.peer, %reason, "data connection closed");
            Err(protocol(reason))
        }
        Err(Refused::Malformed(reason)) => {
            Counters::add(&shared.counters.frames_refused, 1);
            Err(protocol(reason))
        }
        Err(Refused::Io(e)) => Err(e),
        Ok(()) => Ok(()),
    }
}

/// A proven link's tags, each way, and whether the listener wants its WRITE payloads tagged.
struct Proven {
    out: FrameTags,
    incoming: FrameTags,
    tag_out_payloads: bool,
}

/// The link handshake, connector's side: HELLO, the listener's CHALLENGE (it must prove the
/// session first), PROOF.
fn prove(shared: &Shared, target: &Target, stream: &TcpStream, queue: &Queue) -> io::Result<Proven> {
    let stop = |_: usize| shared.stopping() || queue.is_closed();
    let deadline = Some(Instant::now() + shared.limits.auth_timeout);
    let secret = shared
        .side
        .link_secret(&target.peer, LINK_LABEL)
        .filter(|s| s.incarnation() == target.peer_incarnation)
        .ok_or_else(|| {
            protocol(format!("no side-channel session with {} incarnation {}", target.peer, target.peer_incarnation))
        })?;
    let mut nonce_c = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce_c).map_err(|e| io::Error::other(format!("no randomness for a nonce: {e}")))?;
    let hello = Hello {
        agent: target.me.clone(),
        incarnation: target.incarnation,
        nonce: nonce_c,
        payload_tags: target.payload_tags,
    };
    let mut transcript = frame::hello(&hello);
    frame::write_full(stream, &transcript, &|| shared.stopping())?;
    let mut head = [0u8; HEADER_BYTES];
    frame::read_full(stream, &mut head, deadline, &stop)?;
    let header = frame::parse_header(head, &[Kind::Challenge]).map_err(protocol)?;
    let mut body = vec![0u8; header.len];
    frame::read_full(stream, &mut body, deadline, &stop)?;
    let challenge = frame::parse_challenge(&body).map_err(protocol)?;
    transcript.extend_from_slice(&head);
    transcript.extend_from_slice(&body[..body.len() - challenge.mac.len()]);
    if !secret.verify_listener_mac(&transcript, &challenge.mac) {
        return Err(protocol(format!(
            "the data listener at {} did not prove {}'s side-channel session",
            target.addr, target.peer
        )));
    }
    let mac_c = secret.connector_mac(&transcript, &challenge.mac);
    frame::write_full(stream, &frame::proof(&mac_c), &|| shared.stopping())?;
    let (out, incoming) = secret.frame_tags(LinkRole::Connector, &nonce_c, &challenge.nonce, &transcript);
    Ok(Proven { out, incoming, tag_out_payloads: challenge.payload_tags })
}

/// Writes the queued jobs in order, tagged.
fn send_loop(
    shared: &Shared,
    stream: &TcpStream,
    queue: &Queue,
    tags: &mut FrameTags,
    tag_writes: bool,
) -> io::Result<()> {
    let stop = || shared.stopping();
    while let Some(job) = queue.next() {
        match job {
            Job::Notify(sealed) => frame::write_full(stream, &frame::notify(tags, &sealed), &stop)?,
            Job::Read { id, pairs } => {
                let ranges: Vec<(u64, u64)> = pairs.iter().map(|p| (p.remote, p.len)).collect();
                frame::write_full(stream, &frame::reads(tags, id.0, &ranges), &stop)?;
            }
            Job::Write { id, pairs, sealed } => {
                let aborted = send_chunks(shared, stream, id, &pairs, tags, tag_writes)?;
                let sealed = if aborted { &[][..] } else { sealed.as_deref().unwrap_or_default() };
                frame::write_full(stream, &frame::write_end(tags, id.0, aborted, sealed), &stop)?;
            }
        }
    }
    Ok(())
}

/// Writes a write's chunks straight from local memory, tagged (their bytes too when the
/// listener asked); `Ok(true)` when a local range was deregistered since the post (the transfer
/// fails, the listener is told to drop it).
fn send_chunks(
    shared: &Shared,
    stream: &TcpStream,
    id: TransferId,
    pairs: &[Pair],
    tags: &mut FrameTags,
    tag_writes: bool,
) -> io::Result<bool> {
    let stop = || shared.stopping();
    for (i, p) in pairs.iter().enumerate() {
        let mut offset = 0u64;
        while offset < p.len {
            let n = (p.len - offset).min(MAX_CHUNK as u64) as usize;
            let sent = shared.registry.with_bytes(p.local + offset, n, |bytes| {
                let head = frame::chunk_head(tags, Kind::Write, id.0, i as u32, p.remote + offset, n);
                frame::write_full(stream, &head, &stop)?;
                frame::write_full(stream, bytes, &stop)?;
                if tag_writes {
                    frame::write_full(stream, &tags.tag(bytes), &stop)?;
                }
                Ok::<(), io::Error>(())
            });
            match sent {
                Some(result) => result?,
                None => {
                    let error = TransportError::NotRegistered { side: "local", addr: p.local, len: p.len };
                    shared.flight_error(id, error);
                    return Ok(true);
                }
            }
            Counters::add(&shared.counters.bytes_sent, n as u64);
            offset += n as u64;
        }
    }
    Ok(false)
}

fn protocol(reason: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason)
}

/// Reads the peer's replies until the connection ends, each taken only once its tag checks
/// out (and its bytes', with `tag_data`).
fn receive_loop(
    shared: &Shared,
    conn: u64,
    stream: &TcpStream,
    queue: &Queue,
    tags: &mut FrameTags,
    tag_data: bool,
) -> Result<(), Refused> {
    let stop = |_: usize| shared.stopping() || queue.is_closed();
    loop {
        let control = frame::read_control(stream, TO_CONNECTOR, tags, &stop)?;
        let (header, body, deadline) = (control.header, control.body, control.deadline);
        match header.kind {
            Kind::Data => {
                let id = TransferId(frame::u64_at(&body, 0));
                let (pair, offset) = (frame::u32_at(&body, 8), frame::u64_at(&body, 12));
                let n = header.len - CHUNK_PREFIX;
                let target = shared.read_target(conn, id, pair, offset, n as u64).map_err(Refused::Malformed)?;
                let mut error = None;
                match target {
                    Some(p) => {
                        let filled = shared.registry.with_bytes_mut(p.local + offset, n, |bytes| {
                            frame::read_full(stream, bytes, Some(deadline), &stop)?;
                            frame::check_payload(stream, tag_data.then_some(&mut *tags), bytes, deadline, &stop)
                        });
                        match filled {
                            Some(result) => result?,
                            None => {
                                frame::discard(stream, n, tag_data.then_some(&mut *tags), &stop)?;
                                error =
                                    Some(TransportError::NotRegistered { side: "local", addr: p.local, len: p.len });
                            }
                        }
                    }
                    None => frame::discard(stream, n, tag_data.then_some(&mut *tags), &stop)?,
                }
                Counters::add(&shared.counters.bytes_received, n as u64);
                let settled = shared.read_progress(id, pair, n as u64, error);
                settle(shared, queue, id, settled);
            }
            Kind::RangeError => {
                let id = TransferId(frame::u64_at(&body, 0));
                let (addr, len) = (frame::u64_at(&body, 12), frame::u64_at(&body, 20));
                let error = TransportError::NotRegistered { side: "remote", addr, len };
                let settled =
                    shared.range_refused(conn, id, frame::u32_at(&body, 8), error).map_err(Refused::Malformed)?;
                settle(shared, queue, id, settled);
            }
            Kind::WriteAck => {
                let id = TransferId(frame::u64_at(&body, 0));
                let error = match body[8] {
                    s if s == AckStatus::Written as u8 => None,
                    s if s == AckStatus::NotRegistered as u8 => Some(TransportError::NotRegistered {
                        side: "remote",
                        addr: frame::u64_at(&body, 13),
                        len: frame::u64_at(&body, 21),
                    }),
                    s if s == AckStatus::Aborted as u8 => {
                        Some(TransportError::TransferFailed("the write was aborted by this side".into()))
                    }
                    s => return Err(Refused::Malformed(format!("WRITE_ACK status {s} is not one this side knows"))),
                };
                shared.write_acked(conn, id, error).map_err(Refused::Malformed)?;
            }
            kind => return Err(Refused::Malformed(format!("{kind:?} is not a reply"))),
        }
    }
}

/// Carries out what a read's reply settled.
fn settle(shared: &Shared, queue: &Queue, id: TransferId, settled: Settled) {
    match settled {
        Settled::Pending => {}
        Settled::Finished => shared.wake(),
        Settled::Notify(peer, payload) => notify_after_read(shared, queue, id, &peer, &payload),
    }
}

/// Every byte of a read is here: its notification goes out behind everything queued, and
/// only then does the read report done.
fn notify_after_read(shared: &Shared, queue: &Queue, id: TransferId, peer: &AgentName, payload: &[u8]) {
    let status = match shared.side.seal(peer, payload).map(|sealed| queue.push(Job::Notify(sealed))) {
        Ok(true) => TransferStatus::Done,
        Ok(false) => TransferStatus::Failed(TransportError::TransferFailed(format!(
            "the data connection to {peer} closed before the read's notification was sent"
        ))),
        Err(e) => TransferStatus::Failed(e.into()),
    };
    shared.finish(id, status);
}
