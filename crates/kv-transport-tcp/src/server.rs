//! The data listener. Connections are accepted, and taken through the link handshake, on a
//! thread of its own with a current-thread tokio runtime that no caller enters, a task per
//! connection and no thread per pending socket: HELLO must name a peer this engine has
//! established on the side channel, the listener answers with a CHALLENGE made with that
//! peer's session, and the connector must answer with a PROOF only the same session makes.
//! Pending connections are kept in kv-core's admission book (by stage, in total and per source
//! address), so a flood displaces only connections that proved no more than it did. Each
//! authenticated connection then gets a thread that serves its frames with the peer treated
//! as untrusted: every frame's tag is checked before it is acted on, every range against the
//! registrations of the moment before a byte is touched, every length against its bound.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kv_core::side::admission::{Admission, AdmissionLimits, Stage};
use kv_core::side::{FrameTags, LinkRole, LinkSecret};
use kv_core::{AgentName, PeerEvent, RefusalCause};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use crate::frame::{
    self, AckStatus, Hello, Kind, Refused, CHUNK_PREFIX, HEADER_BYTES, LINK_LABEL, MAX_CHUNK, NONCE_BYTES, TO_LISTENER,
};
use crate::shared::{lock, Counters, Incoming, Shared};
use crate::TcpError;

/// Authenticated data connections one peer session may hold at once; a newer one closes its
/// oldest (a peer opens one, and a new one when that breaks).
pub const MAX_LINKS_PER_PEER: usize = 4;

/// The listener's thread, and how to stop it.
pub(crate) struct Listener {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Starts accepting on `listener` (already bound, so a bad address failed in the caller).
    pub(crate) fn start(shared: Arc<Shared>, listener: std::net::TcpListener) -> Result<Listener, TcpError> {
        listener.set_nonblocking(true).map_err(|e| TcpError::Start(format!("data listener: {e}")))?;
        let (stop, stopped) = oneshot::channel();
        let (started, ready) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kvflow-tcp-accept".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = started.send(Err(format!("data listener runtime: {e}")));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(e) => {
                            let _ = started.send(Err(format!("data listener: {e}")));
                            return;
                        }
                    };
                    let _ = started.send(Ok(()));
                    tokio::select! {
                        _ = stopped => {}
                        _ = accept_loop(shared, listener) => {}
                    }
                });
                // Pending handshakes end with their sockets; none holds memory of the pool.
                runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            })
            .map_err(|e| TcpError::Start(format!("data listener thread: {e}")))?;
        match ready.recv() {
            Ok(Ok(())) => Ok(Listener { stop: Some(stop), thread: Some(thread) }),
            Ok(Err(reason)) => Err(TcpError::Start(reason)),
            Err(_) => Err(TcpError::Start("the data listener thread ended at start".into())),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The connections still proving themselves: the admission book, and how to end each one's
/// task when a newcomer displaces it.
struct Pending {
    book: Admission<u64>,
    tasks: HashMap<u64, AbortHandle>,
}

impl Pending {
    /// Ends the task of a displaced connection, counting it.
    fn displace(&mut self, shared: &Shared, evicted: Option<kv_core::side::admission::Evicted<u64>>) {
        let Some(e) = evicted else { return };
        if let Some(task) = self.tasks.remove(&e.conn) {
            task.abort();
        }
        let budget = if e.per_source { "from one address" } else { "in all" };
        let reason = format!("too many data connections waiting {} {budget}", e.stage.as_str());
        shared.refuse_connection(RefusalCause::Overloaded, &reason);
    }

    fn advance(&mut self, shared: &Shared, conn: u64, stage: Stage) {
        let evicted = self.book.advance(conn, stage);
        self.displace(shared, evicted);
        self.publish(shared);
    }

    fn leave(&mut self, shared: &Shared, conn: u64) {
        self.book.remove(conn);
        self.tasks.remove(&conn);
        self.publish(shared);
    }

    /// Shows the book's counts in the transport's status.
    fn publish(&self, shared: &Shared) {
        for stage in Stage::ALL {
            shared.counters.pending[stage as usize].store(self.book.count(stage), Ordering::Relaxed);
        }
    }
}

/// Accepts data connections until the transport stops.
async fn accept_loop(shared: Arc<Shared>, listener: tokio::net::TcpListener) {
    let limits = AdmissionLimits {
        per_stage: shared.limits.max_unauthenticated,
        per_source: shared.limits.max_unauthenticated_per_source,
    };
    let pending = Arc::new(Mutex::new(Pending { book: Admission::new(limits), tasks: HashMap::new() }));
    let mut next = 0u64;
    loop {
        // One accept, then the pending connections' tasks run (as the side channel does, and
        // for its reason: a loop that accepted in batches under a flood would outrun them).
        tokio::task::yield_now().await;
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, most often: the book's budgets free some soon.
                tracing::warn!(error = %e, "data listener accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.stopping() {
            break;
        }
        next += 1;
        let conn = next;
        let _ = stream.set_nodelay(true);
        // A real peer's HELLO is in by the time its connection is accepted: read it now, so that
        // the connection ranks as greeted before the next accept can displace it.
        let mut early = vec![0u8; HEADER_BYTES + frame::MAX_HELLO_BYTES];
        let n = stream.try_read(&mut early).unwrap_or(0);
        early.truncate(n);
        let greeted = names_a_peer(&shared, &early);
        // The task cannot run before the book holds it: this thread is the runtime's only one,
        // and nothing here awaits between the spawn and the entry.
        let task = tokio::spawn(handshake(shared.clone(), pending.clone(), conn, stream, from.ip(), early));
        let mut p = lock(&pending);
        p.tasks.insert(conn, task.abort_handle());
        let evicted = p.book.accept(conn, from.ip());
        p.displace(&shared, evicted);
        if greeted {
            p.advance(&shared, conn, Stage::Greeted);
        }
        p.publish(&shared);
    }
}

/// Whether `early` holds a whole HELLO naming an established side-channel peer.
fn names_a_peer(shared: &Shared, early: &[u8]) -> bool {
    let Some(head) = early.get(..HEADER_BYTES) else { return false };
    let Ok(header) = frame::parse_header(head.try_into().expect("5 bytes"), &[Kind::Hello]) else { return false };
    let Some(Ok(hello)) = early.get(HEADER_BYTES..HEADER_BYTES + header.len).map(frame::parse_hello) else {
        return false;
    };
    shared.side.link_secret(&hello.agent, LINK_LABEL).is_some_and(|s| s.incarnation() == hello.incarnation)
}

/// An authenticated data connection: whose session it proved, and its tags.
struct Link {
    agent: AgentName,
    incarnation: u64,
    /// What this side sends, and what it receives.
    out: FrameTags,
    incoming: FrameTags,
    /// The peer asked for tags on the payloads this side sends it (DATA).
    tag_out_payloads: bool,
    /// This side asked for tags on the payloads the peer sends it (WRITE).
    tag_in_payloads: bool,
}

/// One pending connection's handshake, then its hand-off to a serving thread.
async fn handshake(
    shared: Arc<Shared>,
    pending: Arc<Mutex<Pending>>,
    conn: u64,
    mut stream: tokio::net::TcpStream,
    source: IpAddr,
    early: Vec<u8>,
) {
    let timeout = shared.limits.auth_timeout;
    let result = match tokio::time::timeout(timeout, link(&shared, &pending, conn, &mut stream, early)).await {
        Ok(result) => result,
        Err(_) => Err((RefusalCause::Timeout, format!("no data-link handshake within {timeout:?}"))),
    };
    lock(&pending).leave(&shared, conn);
    match result {
        Ok(link) => hand_off(&shared, stream, link, source),
        Err((cause, reason)) => {
            shared.refuse_connection(cause, &reason);
            let _ = stream.shutdown().await;
        }
    }
}

type Refusal = (RefusalCause, String);

/// Reads from `stream` until `have` holds at least `len` bytes.
async fn fill(stream: &mut tokio::net::TcpStream, have: &mut Vec<u8>, len: usize) -> io::Result<()> {
    if have.len() < len {
        let at = have.len();
        have.resize(len, 0);
        stream.read_exact(&mut have[at..]).await?;
    }
    Ok(())
}

/// HELLO, CHALLENGE, PROOF; then waits until this engine has taken in the peer. `early` is
/// what arrived before the task began.
async fn link(
    shared: &Shared,
    pending: &Mutex<Pending>,
    conn: u64,
    stream: &mut tokio::net::TcpStream,
    early: Vec<u8>,
) -> Result<Link, Refusal> {
    let malformed = |reason: String| (RefusalCause::Malformed, reason);
    let mut have = early;
    fill(stream, &mut have, HEADER_BYTES).await.map_err(|e| malformed(format!("before HELLO: {e}")))?;
    let header = frame::parse_header(have[..HEADER_BYTES].try_into().expect("5 bytes"), &[Kind::Hello])
        .map_err(|r| malformed(format!("instead of HELLO: {r}")))?;
    let hello_len = HEADER_BYTES + header.len;
    fill(stream, &mut have, hello_len).await.map_err(|e| malformed(format!("in HELLO: {e}")))?;
    // Anything sent behind HELLO (before CHALLENGE, so nothing a real peer sends) stays for PROOF.
    let mut hello_frame = have;
    let mut have = hello_frame.split_off(hello_len);
    let hello = frame::parse_hello(&hello_frame[HEADER_BYTES..]).map_err(|r| {
        let cause = if r.contains("version") { RefusalCause::Version } else { RefusalCause::Malformed };
        (cause, r)
    })?;
    let Hello { agent, incarnation, nonce: nonce_c, payload_tags } = hello;
    let secret = session_of(shared, &agent, incarnation).await?;

    let mut nonce_l = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce_l).map_err(|e| (RefusalCause::Overloaded, format!("no randomness for a nonce: {e}")))?;
    let mut transcript = hello_frame;
    transcript.extend_from_slice(&frame::challenge_unmacked(&nonce_l, shared.payload_tags));
    let mac_l = secret.listener_mac(&transcript);
    let mut challenge = transcript[transcript.len() - (HEADER_BYTES + NONCE_BYTES + 1)..].to_vec();
    challenge.extend_from_slice(&mac_l);
    stream.write_all(&challenge).await.map_err(|e| malformed(format!("sending CHALLENGE: {e}")))?;
    lock(pending).advance(shared, conn, Stage::Greeted);

    let unproven = |reason: String| (RefusalCause::Unauthenticated, reason);
    fill(stream, &mut have, HEADER_BYTES)
        .await
        .map_err(|e| unproven(format!("{agent} closed before its PROOF: {e}")))?;
    frame::parse_header(have[..HEADER_BYTES].try_into().expect("5 bytes"), &[Kind::Proof])
        .map_err(|r| malformed(format!("instead of PROOF: {r}")))?;
    let proof_len = HEADER_BYTES + kv_core::side::LINK_MAC_BYTES;
    fill(stream, &mut have, proof_len).await.map_err(|e| unproven(format!("{agent} closed within its PROOF: {e}")))?;
    if have.len() > proof_len {
        return Err(malformed(format!("{} bytes behind PROOF before the link was up", have.len() - proof_len)));
    }
    let proof = &have[HEADER_BYTES..proof_len];
    if !secret.verify_connector_mac(&transcript, &mac_l, proof) {
        return Err(unproven(format!(
            "a data connection claiming {agent} incarnation {incarnation} did not prove its side-channel session"
        )));
    }
    lock(pending).advance(shared, conn, Stage::Proven);
    engine_knows(shared, &agent, incarnation).await?;
    let (out, incoming) = secret.frame_tags(LinkRole::Listener, &nonce_c, &nonce_l, &transcript);
    Ok(Link { agent, incarnation, out, incoming, tag_out_payloads: payload_tags, tag_in_payloads: shared.payload_tags })
}

/// The link secret of the established side-channel peer `agent` at `incarnation`, waiting
/// (within the handshake's deadline) for a handshake the side channel has not finished yet.
async fn session_of(shared: &Shared, agent: &AgentName, incarnation: u64) -> Result<LinkSecret, Refusal> {
    let mut changes = shared.watch_peers();
    loop {
        match shared.side.link_secret(agent, LINK_LABEL) {
            Some(s) if s.incarnation() == incarnation => return Ok(s),
            Some(s) if s.incarnation() > incarnation => {
                let reason = format!(
                    "{agent} incarnation {incarnation} is stale: incarnation {} is established",
                    s.incarnation()
                );
                return Err((RefusalCause::Stale, reason));
            }
            _ => {}
        }
        // The engine takes a handshake in right after the side channel finishes it, and says
        // so through `peers`; a name no handshake brings waits out the deadline.
        if changes.changed().await.is_err() {
            return Err((RefusalCause::Malformed, "the transport is stopping".into()));
        }
    }
}

/// Waits until this engine has taken in `agent` at `incarnation` (its notifications must not
/// come before the engine knows the peer), and counts the connection as the peer's.
async fn engine_knows(shared: &Shared, agent: &AgentName, incarnation: u64) -> Result<(), Refusal> {
    let mut changes = shared.watch_peers();
    loop {
        if shared.stopping() {
            return Err((RefusalCause::Malformed, "the transport is stopping".into()));
        }
        {
            let mut peers = lock(&shared.peers);
            match peers.get_mut(agent) {
                Some(e) if e.incarnation == incarnation && e.closing_since.is_none() => {
                    e.incoming += 1;
                    return Ok(());
                }
                Some(e) if e.incarnation == incarnation => {
                    return Err((
                        RefusalCause::Stale,
                        format!("{agent} incarnation {incarnation} closed its side channel"),
                    ));
                }
                Some(e) if e.incarnation > incarnation => {
                    let reason = format!(
                        "{agent} incarnation {incarnation} is stale: incarnation {} is established",
                        e.incarnation
                    );
                    return Err((RefusalCause::Stale, reason));
                }
                _ => {}
            }
        }
        if changes.changed().await.is_err() {
            return Err((RefusalCause::Malformed, "the transport is stopping".into()));
        }
    }
}

/// Gives an authenticated connection a serving thread, within the bounds on links.
fn hand_off(shared: &Arc<Shared>, stream: tokio::net::TcpStream, link: Link, source: IpAddr) {
    let peer = (link.agent.clone(), link.incarnation);
    let refuse = |cause: RefusalCause, reason: String| {
        shared.refuse_connection(cause, &reason);
        shared.incoming_ended(&peer.0, peer.1);
    };
    let stream = match stream.into_std().and_then(|s| s.set_nonblocking(false).map(|()| s)) {
        Ok(stream) => Arc::new(stream),
        Err(e) => return refuse(RefusalCause::Malformed, format!("socket hand-off: {e}")),
    };
    shared.reap_incoming();
    let mut incoming = lock(&shared.incoming);
    // The peer's own links: past the bound its oldest goes, as a reconnect would replace it.
    let mut own: Vec<u64> = incoming.iter().filter(|(_, c)| c.peer == peer).map(|(&id, _)| id).collect();
    own.sort_unstable();
    for id in own.iter().take((own.len() + 1).saturating_sub(MAX_LINKS_PER_PEER)) {
        if let Some(c) = incoming.get(id) {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        shared.refuse_connection(
            RefusalCause::Overloaded,
            &format!("{} has more than {MAX_LINKS_PER_PEER} data links", peer.0),
        );
    }
    let open = shared.counters.incoming_open.load(Ordering::Relaxed);
    if open >= shared.max_incoming {
        drop(incoming);
        return refuse(
            RefusalCause::Overloaded,
            format!("{open} data connections open, the most this transport holds"),
        );
    }
    let id = shared.next_incoming();
    shared.counters.incoming_open.fetch_add(1, Ordering::Relaxed);
    let (sh, st) = (shared.clone(), stream.clone());
    match std::thread::Builder::new().name("kvflow-tcp-serve".into()).spawn(move || serve(&sh, &st, link)) {
        Ok(thread) => {
            incoming.insert(id, Incoming { peer, stream, thread });
        }
        Err(e) => {
            drop(incoming);
            shared.counters.incoming_open.fetch_sub(1, Ordering::Relaxed);
            refuse(RefusalCause::Overloaded, format!("no thread for a data connection from {source}: {e}"));
        }
    }
}

/// One authenticated connection, until it ends.
fn serve(shared: &Shared, stream: &TcpStream, mut link: Link) {
    let result = frame::configure(stream).map_err(Refused::Io).and_then(|()| serve_frames(shared, stream, &mut link));
    match result {
        Err(Refused::Malformed(reason)) => broke(shared, &link.agent, RefusalCause::Malformed, reason),
        Err(Refused::Forged(reason)) => {
            Counters::add(&shared.counters.frames_forged, 1);
            broke(shared, &link.agent, RefusalCause::Unauthenticated, reason);
        }
        Err(Refused::Io(e)) => tracing::debug!(peer = %link.agent, error = %e, "data connection from peer ended"),
        Ok(()) => {}
    }
    let _ = stream.shutdown(Shutdown::Both);
    shared.counters.incoming_open.fetch_sub(1, Ordering::Relaxed);
    shared.incoming_ended(&link.agent, link.incarnation);
}

/// A connection broke the protocol or forged a frame: counted, reported as the peer's, and
/// closed.
fn broke(shared: &Shared, agent: &AgentName, cause: RefusalCause, reason: String) {
    if cause == RefusalCause::Malformed {
        Counters::add(&shared.counters.frames_refused, 1);
    }
    tracing::warn!(peer = %agent, %reason, "data connection closed");
    shared.queue_event(PeerEvent::Refused {
        peer: Some(agent.clone()),
        cause,
        reason: format!("data connection: {reason}"),
    });
}

/// The WRITE a connection is in the middle of: its chunks come in order, then WRITE_END.
struct Writing {
    transfer: u64,
    /// The first range refused: pair, address, length. Nothing more of it is written.
    refused: Option<(u32, u64, u64)>,
}

/// Serves an authenticated peer's frames until it closes, breaks the protocol, forges a frame,
/// or stops being an established peer.
fn serve_frames(shared: &Shared, stream: &TcpStream, link: &mut Link) -> Result<(), Refused> {
    let (agent, incarnation) = (link.agent.clone(), link.incarnation);
    let stop = |read: usize| !shared.keep_serving(&agent, incarnation, read == 0);
    let stop_writing = || !shared.keep_serving(&agent, incarnation, false);
    let mut writing: Option<Writing> = None;
    loop {
        if !shared.keep_serving(&agent, incarnation, false) {
            return Ok(());
        }
        let control = frame::read_control(stream, TO_LISTENER, &mut link.incoming, &stop)?;
        let (header, body, deadline) = (control.header, control.body, control.deadline);
        match header.kind {
            Kind::Read => {
                let read = frame::parse_read(&body).map_err(Refused::Malformed)?;
                let mut out =
                    Replies { stream, stop: &stop_writing, tags: &mut link.out, payloads: link.tag_out_payloads };
                for (i, &(addr, len)) in read.ranges.iter().enumerate() {
                    serve_read(shared, &mut out, read.transfer, read.first.wrapping_add(i as u32), addr, len)?;
                }
            }
            Kind::Write => {
                let transfer = frame::u64_at(&body, 0);
                let (pair, addr) = (frame::u32_at(&body, 8), frame::u64_at(&body, 12));
                let n = header.len - CHUNK_PREFIX;
                let w = writing.get_or_insert(Writing { transfer, refused: None });
                if w.transfer != transfer {
                    return Err(Refused::Malformed(format!(
                        "WRITE for transfer {transfer} inside transfer {}",
                        w.transfer
                    )));
                }
                let payload_tags = link.tag_in_payloads.then_some(&mut link.incoming);
                if w.refused.is_none() {
                    let filled = shared.registry.with_bytes_mut(addr, n, |bytes| {
                        frame::read_full(stream, bytes, Some(deadline), &stop)?;
                        frame::check_payload(stream, payload_tags, bytes, deadline, &stop)
                    });
                    match filled {
                        Some(result) => result?,
                        None => {
                            Counters::add(&shared.counters.ranges_refused, 1);
                            w.refused = Some((pair, addr, n as u64));
                            let payload_tags = link.tag_in_payloads.then_some(&mut link.incoming);
                            frame::discard(stream, n, payload_tags, &stop)?;
                        }
                    }
                } else {
                    frame::discard(stream, n, payload_tags, &stop)?;
                }
                Counters::add(&shared.counters.bytes_received, n as u64);
            }
            Kind::WriteEnd => {
                let (transfer, flags, sealed) = (frame::u64_at(&body, 0), body[8], &body[9..]);
                if flags > 1 {
                    return Err(Refused::Malformed(format!("WRITE_END flags {flags:#04x}")));
                }
                let w = writing.take().unwrap_or(Writing { transfer, refused: None });
                if w.transfer != transfer {
                    return Err(Refused::Malformed(format!(
                        "WRITE_END for transfer {transfer} inside transfer {}",
                        w.transfer
                    )));
                }
                let (status, refused) = match (flags & 1 == 1, w.refused) {
                    (true, _) => (AckStatus::Aborted, (0, 0, 0)),
                    (false, Some(refused)) => (AckStatus::NotRegistered, refused),
                    (false, None) => {
                        // Every byte is in memory: only now may the peer's notification count.
                        if !sealed.is_empty() {
                            shared.deliver(&agent, sealed, &|| !stop_writing());
                        }
                        (AckStatus::Written, (0, 0, 0))
                    }
                };
                let ack = frame::write_ack(&mut link.out, transfer, status, refused);
                frame::write_full(stream, &ack, &stop_writing)?;
            }
            Kind::Notify => shared.deliver(&agent, &body, &|| !stop_writing()),
            kind => return Err(Refused::Malformed(format!("{kind:?} is not a request"))),
        }
    }
}

/// Where a connection's replies go, tagged, and when to give up writing them.
struct Replies<'a> {
    stream: &'a TcpStream,
    /// The transport stops, or the peer is gone (past its grace, if its side channel closed).
    stop: &'a dyn Fn() -> bool,
    tags: &'a mut FrameTags,
    /// The peer asked for tags on DATA's bytes.
    payloads: bool,
}

impl Replies<'_> {
    fn write(&self, bytes: &[u8]) -> io::Result<()> {
        frame::write_full(self.stream, bytes, self.stop)
    }
}

/// Answers one range of a READ: its bytes in chunks straight from memory, or RANGE_ERROR when
/// it is not (or stops being) inside one registration.
fn serve_read(shared: &Shared, out: &mut Replies<'_>, transfer: u64, pair: u32, addr: u64, len: u64) -> io::Result<()> {
    let refuse = |out: &mut Replies<'_>| {
        Counters::add(&shared.counters.ranges_refused, 1);
        let error = frame::range_error(out.tags, transfer, pair, addr, len);
        out.write(&error)
    };
    if len == 0 || !shared.registry.holds(addr, len) {
        return refuse(out);
    }
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(MAX_CHUNK as u64) as usize;
        let sent = shared.registry.with_bytes(addr + offset, n, |bytes| {
            let head = frame::chunk_head(out.tags, Kind::Data, transfer, pair, offset, n);
            out.write(&head)?;
            out.write(bytes)?;
            if out.payloads {
                let tag = out.tags.tag(bytes);
                out.write(&tag)?;
            }
            Ok::<(), io::Error>(())
        });
        match sent {
            Some(result) => result?,
            // Deregistered while it was being sent: what went out is void. (The chunk's head
            // was not sent either: `with_bytes` runs nothing for a range it does not hold.)
            None => return refuse(out),
        }
        Counters::add(&shared.counters.bytes_sent, n as u64);
        offset += n as u64;
    }
    Ok(())
}
