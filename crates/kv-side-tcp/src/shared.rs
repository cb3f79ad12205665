//! A side-channel port that an engine's TP ranks share, as NixlConnector's users configure it
//! (`VLLM_NIXL_SIDE_CHANNEL_PORT` plus the data-parallel rank, one port per engine).
//!
//! One process of the engine accepts on the port (rank 0's worker). It reads the first
//! [`ROUTE_BYTES`] of each connection's HELLO without taking them off the socket (the rank it
//! asks for, and the initiator's role), and hands the socket itself to that rank's process over
//! a Unix socket (`SCM_RIGHTS`): the rank then runs the whole handshake from the HELLO's first
//! byte and owns the connection, so authentication, sessions and close-as-liveness stay per
//! rank, as on a port of the rank's own. A rank whose process is gone (or not started yet) has
//! no Unix socket: the initiator gets an ERROR naming the rank, and the connection closes.
//!
//! Each rank listens on the abstract Unix socket `kvflow-side/PORT/ROLE/tpRANK` (PORT being
//! the shared `host:port` as configured): the kernel frees the name when the process dies, so a
//! restarted rank takes it back at once. The name is reachable by any process of the host's
//! network namespace; both ends check that the other runs under their own user, and a socket
//! handed over is only another unauthenticated connection to the rank's endpoint.
//!
//! Bounds: at most [`MAX_ROUTING`] connections wait for their first bytes at once (one more
//! closes the oldest), each for at most the handshake's deadline; a hand-over waits at most as
//! long for the rank's process, and a rank takes at most [`MAX_ROUTING`] hand-overs at once.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use kv_core::side::route::{error_frame, route, Route, ROUTE_BYTES};
use kv_core::{Role, TransportError};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::channel::{accepted, admit, Shared};

/// Connections on a shared port waiting for their HELLO's first bytes at once; one more closes
/// the oldest.
pub const MAX_ROUTING: usize = 256;

/// How long a connection that sent part of its first bytes waits before it is looked at again.
const PEEK_AGAIN: Duration = Duration::from_millis(5);

/// The abstract Unix socket name of `role`'s rank `rank` on the shared port `port`.
pub(crate) fn socket_name(port: SocketAddr, role: Role, rank: u32) -> String {
    let role = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    format!("kvflow-side/{port}/{role}/tp{rank}")
}

/// Binds this rank's Unix socket for `port`, on the calling thread, so that a rank already
/// taken on this host fails here, naming it.
pub(crate) fn bind_intake(
    port: SocketAddr,
    role: Role,
    rank: u32,
) -> Result<std::os::unix::net::UnixListener, TransportError> {
    use std::os::linux::net::SocketAddrExt;
    let name = socket_name(port, role, rank);
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| TransportError::backend(format!("side channel: the name {name:?}"), e))?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&address).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            TransportError::Backend(format!(
                "side channel: {role:?} rank {rank} of the port {port} is taken on this host \
                 (two engines configured with one port, or this rank started twice)"
            ))
        } else {
            TransportError::backend(format!("side channel cannot listen as {name:?}"), e)
        }
    })?;
    listener.set_nonblocking(true).map_err(|e| TransportError::backend("side channel", e))?;
    Ok(listener)
}

/// Accepts on the shared port for as long as the channel lives, routing each connection.
pub(crate) async fn dispatch(listener: TcpListener, port: SocketAddr, deadline: Duration) {
    let mut routing: VecDeque<tokio::task::AbortHandle> = VecDeque::new();
    let mut displaced = 0u64;
    let what = format!("shared side-channel port {port}");
    loop {
        // One accept, then the routing tasks run (as `serve` does for a port of one's own).
        tokio::task::yield_now().await;
        let Some((stream, from)) = accepted(listener.accept().await, &what).await else { continue };
        routing.retain(|task| !task.is_finished());
        if routing.len() >= MAX_ROUTING {
            if let Some(oldest) = routing.pop_front() {
                oldest.abort();
                displaced += 1;
                if displaced.is_power_of_two() {
                    tracing::warn!(%port, displaced, "shared side-channel port: connections silent past the bound closed");
                }
            }
        }
        let _ = stream.set_nodelay(true);
        routing.push_back(tokio::spawn(route_one(stream, from, port, deadline)).abort_handle());
    }
}

/// Routes one connection: to its rank's process, or an ERROR.
async fn route_one(mut stream: TcpStream, from: SocketAddr, port: SocketAddr, deadline: Duration) {
    let Ok(Some(route)) = tokio::time::timeout(deadline, first_bytes(&stream)).await else {
        tracing::debug!(%from, %port, "shared side-channel port: no HELLO in time; closed");
        return;
    };
    let refusal = match route {
        Route::To { role, rank } => match tokio::time::timeout(deadline, hand_over(&stream, port, role, rank)).await {
            Ok(Ok(())) => return,
            Ok(Err(reason)) => reason,
            Err(_) => format!("{role:?} rank {rank} of {port} did not take the connection in time"),
        },
        Route::Refuse { reason, .. } => reason,
        Route::Incomplete => unreachable!("first_bytes waits for a whole route"),
    };
    tracing::debug!(%from, %port, reason = %refusal, "shared side-channel port: connection refused");
    let _ = stream.write_all(&error_frame(&refusal)).await;
    let _ = stream.shutdown().await;
}

/// The route of the connection's first bytes once they are in; `None` if it closed first.
async fn first_bytes(stream: &TcpStream) -> Option<Route> {
    let mut buf = [0u8; ROUTE_BYTES];
    loop {
        match stream.peek(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => match route(&buf[..n]) {
                Route::Incomplete => tokio::time::sleep(PEEK_AGAIN).await,
                decided => return Some(decided),
            },
        }
    }
}

/// Sends the socket `stream` to the process of `role`'s rank `rank`; our copy then closes
/// with `stream`, the rank's stays open.
async fn hand_over(stream: &TcpStream, port: SocketAddr, role: Role, rank: u32) -> Result<(), String> {
    let name = socket_name(port, role, rank);
    let unix = UnixStream::connect(format!("\0{name}")).await.map_err(|_| {
        format!("{role:?} rank {rank} of the engine at {port} does not listen: its process is gone or not started")
    })?;
    same_user(&unix).map_err(|e| format!("{role:?} rank {rank} of {port}: {e}"))?;
    let fd = [stream.as_raw_fd()];
    let sent = unix
        .async_io(Interest::WRITABLE, || {
            sendmsg::<()>(
                unix.as_raw_fd(),
                &[IoSlice::new(&[1])],
                &[ControlMessage::ScmRights(&fd)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(std::io::Error::from)
        })
        .await;
    match sent {
        Ok(1) => Ok(()),
        Ok(n) => Err(format!("{role:?} rank {rank} of {port}: {n} bytes of the hand-over sent")),
        Err(e) => Err(format!("{role:?} rank {rank} of {port} did not take the connection: {e}")),
    }
}

/// Whether the process at the other end of `unix` runs under this process's user.
fn same_user(unix: &UnixStream) -> Result<(), String> {
    let theirs = unix.peer_cred().map_err(|e| format!("no credentials: {e}"))?.uid();
    let ours = nix::unistd::getuid().as_raw();
    if theirs == ours {
        Ok(())
    } else {
        Err(format!("held by user {theirs}, not this process's user {ours}"))
    }
}

/// Takes the sockets handed to this rank for as long as the channel lives: at most
/// [`MAX_ROUTING`] hand-overs at once (one more is closed unread), each within `deadline`.
pub(crate) async fn intake(listener: UnixListener, shared: Arc<Shared>, deadline: Duration) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ROUTING));
    loop {
        let what = "side channel, taking a handed-over connection";
        let Some((unix, _)) = accepted(listener.accept().await, what).await else { continue };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!("side channel: too many hand-overs at once; one closed unread");
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = same_user(&unix) {
                return tracing::warn!(error = %e, "side channel: a hand-over from another user refused");
            }
            match tokio::time::timeout(deadline, receive(&unix)).await {
                Ok(Ok(stream)) => take(stream, &shared),
                Ok(Err(e)) => tracing::debug!(error = %e, "side channel: a hand-over failed"),
                Err(_) => tracing::debug!("side channel: a hand-over sent nothing in time"),
            }
        });
    }
}

/// The socket one hand-over carries.
async fn receive(unix: &UnixStream) -> std::io::Result<OwnedFd> {
    unix.async_io(Interest::READABLE, || {
        let mut byte = [0u8; 1];
        let mut iov = [IoSliceMut::new(&mut byte)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let message = recvmsg::<()>(unix.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(std::io::Error::from)?;
        let mut taken = None;
        for cmsg in message.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                for fd in fds {
                    let owned = own(fd);
                    // One socket per hand-over; any other is closed as it drops.
                    if taken.is_none() {
                        taken = Some(owned);
                    }
                }
            }
        }
        taken.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "the hand-over carried no socket"))
    })
    .await
}

/// Takes ownership of a descriptor the kernel just installed in this process.
#[allow(unsafe_code)] // One descriptor from SCM_RIGHTS: see the SAFETY note.
fn own(fd: std::os::fd::RawFd) -> OwnedFd {
    // SAFETY: the kernel installed `fd` in this process's table when recvmsg delivered its
    // SCM_RIGHTS message; nothing else in the process knows it, so this is its only owner.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Gives a handed-over socket to the endpoint as a connection accepted on the port.
fn take(fd: OwnedFd, shared: &Arc<Shared>) {
    let stream = std::net::TcpStream::from(fd);
    let (Ok(from), Ok(())) = (stream.peer_addr(), stream.set_nonblocking(true)) else {
        return tracing::debug!("side channel: a handed-over descriptor is no connected TCP socket");
    };
    match TcpStream::from_std(stream) {
        Ok(stream) => admit(stream, from, shared),
        Err(e) => tracing::debug!(error = %e, "side channel: a handed-over connection"),
    }
}
