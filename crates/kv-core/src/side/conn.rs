//! One side-channel connection before and after its handshake: who opened it, the bytes of
//! its incomplete frame, the stage of the handshake it is in, and why it may fail.

use super::*;

pub(super) enum Side {
    Initiator { address: PeerAddress },
    Listener,
}

pub(super) struct Conn {
    pub(super) side: Side,
    /// The agent the peer's HELLO named (listener side).
    pub(super) claimed: Option<AgentName>,
    /// The incomplete frame that has arrived so far.
    pub(super) buf: Vec<u8>,
    pub(super) received: bool,
    pub(super) deadline: Time,
    pub(super) state: State,
}

/// The session of a connection whose peer proved the key.
pub(super) struct Session {
    pub(super) seal: Direction,
    pub(super) open: Direction,
    pub(super) tag_out: [u8; 32],
    pub(super) tag_in: [u8; 32],
    /// The secret links bound to this session derive their keys from.
    pub(super) export: [u8; 32],
}

impl Session {
    pub(super) fn new(keys: &SessionKeys, initiator: bool) -> Self {
        if initiator {
            Session {
                seal: Direction::new(&keys.seal_i2l),
                open: Direction::new(&keys.seal_l2i),
                tag_out: keys.tag_i2l,
                tag_in: keys.tag_l2i,
                export: keys.export,
            }
        } else {
            Session {
                seal: Direction::new(&keys.seal_l2i),
                open: Direction::new(&keys.seal_i2l),
                tag_out: keys.tag_l2i,
                tag_in: keys.tag_i2l,
                export: keys.export,
            }
        }
    }
}

pub(super) enum State {
    /// Initiator: HELLO queued, waiting for CHALLENGE.
    Helloed { nonce_i: [u8; 32], target: u32, hello: Vec<u8> },
    /// Initiator: PROOF and our OFFER sent, waiting for the listener's OFFER.
    Offered { session: Session, listener: Identity, sent_at: Time },
    /// Listener: waiting for HELLO.
    Accepted { nonce_l: [u8; 32] },
    /// Listener: CHALLENGE sent, waiting for PROOF.
    Challenged {
        hello: Identity,
        transcript: Vec<u8>,
        mac_l: [u8; MAC_BYTES],
        nonce_i: [u8; 32],
        nonce_l: [u8; 32],
        sent_at: Time,
    },
    /// Listener: PROOF verified, waiting for the initiator's OFFER.
    Proven { hello: Identity, session: Session, sent_at: Time },
    /// Both offers exchanged: only watched from now on.
    Established { agent: AgentName, incarnation: u64 },
    /// Moved out while a frame is handled.
    Taken,
}

impl State {
    /// The largest length field a frame may have in this state; 0 for an established
    /// connection, on which v1 allows nothing.
    pub(super) fn frame_limit(&self) -> usize {
        match self {
            State::Helloed { .. } | State::Accepted { .. } | State::Challenged { .. } | State::Taken => MAX_CLEAR_FRAME,
            State::Offered { .. } | State::Proven { .. } => MAX_SEALED_FRAME,
            State::Established { .. } => 0,
        }
    }

    pub(super) fn stage(&self) -> &'static str {
        match self {
            State::Helloed { .. } => "waiting for CHALLENGE",
            State::Offered { .. } => "waiting for the listener's OFFER",
            State::Accepted { .. } => "waiting for HELLO",
            State::Challenged { .. } => "waiting for PROOF",
            State::Proven { .. } => "waiting for the initiator's OFFER",
            State::Established { .. } => "established",
            State::Taken => "busy",
        }
    }

    /// The frame that tells the peer `reason`: a sealed REFUSE once there is a session, else
    /// a clear ERROR.
    pub(super) fn tell(&mut self, reason: &str) -> Vec<u8> {
        match self {
            State::Offered { session, .. } | State::Proven { session, .. } => {
                session.seal.seal(RECORD_REFUSE, truncated(reason, MAX_REFUSE_TEXT).as_bytes())
            }
            _ => frame(Kind::Error, truncated(reason, MAX_ERROR_TEXT).as_bytes()),
        }
    }

    /// How a listener reports a connection that ends in this state without a better reason.
    pub(super) fn abandoned(&self) -> (RefusalCause, &'static str) {
        match self {
            State::Challenged { .. } => (RefusalCause::Unauthenticated, "closed before proving the cluster key"),
            State::Proven { .. } => (RefusalCause::Malformed, "closed before its offer"),
            _ => (RefusalCause::Malformed, "closed before the handshake"),
        }
    }
}

/// Why a connection ends before it is established.
pub(super) struct Failure {
    pub(super) cause: RefusalCause,
    pub(super) reason: String,
    /// What to tell the peer before closing, if anything.
    pub(super) tell: Option<String>,
    /// The initiator's error, when more specific than the reason.
    pub(super) error: Option<TransportError>,
}

impl Failure {
    pub(super) fn new(cause: RefusalCause, reason: impl Into<String>) -> Self {
        Failure { cause, reason: reason.into(), tell: None, error: None }
    }

    /// Tells the peer the reason too.
    pub(super) fn told(mut self) -> Self {
        self.tell = Some(self.reason.clone());
        self
    }

    pub(super) fn telling(mut self, text: impl Into<String>) -> Self {
        self.tell = Some(text.into());
        self
    }

    pub(super) fn error(mut self, error: TransportError) -> Self {
        self.error = Some(error);
        self
    }
}

/// What the bytes of one connection amount to so far.
pub(super) enum Feed {
    /// The bytes are used up; the frame is incomplete.
    NeedMore,
    /// A whole frame.
    Frame(Vec<u8>),
    /// The length field is over the state's limit, or 0.
    Oversized { len: usize, limit: usize },
    /// Bytes on an established connection.
    AfterHandshake,
}

/// Takes what `bytes` holds of the connection's current frame, up to its end.
pub(super) fn feed(c: &mut Conn, bytes: &mut &[u8]) -> Feed {
    c.received = true;
    if matches!(c.state, State::Established { .. }) {
        return Feed::AfterHandshake;
    }
    if c.buf.len() < 4 {
        let take = (4 - c.buf.len()).min(bytes.len());
        c.buf.extend_from_slice(&bytes[..take]);
        *bytes = &bytes[take..];
        if c.buf.len() < 4 {
            return Feed::NeedMore;
        }
    }
    let len = u32::from_be_bytes([c.buf[0], c.buf[1], c.buf[2], c.buf[3]]) as usize;
    let limit = c.state.frame_limit();
    if len == 0 || len > limit {
        return Feed::Oversized { len, limit };
    }
    let total = 4 + len;
    let take = (total - c.buf.len()).min(bytes.len());
    // Grow with what arrived, never to the claimed length ahead of the bytes: at most twice
    // what is buffered, and never past the frame.
    let need = c.buf.len() + take;
    if need > c.buf.capacity() {
        let target = need.max((2 * c.buf.capacity()).min(total));
        c.buf.reserve_exact(target - c.buf.len());
    }
    c.buf.extend_from_slice(&bytes[..take]);
    *bytes = &bytes[take..];
    if c.buf.len() < total {
        return Feed::NeedMore;
    }
    Feed::Frame(std::mem::take(&mut c.buf))
}
