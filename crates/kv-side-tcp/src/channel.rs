//! The side channel's sockets: kv-core's [`SideEndpoint`] speaks the protocol (authentication,
//! sealed offers, bounds, deadlines); this module only moves its bytes over TCP.
//!
//! Errors are kv-core's [`TransportError`], so that an adapter hands them on as they are.
//!
//! The sockets live on a thread of their own, with a single-threaded tokio runtime that no
//! caller ever enters: a [`SideChannel`] can be made, used and dropped inside or outside an
//! engine's own tokio runtime. That thread drives the endpoint at once as bytes arrive, so a
//! handshake, its deadline and the bounds on unauthenticated connections do not wait for the
//! engine's loop. The endpoint sits behind a mutex that the transport takes too, to seal and
//! open notifications and to collect what happened ([`SideChannel::poll_item`]).
//!
//! One thing the socket thread leaves to the transport: the close of an established peer's
//! connection. It queues [`Item::PeerClosed`], and the transport first collects the
//! notifications that peer sent (on the adapter's data path), opens them while the peer's session still
//! exists, and only then tells the endpoint ([`SideChannel::peer_closed`]), which reports the
//! loss: what a peer said before it died is handled before its death.
//!
//! Bounds: the endpoint's ([`SideLimits`]) on unauthenticated connections (per stage of the
//! handshake and per source address), peers and frame sizes; here, at most
//! `3 * max_unauthenticated + max_peers + 16` sockets (one more is closed at accept and
//! counted), and at most `max_queued_events` refusals waiting for the transport (more are
//! counted, not queued; the endpoint counts every refusal by cause regardless).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::thread::JoinHandle;

use kv_core::side::admission::Stage;
use kv_core::side::{
    ClusterKey, ConnId, LinkSecret, NotifyError, RefusalCause, SideConfig, SideEndpoint, SideEvent, SideLimits,
};
use kv_core::{AgentName, Clock, Handshake, PeerAddress, TransportError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::{mpsc, oneshot, Notify};

/// Sockets beyond the endpoint's own bounds: outgoing connections in flight, and slack.
const SOCKET_SLACK: usize = 16;

/// What the socket thread hands the transport, in order.
#[derive(Debug)]
pub enum Item {
    /// An endpoint event.
    Event(SideEvent),
    /// An established peer's connection closed: collect its notifications, then call
    /// [`SideChannel::peer_closed`].
    PeerClosed(ConnId),
}

/// What the side channel has seen, for bounds checks and logs.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SideStatus {
    /// Established peers.
    pub peers: usize,
    /// Connections open and not yet established, ours and accepted ones.
    pub pending: usize,
    /// Accepted connections waiting in each stage of the handshake (for HELLO, for PROOF, for
    /// the OFFER), indexed as [`Stage::ALL`].
    pub pending_by_stage: [usize; 3],
    /// Accepted connections refused so far, displaced ones (`overloaded`) included, by cause,
    /// indexed as [`RefusalCause::ALL`].
    pub refused_by_cause: [u64; RefusalCause::ALL.len()],
    /// Sockets the channel holds open.
    pub sockets: usize,
    /// Bytes held for incomplete frames.
    pub buffered_bytes: usize,
    /// Connections closed at accept because the socket bound was reached.
    pub sockets_refused: u64,
    /// Refusals counted but not queued because the queue for the transport was full.
    pub refusals_dropped: u64,
}

/// Bytes for a connection's socket, or the order to close it once they are written.
enum Out {
    Bytes(Vec<u8>),
    Close,
}

struct Io {
    side: SideEndpoint,
    /// Every connection the endpoint knows that has (or will have) a socket.
    sockets: HashMap<ConnId, mpsc::UnboundedSender<Out>>,
    established: HashSet<ConnId>,
    items: VecDeque<Item>,
    next_conn: u64,
    max_sockets: usize,
    max_queued: usize,
    sockets_refused: u64,
    refusals_dropped: u64,
    /// The engine's waker, woken whenever an item is queued.
    waker: Option<Waker>,
}

impl Io {
    /// Queues `item` for the transport and wakes the engine.
    fn queue(&mut self, item: Item) {
        self.items.push_back(item);
        if let Some(waker) = &self.waker {
            waker.wake_by_ref();
        }
    }

    /// Carries out what the endpoint asked for: bytes to sockets, closes, events to the queue.
    fn pump(&mut self) {
        while let Some(t) = self.side.poll_transmit() {
            if let Some(out) = self.sockets.get(&t.conn) {
                let _ = out.send(Out::Bytes(t.bytes));
            }
        }
        while let Some(conn) = self.side.poll_close() {
            self.established.remove(&conn);
            if let Some(out) = self.sockets.remove(&conn) {
                let _ = out.send(Out::Close);
            }
        }
        while let Some(event) = self.side.poll_event() {
            match &event {
                SideEvent::Connected { conn, .. } => {
                    self.established.insert(*conn);
                }
                SideEvent::Refused { .. } if self.items.len() >= self.max_queued => {
                    self.refusals_dropped += 1;
                    continue;
                }
                SideEvent::Refused { .. } => {
                    // Refusals wait for the engine's next wake-up rather than cause one: a flood
                    // of them must not keep the engine's thread stepping (the endpoint counts
                    // each by cause in any case).
                    self.items.push_back(Item::Event(event));
                    continue;
                }
                _ => {}
            }
            self.queue(Item::Event(event));
        }
    }

    fn next_conn(&mut self) -> ConnId {
        self.next_conn += 1;
        ConnId(self.next_conn)
    }
}

pub(crate) struct Shared {
    io: Mutex<Io>,
    clock: Arc<dyn Clock>,
    /// How long a connection we open may take to connect.
    connect_timeout: std::time::Duration,
    /// Wakes the timer when the endpoint's next deadline may have moved.
    timer: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Io> {
        self.io.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the endpoint at the current time, then carries out what it asked for.
    fn drive(&self, f: impl FnOnce(&mut SideEndpoint, kv_core::Time)) {
        let mut io = self.lock();
        f(&mut io.side, self.clock.now());
        io.pump();
        drop(io);
        self.timer.notify_one();
    }

    /// Gives a new connection a queue for its socket and tells the endpoint of it (`start`),
    /// unless `bounded` and the channel holds its most sockets already (then counted).
    fn open(
        &self,
        bounded: bool,
        start: impl FnOnce(&mut SideEndpoint, kv_core::Time, ConnId),
    ) -> Option<(ConnId, mpsc::UnboundedReceiver<Out>)> {
        let mut io = self.lock();
        if bounded && io.sockets.len() >= io.max_sockets {
            io.sockets_refused += 1;
            return None;
        }
        let conn = io.next_conn();
        let (out, outgoing) = mpsc::unbounded_channel();
        io.sockets.insert(conn, out);
        start(&mut io.side, self.clock.now(), conn);
        io.pump();
        drop(io);
        self.timer.notify_one();
        Some((conn, outgoing))
    }

    /// A connection's socket closed or failed, seen from the socket thread.
    fn socket_closed(&self, conn: ConnId) {
        let mut io = self.lock();
        if !io.sockets.contains_key(&conn) {
            // The endpoint closed it itself.
            return;
        }
        if io.established.contains(&conn) {
            io.queue(Item::PeerClosed(conn));
            return;
        }
        io.sockets.remove(&conn);
        let now = self.clock.now();
        io.side.handle_closed(now, conn);
        io.pump();
        drop(io);
        self.timer.notify_one();
    }
}

/// Fresh random bytes for a handshake nonce, from the operating system.
pub fn nonce() -> Result<[u8; 32], TransportError> {
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce).map_err(|e| TransportError::Backend(format!("no randomness for a nonce: {e}")))?;
    Ok(nonce)
}

/// The side channel of one agent: a listener, the connections, and the endpoint.
pub struct SideChannel {
    shared: Arc<Shared>,
    runtime: tokio::runtime::Handle,
    local: SocketAddr,
    /// What peers dial: `local`, or `local` naming this rank on a shared port.
    address: PeerAddress,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl SideChannel {
    /// Binds the listener on the calling thread (so that a bad address fails here), then
    /// starts the socket thread: a port of this rank's own.
    pub fn start(
        bind: SocketAddr,
        key: ClusterKey,
        limits: SideLimits,
        offer: Handshake,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, TransportError> {
        Self::start_on(bind, PortPlan::Own, key, limits, offer, clock)
    }

    /// Starts a side channel at `bind` as `plan` says: a port of this rank's own, as
    /// [`SideChannel::start`], or a port the engine's ranks share (see [`crate::shared`]), where
    /// this rank takes the connections whose HELLO asks for its rank (and comes from the other
    /// role), handed to it by the process that accepts on the port (this one if `accept`).
    /// Peers dial [`SideChannel::address`]. A shared port fails, naming it, if it is 0, if this
    /// rank is taken on this host, or (`accept`) if the port is.
    pub fn start_on(
        bind: SocketAddr,
        plan: PortPlan,
        key: ClusterKey,
        limits: SideLimits,
        offer: Handshake,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, TransportError> {
        let listen = match plan {
            PortPlan::Own => Listen::Own(bind),
            PortPlan::Shared { accept } => Listen::Shared { port: bind, accept },
        };
        Self::launch(listen, key, limits, offer, clock)
    }

    fn launch(
        listen: Listen,
        key: ClusterKey,
        limits: SideLimits,
        offer: Handshake,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, TransportError> {
        let max_sockets = Stage::ALL.len() * limits.max_unauthenticated + limits.max_peers + SOCKET_SLACK;
        let max_queued = limits.max_queued_events;
        let connect_timeout = limits.auth_timeout;
        let (role, rank) = (offer.role, offer.rank);
        let side = SideEndpoint::new(SideConfig { key, limits }, offer)
            .map_err(|e| TransportError::Backend(format!("side channel: {e}")))?;
        let tcp = |bind: SocketAddr| -> Result<std::net::TcpListener, TransportError> {
            let listener = crate::listen(bind)
                .map_err(|e| TransportError::backend(format!("side channel cannot listen on {bind}"), e))?;
            listener.set_nonblocking(true).map_err(|e| TransportError::backend("side channel", e))?;
            Ok(listener)
        };
        let (local, address, own, intake, dispatch) = match listen {
            Listen::Own(bind) => {
                let listener = tcp(bind)?;
                let local = listener.local_addr().map_err(|e| TransportError::backend("side channel", e))?;
                (local, PeerAddress(local.to_string()), Some(listener), None, None)
            }
            Listen::Shared { port, .. } if port.port() == 0 => {
                return Err(TransportError::Backend(format!(
                "side channel: a port the engine's ranks share must be given ({port} lets each process pick its own)"
            )))
            }
            Listen::Shared { port, accept } => {
                let intake = crate::shared::bind_intake(port, role, rank)?;
                let dispatch = if accept { Some(tcp(port)?) } else { None };
                (port, PeerAddress::of_rank(&port.to_string(), rank), None, Some(intake), dispatch)
            }
        };
        let io = Io {
            side,
            sockets: HashMap::new(),
            established: HashSet::new(),
            items: VecDeque::new(),
            next_conn: 0,
            max_sockets,
            max_queued,
            sockets_refused: 0,
            refusals_dropped: 0,
            waker: None,
        };
        let shared = Arc::new(Shared { io: Mutex::new(io), clock, connect_timeout, timer: Notify::new() });
        let (shutdown, stop) = oneshot::channel();
        let (started, handle) = std::sync::mpsc::channel();
        let serving = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvflow-side-channel".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = started.send(Err(format!("side channel runtime: {e}")));
                        return;
                    }
                };
                let _ = started.send(Ok(runtime.handle().clone()));
                runtime.block_on(async move {
                    let deadline = connect_timeout;
                    let (own, intake, dispatch) = match registered(own, intake, dispatch) {
                        Ok(listeners) => listeners,
                        Err(e) => return tracing::error!(error = %e, "side channel listener"),
                    };
                    let own = async {
                        match own {
                            Some(listener) => serve(listener, serving.clone()).await,
                            None => std::future::pending().await,
                        }
                    };
                    let intake = async {
                        match intake {
                            Some(listener) => crate::shared::intake(listener, serving.clone(), deadline).await,
                            None => std::future::pending().await,
                        }
                    };
                    let dispatch = async {
                        match dispatch {
                            Some(listener) => crate::shared::dispatch(listener, local, deadline).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = stop => {}
                        _ = own => {}
                        _ = intake => {}
                        _ = dispatch => {}
                        _ = timer(serving.clone()) => {}
                    }
                });
                // On its own thread, this ends every task and socket; a name lookup that is
                // still running is not waited for long.
                runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            })
            .map_err(|e| TransportError::backend("side channel thread", e))?;
        let runtime = handle
            .recv()
            .map_err(|_| TransportError::Backend("side channel thread ended at start".into()))?
            .map_err(TransportError::Backend)?;
        tracing::debug!(%local, "side channel listening");
        Ok(SideChannel { shared, runtime, local, address, shutdown: Some(shutdown), thread: Some(thread) })
    }

    /// Replaces the offer that handshakes from now on send.
    pub fn set_offer(&self, offer: Handshake) -> Result<(), TransportError> {
        self.shared.lock().side.set_offer(offer).map_err(|e| TransportError::backend("side channel", e))
    }

    /// The offer handshakes send.
    pub fn offer(&self) -> Handshake {
        self.shared.lock().side.offer().clone()
    }

    /// Where the listener listens (a shared port: the port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// What peers dial to reach this rank: `host:port`, or `host:port/tpRANK` on a port the
    /// engine's ranks share.
    pub fn address(&self) -> &PeerAddress {
        &self.address
    }

    /// Starts a handshake with the listener at `address` (`host:port`, or `host:port/tpRANK`
    /// for one rank of an engine whose ranks share the port); the outcome comes as an event.
    pub fn connect(&self, address: &PeerAddress) -> Result<(), TransportError> {
        let nonce = nonce()?;
        // Our own connections are not held to the socket bound: the engine asks for them.
        let (conn, outgoing) = self
            .shared
            .open(false, |side, now, conn| side.handle_connect(now, conn, address.clone(), nonce))
            .ok_or_else(|| TransportError::Backend("side channel: no socket for a connection".into()))?;
        let shared = self.shared.clone();
        let address = address.clone();
        self.runtime.spawn(async move {
            let dial = address.side_target().0;
            match tokio::time::timeout(shared.connect_timeout, TcpStream::connect(dial)).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    run_socket(stream, conn, outgoing, Vec::new(), shared).await;
                }
                _ => shared.socket_closed(conn),
            }
        });
        Ok(())
    }

    /// Wakes `waker` whenever an item is queued from now on, and at once if one is queued.
    pub fn set_waker(&self, waker: Waker) {
        let mut io = self.shared.lock();
        if !io.items.is_empty() {
            waker.wake_by_ref();
        }
        io.waker = Some(waker);
    }

    /// The next thing that happened, if any.
    pub fn poll_item(&self) -> Option<Item> {
        self.shared.lock().items.pop_front()
    }

    /// An established connection closed (after [`Item::PeerClosed`]), or the transport drops
    /// a peer it cannot use: the endpoint reports the peer lost and the socket closes.
    pub fn peer_closed(&self, conn: ConnId) {
        self.shared.drive(|side, now| side.handle_closed(now, conn));
    }

    /// Tags `payload` for the peer `to` (see [`SideEndpoint::seal_notification`]).
    pub fn seal(&self, to: &AgentName, payload: &[u8]) -> Result<Vec<u8>, NotifyError> {
        self.shared.lock().side.seal_notification(to, payload)
    }

    /// Opens a tagged notification from `from` (see [`SideEndpoint::open_notification`]).
    pub fn open(&self, from: &AgentName, sealed: &[u8]) -> Result<Vec<u8>, NotifyError> {
        self.shared.lock().side.open_notification(from, sealed)
    }

    /// A handle that opens notifications ([`SideChannel::open`]) from another thread, for as
    /// long as it is kept: a transport that takes notifications in on a thread of its own.
    pub fn opener(&self) -> NotificationOpener {
        NotificationOpener(self.shared.clone())
    }

    /// The secret of links bound to the session with the established peer `peer` (see
    /// [`SideEndpoint::link_secret`]).
    pub fn link_secret(&self, peer: &AgentName, label: &str) -> Option<LinkSecret> {
        self.shared.lock().side.link_secret(peer, label)
    }

    /// What the channel holds now.
    pub fn status(&self) -> SideStatus {
        self.status_probe().status()
    }

    /// A handle that reads [`SideChannel::status`] from another thread (an engine's metrics
    /// endpoint), for as long as it is kept; it holds the channel's state, not its thread.
    pub fn status_probe(&self) -> SideProbe {
        SideProbe(self.shared.clone())
    }
}

/// Opens a side channel's notifications from any thread (see [`SideChannel::opener`]).
#[derive(Clone)]
pub struct NotificationOpener(Arc<Shared>);

impl std::fmt::Debug for NotificationOpener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NotificationOpener").finish_non_exhaustive()
    }
}

impl NotificationOpener {
    /// Opens a tagged notification from `from`, as [`SideChannel::open`] does.
    pub fn open(&self, from: &AgentName, sealed: &[u8]) -> Result<Vec<u8>, NotifyError> {
        self.0.lock().side.open_notification(from, sealed)
    }
}

/// Reads a side channel's status from any thread (see [`SideChannel::status_probe`]).
#[derive(Clone)]
pub struct SideProbe(Arc<Shared>);

impl std::fmt::Debug for SideProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SideProbe").finish_non_exhaustive()
    }
}

impl SideProbe {
    /// What the channel holds now, and what it refused so far.
    pub fn status(&self) -> SideStatus {
        let io = self.0.lock();
        SideStatus {
            peers: io.side.peer_count(),
            pending: io.side.pending_count(),
            pending_by_stage: Stage::ALL.map(|stage| io.side.pending_in(stage)),
            refused_by_cause: io.side.refused_by_cause(),
            sockets: io.sockets.len(),
            buffered_bytes: io.side.buffered_bytes(),
            sockets_refused: io.sockets_refused,
            refusals_dropped: io.refusals_dropped + io.side.refusals_dropped(),
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            // The thread only drops its runtime; joining does not wait on anything of ours.
            let _ = thread.join();
        }
    }
}

/// Whether a side channel listens on a port of its rank's own or on one that the engine's
/// ranks share ([`crate::shared`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum PortPlan {
    /// A port of the rank's own: peers dial `host:port`.
    #[default]
    Own,
    /// A port the engine's ranks share: peers dial `host:port/tpRANK`. `accept` for the one
    /// process that accepts on the port for them all (rank 0's).
    Shared {
        /// Whether this process accepts on the port.
        accept: bool,
    },
}

/// How a side channel listens.
enum Listen {
    /// A port of this rank's own.
    Own(SocketAddr),
    /// A port the engine's ranks share; `accept`: this process accepts on it for them all.
    Shared { port: SocketAddr, accept: bool },
}

type Listeners = (Option<TcpListener>, Option<UnixListener>, Option<TcpListener>);

/// The listeners bound on the caller's thread, registered with the socket thread's runtime.
fn registered(
    own: Option<std::net::TcpListener>,
    intake: Option<std::os::unix::net::UnixListener>,
    dispatch: Option<std::net::TcpListener>,
) -> std::io::Result<Listeners> {
    Ok((
        own.map(TcpListener::from_std).transpose()?,
        intake.map(UnixListener::from_std).transpose()?,
        dispatch.map(TcpListener::from_std).transpose()?,
    ))
}

/// Accepts connections for as long as the channel lives.
async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        // One accept, then the connections' tasks run: under a flood the kernel's queue always
        // holds another connection, and a loop that accepted in batches would outrun the tasks,
        // displacing connections whose answers (a real engine's PROOF) wait unread. Measured
        // under a churn of 2,000 sockets on 2 busy cores: batches of 16 lost a key holder's
        // handshake in one of ten, one at a time none in forty.
        tokio::task::yield_now().await;
        let Some((stream, from)) = accepted(listener.accept().await, "side channel").await else { continue };
        admit(stream, from, &shared);
    }
}

/// What an accept gave, or `None` after a warning naming `what` and a 10 ms pause: an accept
/// fails when the process is out of file descriptors, most often, and closing connections
/// free some soon.
pub(crate) async fn accepted<T>(result: std::io::Result<T>, what: &str) -> Option<T> {
    match result {
        Ok(accepted) => Some(accepted),
        Err(error) => {
            tracing::warn!(%error, "{what}: accept failed");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            None
        }
    }
}

/// Gives the endpoint a connection accepted from `from` (on our port, or handed over by the
/// process that accepts on a port the engine's ranks share), and runs its socket.
pub(crate) fn admit(stream: TcpStream, from: SocketAddr, shared: &Arc<Shared>) {
    let Ok(nonce) = nonce() else { return };
    let source = from.ip();
    let Some((conn, mut outgoing)) = shared.open(true, |side, now, conn| side.handle_accept(now, conn, source, nonce))
    else {
        return tracing::debug!(%from, "side channel at its socket bound; closed");
    };
    let _ = stream.set_nodelay(true);
    // A real engine's HELLO is in by the time its connection is accepted: take it now, and
    // answer, so that the connection is greeted (ranked above silent ones) before the next
    // accept can displace it, rather than once its task first runs.
    let unsent = greet_at_once(&stream, conn, &mut outgoing, shared);
    tokio::spawn(run_socket(stream, conn, outgoing, unsent, shared.clone()));
}

/// Feeds the endpoint what arrived on a connection just accepted, and writes what it answered
/// as far as the socket takes it without waiting; returns what is left to write.
fn greet_at_once(
    stream: &TcpStream,
    conn: ConnId,
    outgoing: &mut mpsc::UnboundedReceiver<Out>,
    shared: &Shared,
) -> Vec<Out> {
    let mut buf = [0u8; 1024];
    if let Ok(n) = stream.try_read(&mut buf) {
        if n > 0 {
            shared.drive(|side, now| side.handle_bytes(now, conn, &buf[..n]));
        }
    }
    let mut unsent = Vec::new();
    while let Ok(out) = outgoing.try_recv() {
        match out {
            Out::Bytes(bytes) if unsent.is_empty() => match stream.try_write(&bytes) {
                Ok(n) if n == bytes.len() => {}
                Ok(n) => unsent.push(Out::Bytes(bytes[n..].to_vec())),
                Err(_) => unsent.push(Out::Bytes(bytes)),
            },
            other => unsent.push(other),
        }
    }
    unsent
}

/// Calls the endpoint's `handle_timeout` at each deadline it asks for.
async fn timer(shared: Arc<Shared>) {
    loop {
        let deadline = shared.lock().side.poll_timeout();
        match deadline {
            Some(deadline) => {
                let wait = deadline.saturating_since(shared.clock.now());
                tokio::select! {
                    _ = tokio::time::sleep(wait) => shared.drive(|side, now| side.handle_timeout(now)),
                    _ = shared.timer.notified() => {}
                }
            }
            None => shared.timer.notified().await,
        }
    }
}

/// Moves one connection's bytes: what arrives to the endpoint, what it queued to the socket,
/// until either side closes.
async fn run_socket(
    mut stream: TcpStream,
    conn: ConnId,
    mut outgoing: mpsc::UnboundedReceiver<Out>,
    first: Vec<Out>,
    shared: Arc<Shared>,
) {
    let (mut reader, mut writer) = stream.split();
    for out in first {
        match out {
            Out::Bytes(bytes) => {
                if writer.write_all(&bytes).await.is_err() {
                    return shared.socket_closed(conn);
                }
            }
            Out::Close => {
                let _ = writer.shutdown().await;
                return;
            }
        }
    }
    let mut buf = [0u8; 4096];
    loop {
        tokio::select! {
            out = outgoing.recv() => match out {
                Some(Out::Bytes(bytes)) => {
                    if writer.write_all(&bytes).await.is_err() {
                        break shared.socket_closed(conn);
                    }
                }
                // Closed by the endpoint, after what it queued before: nothing to report.
                Some(Out::Close) | None => {
                    let _ = writer.shutdown().await;
                    break;
                }
            },
            read = reader.read(&mut buf) => match read {
                Ok(0) | Err(_) => break shared.socket_closed(conn),
                Ok(n) => shared.drive(|side, now| side.handle_bytes(now, conn, &buf[..n])),
            },
        }
    }
}
