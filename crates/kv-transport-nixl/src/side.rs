//! The side channel: a TCP connection per peer that carries the handshake, then stays open
//! so that its loss says the peer is gone.
//!
//! Frames are a 4-byte big-endian length and a body of at most
//! [`kv_core::wire::MAX_HANDSHAKE_BYTES`]. The initiator sends its [`Handshake`]; the
//! listener checks it and answers with its own (or with a refusal text, when it cannot even
//! parse the offer); both sides run [`check_compatible`], so both refuse with the same error
//! naming both values. An accepted connection is then only watched: EOF or an error is a
//! lost peer. The listener keeps serving after any refusal.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kv_core::wire::MAX_HANDSHAKE_BYTES;
use kv_core::{check_compatible, AgentName, Clock, Handshake, PeerAddress, Time, TransportError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A refusal's frame starts with these bytes, then UTF-8 text.
const REFUSAL: &[u8; 2] = b"KX";

/// What the side channel tells the transport.
#[derive(Debug)]
pub(crate) enum SideEvent {
    /// A handshake completed; the peer's metadata still has to be loaded into the agent.
    Accepted { handshake: Box<Handshake>, sent_at: Time, received_at: Time },
    /// A connection we started failed.
    ConnectFailed { address: PeerAddress, error: TransportError },
    /// An incoming handshake was refused.
    Refused { peer: AgentName, error: TransportError },
    /// A peer's connection closed.
    Lost(AgentName),
}

/// Counts of bad input the listener dropped.
#[derive(Debug, Default)]
pub struct SideStats {
    /// Handshake frames that were malformed, oversized or timed out.
    pub malformed: AtomicU64,
}

pub(crate) struct SideChannel {
    runtime: tokio::runtime::Runtime,
    local: SocketAddr,
    events: mpsc::Receiver<SideEvent>,
    sender: mpsc::Sender<SideEvent>,
    offer: Arc<RwLock<Handshake>>,
    clock: Arc<dyn Clock>,
    timeout: Duration,
    pub(crate) stats: Arc<SideStats>,
}

impl SideChannel {
    /// Binds the listener and starts serving.
    pub(crate) fn start(
        bind: SocketAddr,
        offer: Handshake,
        clock: Arc<dyn Clock>,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvflow-side-channel")
            .enable_all()
            .build()
            .map_err(|e| TransportError::Backend(format!("side channel runtime: {e}")))?;
        let listener = runtime
            .block_on(TcpListener::bind(bind))
            .map_err(|e| TransportError::Backend(format!("side channel cannot listen on {bind}: {e}")))?;
        let local = listener.local_addr().map_err(|e| TransportError::Backend(e.to_string()))?;
        let (sender, events) = mpsc::channel();
        let offer = Arc::new(RwLock::new(offer));
        let stats = Arc::new(SideStats::default());
        let side = SideChannel { runtime, local, events, sender, offer, clock, timeout, stats };
        side.runtime.spawn(serve(listener, side.context()));
        tracing::debug!(%local, "side channel listening");
        Ok(side)
    }

    fn context(&self) -> Context {
        Context {
            offer: self.offer.clone(),
            clock: self.clock.clone(),
            sender: self.sender.clone(),
            timeout: self.timeout,
            stats: self.stats.clone(),
        }
    }

    /// Replaces the agent metadata the offer carries (it lists the agent's registrations).
    pub(crate) fn set_agent_metadata(&self, metadata: Vec<u8>) {
        self.offer.write().unwrap_or_else(std::sync::PoisonError::into_inner).agent_metadata = metadata;
    }

    /// Where the listener listens.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Starts a handshake with the listener at `address` (`host:port`).
    pub(crate) fn connect(&self, address: &PeerAddress) {
        self.runtime.spawn(connect(address.clone(), self.context()));
    }

    /// The next event, if any.
    pub(crate) fn try_event(&self) -> Option<SideEvent> {
        self.events.try_recv().ok()
    }
}

#[derive(Clone)]
struct Context {
    offer: Arc<RwLock<Handshake>>,
    clock: Arc<dyn Clock>,
    sender: mpsc::Sender<SideEvent>,
    timeout: Duration,
    stats: Arc<SideStats>,
}

impl Context {
    fn offer(&self) -> Handshake {
        self.offer.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn stamped_offer(&self) -> Result<Vec<u8>, TransportError> {
        let mut offer = self.offer();
        offer.clock = self.clock.now();
        offer.encode().map_err(|e| TransportError::Backend(format!("own handshake does not encode: {e}")))
    }

    fn emit(&self, event: SideEvent) {
        // The transport may be gone; then nobody needs to know.
        let _ = self.sender.send(event);
    }
}

async fn serve(listener: TcpListener, ctx: Context) {
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                tokio::spawn(accept(stream, from, ctx.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "side channel accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn read_frame(stream: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await.map_err(|e| format!("cannot read a frame: {e}"))?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_HANDSHAKE_BYTES {
        return Err(format!("handshake frame of {len} bytes exceeds the {MAX_HANDSHAKE_BYTES}-byte limit"));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.map_err(|e| format!("truncated frame of {len} bytes: {e}"))?;
    Ok(body)
}

async fn write_frame(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    stream.write_all(&(body.len() as u32).to_be_bytes()).await?;
    stream.write_all(body).await?;
    stream.flush().await
}

async fn refuse(stream: &mut TcpStream, reason: &str) {
    let mut body = REFUSAL.to_vec();
    body.extend_from_slice(reason.as_bytes());
    let _ = write_frame(stream, &body).await;
}

async fn accept(mut stream: TcpStream, from: SocketAddr, ctx: Context) {
    let frame = match tokio::time::timeout(ctx.timeout, read_frame(&mut stream)).await {
        Ok(Ok(frame)) => frame,
        Ok(Err(reason)) => {
            ctx.stats.malformed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, %reason, "bad handshake");
            return refuse(&mut stream, &reason).await;
        }
        Err(_) => {
            ctx.stats.malformed.fetch_add(1, Ordering::Relaxed);
            let reason = format!("no handshake within {:?}", ctx.timeout);
            tracing::warn!(%from, %reason, "bad handshake");
            return refuse(&mut stream, &reason).await;
        }
    };
    let received_at = ctx.clock.now();
    let peer = match Handshake::decode(&frame) {
        Ok(peer) => peer,
        Err(e) => {
            ctx.stats.malformed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, error = %e, "malformed handshake");
            return refuse(&mut stream, &format!("malformed handshake: {e}")).await;
        }
    };
    let agent = AgentName::new(peer.engine.clone(), peer.rank);
    // Answer with our offer even when refusing, so that the initiator names both values too.
    let answer = match ctx.stamped_offer() {
        Ok(answer) => answer,
        Err(e) => return refuse(&mut stream, &e.to_string()).await,
    };
    if write_frame(&mut stream, &answer).await.is_err() {
        return;
    }
    if let Err(error) = check_compatible(&ctx.offer(), &peer) {
        tracing::warn!(peer = %agent, %error, "handshake refused");
        ctx.emit(SideEvent::Refused { peer: agent, error: error.into() });
        return;
    }
    let sent_at = received_at;
    ctx.emit(SideEvent::Accepted { handshake: Box::new(peer), sent_at, received_at });
    watch(stream, agent, ctx).await;
}

async fn connect(address: PeerAddress, ctx: Context) {
    let result = tokio::time::timeout(ctx.timeout, handshake(&address, &ctx)).await;
    let result = result.unwrap_or_else(|_| Err(TransportError::Backend(format!("handshake with {address} timed out"))));
    match result {
        Ok((stream, peer, sent_at, received_at)) => {
            let agent = AgentName::new(peer.engine.clone(), peer.rank);
            ctx.emit(SideEvent::Accepted { handshake: Box::new(peer), sent_at, received_at });
            watch(stream, agent, ctx).await;
        }
        Err(error) => ctx.emit(SideEvent::ConnectFailed { address, error }),
    }
}

async fn handshake(address: &PeerAddress, ctx: &Context) -> Result<(TcpStream, Handshake, Time, Time), TransportError> {
    let mut stream =
        TcpStream::connect(address.0.as_str()).await.map_err(|_| TransportError::Unreachable(address.clone()))?;
    let _ = stream.set_nodelay(true);
    let sent_at = ctx.clock.now();
    let offer = ctx.stamped_offer()?;
    write_frame(&mut stream, &offer).await.map_err(|e| TransportError::Backend(format!("{address}: {e}")))?;
    let frame = read_frame(&mut stream).await.map_err(|e| TransportError::Backend(format!("{address}: {e}")))?;
    let received_at = ctx.clock.now();
    if let Some(reason) = frame.strip_prefix(REFUSAL.as_slice()) {
        return Err(TransportError::Backend(format!("{address} refused: {}", String::from_utf8_lossy(reason))));
    }
    let peer = Handshake::decode(&frame).map_err(|e| TransportError::Backend(format!("{address}: {e}")))?;
    check_compatible(&ctx.offer(), &peer)?;
    Ok((stream, peer, sent_at, received_at))
}

/// Waits for the connection to close; then the peer is lost.
async fn watch(mut stream: TcpStream, agent: AgentName, ctx: Context) {
    let mut sink = [0u8; 64];
    loop {
        match stream.read(&mut sink).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    tracing::debug!(peer = %agent, "side channel closed");
    ctx.emit(SideEvent::Lost(agent));
}
