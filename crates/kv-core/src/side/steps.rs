//! The handshake's steps: what an endpoint does with each whole frame a connection brings,
//! in the order `docs/side-channel.md` gives (HELLO, CHALLENGE, PROOF, the two sealed OFFERs).

use super::frame::Greeting;
use super::*;

impl SideEndpoint {
    /// Makes `id` the connection of the peer that sent `offer`, replacing an older incarnation;
    /// `dialed` is where we connected to reach it (`None`: it connected to us).
    pub(super) fn establish(
        &mut self,
        now: Time,
        id: ConnId,
        offer: Handshake,
        sent_at: Time,
        session: Session,
        dialed: Option<PeerAddress>,
    ) {
        let agent = AgentName::new(offer.engine.clone(), offer.rank);
        if let Some(old) = self.peers.get(&agent).map(|p| p.conn) {
            self.lose(old);
        }
        let peer = Peer {
            conn: id,
            incarnation: offer.instance,
            role: offer.role,
            tags: Tags::new(session.tag_out, session.tag_in),
            export: session.export,
        };
        self.peers.insert(agent.clone(), peer);
        let info = PeerInfo { agent, handshake: offer, sent_at, received_at: now, dialed };
        self.events.push_back(SideEvent::Connected { conn: id, info: Box::new(info) });
    }

    /// Our offer, stamped with `now`.
    pub(super) fn stamped_offer(&mut self, now: Time) -> Result<Vec<u8>, Failure> {
        self.offer.clock = now;
        self.offer
            .encode()
            .map_err(|e| Failure::new(RefusalCause::Malformed, format!("own offer does not encode: {e}")))
    }

    pub(super) fn on_frame(&mut self, now: Time, id: ConnId, frame: Vec<u8>) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let mut state = std::mem::replace(&mut c.state, State::Taken);
        let address = match &c.side {
            Side::Initiator { address } => Some(address.clone()),
            Side::Listener => None,
        };
        let result = self.step(now, id, &mut state, address.as_ref(), &frame);
        let Some(c) = self.conns.get_mut(&id) else { return };
        match result {
            Ok(Some(next)) => {
                let stage = match next {
                    State::Challenged { .. } => Some(Stage::Greeted),
                    State::Proven { .. } => Some(Stage::Proven),
                    _ => None,
                };
                let established = matches!(next, State::Established { .. });
                let offered = matches!(next, State::Offered { .. });
                c.state = next;
                if established {
                    self.deadlines.remove(&(c.deadline, id));
                    self.admission.remove(id);
                }
                if offered {
                    // Our PROOF and OFFER are out: the listener's OFFER gets a deadline of its
                    // own ([`OFFER_WAIT_FACTOR`]).
                    self.deadlines.remove(&(c.deadline, id));
                    c.deadline = now + self.config.limits.auth_timeout * OFFER_WAIT_FACTOR;
                    self.deadlines.insert((c.deadline, id));
                }
                // Only a listener's connections are in the book; a stage further displaces at
                // most one connection of that stage, never this one.
                if let Some(stage) = stage {
                    let evicted = self.admission.advance(id, stage);
                    self.evict(evicted);
                }
            }
            Ok(None) => c.state = state,
            Err(failure) => {
                c.state = state;
                self.fail(id, failure);
            }
        }
    }

    /// Handles one whole frame; `Ok(Some(state))` moves on, `Err` ends the connection.
    pub(super) fn step(
        &mut self,
        now: Time,
        id: ConnId,
        state: &mut State,
        address: Option<&PeerAddress>,
        frame: &[u8],
    ) -> Result<Option<State>, Failure> {
        let kind_byte = frame[4];
        let body = &frame[HEADER_BYTES..];
        let Some(kind) = Kind::from_byte(kind_byte) else {
            return Err(Failure::new(RefusalCause::Malformed, format!("unknown frame kind {kind_byte}")).told());
        };
        match (&mut *state, kind, address) {
            (State::Accepted { nonce_l }, Kind::Hello, None) => {
                let nonce_l = *nonce_l;
                self.on_hello(now, id, nonce_l, frame).map(Some)
            }
            (State::Helloed { nonce_i, target, hello }, Kind::Challenge, Some(address)) => {
                let (nonce_i, target, hello) = (*nonce_i, *target, std::mem::take(hello));
                self.on_challenge(now, id, address, (nonce_i, target), &hello, frame).map(Some)
            }
            (State::Challenged { hello, transcript, mac_l, nonce_i, nonce_l, sent_at }, Kind::Proof, None) => {
                if body.len() != MAC_BYTES {
                    let reason = format!("PROOF of {} bytes, expected {MAC_BYTES}", body.len());
                    return Err(Failure::new(RefusalCause::Malformed, reason).told());
                }
                let key = self.config.key.bytes();
                if !verify(key, &[INITIATOR_LABEL, transcript, mac_l], body) {
                    return Err(Failure::new(RefusalCause::Unauthenticated, "authentication failed: wrong proof")
                        .telling("authentication failed"));
                }
                let keys = derive(key, nonce_i, nonce_l, transcript);
                Ok(Some(State::Proven { hello: hello.clone(), session: Session::new(&keys, false), sent_at: *sent_at }))
            }
            (State::Proven { hello, session, .. }, Kind::Sealed, None) => {
                let peer = open_offer(session, frame)?;
                hello.check(&peer, "HELLO").map_err(|r| Failure::new(RefusalCause::Impersonation, r).told())?;
                check_compatible(&self.offer, &peer)
                    .map_err(|e| Failure::new(RefusalCause::Incompatible, e.to_string()).told())?;
                self.admit(&AgentName::new(peer.engine.clone(), peer.rank), peer.instance)?;
                let ours = self.stamped_offer(now)?;
                let reply = session.seal.seal(RECORD_OFFER, &ours);
                self.transmits.push_back(Transmit { conn: id, bytes: reply });
                let (agent, incarnation) = (AgentName::new(peer.engine.clone(), peer.rank), peer.instance);
                let State::Proven { session, sent_at, .. } = std::mem::replace(state, State::Taken) else {
                    unreachable!("matched Proven above")
                };
                self.establish(now, id, peer, sent_at, session, None);
                Ok(Some(State::Established { agent, incarnation }))
            }
            (State::Offered { session, listener, sent_at }, Kind::Sealed, Some(address)) => {
                let Some((record, body)) = session.open.open(frame) else {
                    return Err(Failure::new(RefusalCause::Malformed, "its sealed record does not open").told());
                };
                if record == RECORD_REFUSE {
                    let text = peer_text(&body, MAX_REFUSE_TEXT);
                    return Err(Failure::new(RefusalCause::Incompatible, format!("refused: {text}"))
                        .error(TransportError::Backend(format!("{address} refused the handshake: {text}"))));
                }
                let peer = decode_offer(record, &body)?;
                listener.check(&peer, "CHALLENGE").map_err(|r| Failure::new(RefusalCause::Impersonation, r).told())?;
                if let Err(e) = check_compatible(&self.offer, &peer) {
                    return Err(Failure::new(RefusalCause::Incompatible, e.to_string()).told().error(e.into()));
                }
                self.admit(&AgentName::new(peer.engine.clone(), peer.rank), peer.instance)?;
                let (agent, incarnation, sent_at) =
                    (AgentName::new(peer.engine.clone(), peer.rank), peer.instance, *sent_at);
                let State::Offered { session, .. } = std::mem::replace(state, State::Taken) else {
                    unreachable!("matched Offered above")
                };
                self.establish(now, id, peer, sent_at, session, Some(address.clone()));
                Ok(Some(State::Established { agent, incarnation }))
            }
            (_, Kind::Error, Some(address)) => {
                let text = peer_text(body, MAX_ERROR_TEXT);
                Err(Failure::new(RefusalCause::Malformed, format!("refused: {text}"))
                    .error(TransportError::Backend(format!("{address} refused the side channel: {text}"))))
            }
            (state, Kind::Error, None) => {
                let (cause, _) = state.abandoned();
                let text = peer_text(body, MAX_ERROR_TEXT);
                Err(Failure::new(cause, format!("the peer gave up: {text}")))
            }
            (state, kind, _) => {
                let reason = format!("unexpected {} frame while {}", kind.name(), state.stage());
                Err(Failure::new(RefusalCause::Malformed, reason).told())
            }
        }
    }

    /// Listener: a HELLO arrived; answer with CHALLENGE.
    pub(super) fn on_hello(
        &mut self,
        now: Time,
        id: ConnId,
        nonce_l: [u8; 32],
        hello: &[u8],
    ) -> Result<State, Failure> {
        let greeting = greeting(hello, Kind::Hello)?;
        if let Some(c) = self.conns.get_mut(&id) {
            c.claimed = Some(greeting.identity.agent());
        }
        if greeting.target != ANY_RANK && greeting.target != self.offer.rank {
            let reason = format!(
                "this is rank {} of engine {}; the HELLO asks for rank {}",
                self.offer.rank, self.offer.engine, greeting.target
            );
            return Err(Failure::new(RefusalCause::Misrouted, reason).told());
        }
        let body = Identity::of(&self.offer).body(SIDE_PROTOCOL_VERSION, greeting.target, &nonce_l);
        let mut transcript = hello.to_vec();
        transcript.extend_from_slice(&header(Kind::Challenge, 1 + body.len() + MAC_BYTES));
        transcript.extend_from_slice(&body);
        let mac_l = mac(self.config.key.bytes(), &[LISTENER_LABEL, &transcript]);
        let mut challenge = transcript[hello.len()..].to_vec();
        challenge.extend_from_slice(&mac_l);
        self.transmits.push_back(Transmit { conn: id, bytes: challenge });
        Ok(State::Challenged {
            hello: greeting.identity,
            transcript,
            mac_l,
            nonce_i: greeting.nonce,
            nonce_l,
            sent_at: now,
        })
    }

    /// Initiator: the CHALLENGE arrived; verify the listener, then send PROOF and our OFFER.
    pub(super) fn on_challenge(
        &mut self,
        now: Time,
        id: ConnId,
        address: &PeerAddress,
        (nonce_i, target): ([u8; 32], u32),
        hello: &[u8],
        challenge: &[u8],
    ) -> Result<State, Failure> {
        let greeting = greeting(challenge, Kind::Challenge)?;
        let mac_l = greeting.mac.unwrap_or([0; MAC_BYTES]);
        let mut transcript = hello.to_vec();
        transcript.extend_from_slice(&challenge[..challenge.len() - MAC_BYTES]);
        let key = self.config.key.bytes();
        if !verify(key, &[LISTENER_LABEL, &transcript], &mac_l) {
            let error = TransportError::Backend(format!("the peer at {address} does not hold the cluster key"));
            return Err(Failure::new(RefusalCause::Unauthenticated, "authentication failed").told().error(error));
        }
        if greeting.target != target || (target != ANY_RANK && greeting.identity.rank != target) {
            let reason = format!(
                "asked {address} for rank {target}; rank {} of engine {} answered, for rank {}",
                greeting.identity.rank, greeting.identity.engine, greeting.target
            );
            let error = TransportError::Backend(reason.clone());
            return Err(Failure::new(RefusalCause::Misrouted, reason).told().error(error));
        }
        let mac_i = mac(key, &[INITIATOR_LABEL, &transcript, &mac_l]);
        let keys = derive(key, &nonce_i, &greeting.nonce, &transcript);
        let mut session = Session::new(&keys, true);
        let ours = self.stamped_offer(now)?;
        self.transmits.push_back(Transmit { conn: id, bytes: frame(Kind::Proof, &mac_i) });
        self.transmits.push_back(Transmit { conn: id, bytes: session.seal.seal(RECORD_OFFER, &ours) });
        Ok(State::Offered { session, listener: greeting.identity, sent_at: now })
    }
}

/// Parses a HELLO or CHALLENGE frame; a wrong version or a malformed body ends the connection.
fn greeting(frame: &[u8], kind: Kind) -> Result<Greeting, Failure> {
    parse_greeting(&frame[HEADER_BYTES..], SIDE_PROTOCOL_VERSION, kind == Kind::Challenge).map_err(|e| match e {
        ParseError::Version(peer) => {
            let reason = format!("side protocol version mismatch: peer {peer}, local {SIDE_PROTOCOL_VERSION}");
            Failure::new(RefusalCause::Version, reason).told()
        }
        ParseError::Malformed(reason) => {
            Failure::new(RefusalCause::Malformed, format!("malformed {}: {reason}", kind.name())).told()
        }
    })
}

/// Opens the initiator's sealed OFFER.
fn open_offer(session: &mut Session, frame: &[u8]) -> Result<Handshake, Failure> {
    let Some((record, body)) = session.open.open(frame) else {
        return Err(Failure::new(RefusalCause::Malformed, "sealed record does not open").told());
    };
    decode_offer(record, &body)
}

fn decode_offer(record: u8, body: &[u8]) -> Result<Handshake, Failure> {
    if record != RECORD_OFFER {
        let reason = format!("expected an OFFER record, got record type {record}");
        return Err(Failure::new(RefusalCause::Malformed, reason).told());
    }
    Handshake::decode(body).map_err(|e| {
        let cause = match e {
            WireError::Version { .. } => RefusalCause::Version,
            _ => RefusalCause::Malformed,
        };
        Failure::new(cause, format!("offer: {e}")).told()
    })
}
