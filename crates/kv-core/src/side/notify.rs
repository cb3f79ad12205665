//! Notification tags: NIXL names a notification's sender only by a string nothing verifies,
//! so each one carries a tag made with a key of the side-channel session between the two
//! agents, and a sequence number against replays.
//!
//! ```text
//! b"KT" | seq u64 BE | payload | HMAC-SHA256(tag key, "kvflow-notify-v1" | seq u64 BE | payload)[..16]
//! ```

use crate::id::AgentName;
use crate::ports::TransportError;
use crate::wire::MAX_MESSAGE_BYTES;

use super::crypto::{mac, verify_truncated, NOTIFY_LABEL};
use super::RefusalCause;

/// The first bytes of a tagged notification.
const MAGIC: &[u8; 2] = b"KT";
/// Bytes of the truncated tag.
const TAG_BYTES: usize = 16;
/// Bytes a tag adds to a payload: magic, sequence number and tag.
pub const NOTIFICATION_OVERHEAD: usize = MAGIC.len() + 8 + TAG_BYTES;
/// How far behind the highest sequence number seen a notification may still arrive: NIXL may
/// deliver notifications that ride transfers after ones sent alone later.
pub const REPLAY_WINDOW: u64 = 1024;

/// Why a notification was not sealed or opened.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum NotifyError {
    /// No established side-channel peer has this name.
    #[error("no side-channel session with {agent}")]
    UnknownPeer {
        /// The name given or claimed.
        agent: AgentName,
    },
    /// The bytes are not a tagged notification.
    #[error("malformed tagged notification of {len} bytes from {from}")]
    Malformed {
        /// The claimed sender.
        from: AgentName,
        /// Bytes received.
        len: usize,
    },
    /// The tag is not the one the session with the claimed sender makes.
    #[error("notification {seq} claiming to be from {from} has a bad tag")]
    BadTag {
        /// The claimed sender.
        from: AgentName,
        /// Its sequence number.
        seq: u64,
    },
    /// The sequence number was seen already, or is too far behind the highest.
    #[error("notification {seq} from {from} is a replay (highest seen {highest}, window {REPLAY_WINDOW})")]
    Replayed {
        /// The sender.
        from: AgentName,
        /// Its sequence number.
        seq: u64,
        /// The highest sequence number seen from the sender.
        highest: u64,
    },
    /// The payload exceeds [`MAX_MESSAGE_BYTES`].
    #[error("notification payload of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl NotifyError {
    /// How a notification that does not open is counted: the same cause in every adapter.
    pub fn cause(&self) -> RefusalCause {
        match self {
            NotifyError::Malformed { .. } | NotifyError::TooLarge { .. } => RefusalCause::Malformed,
            NotifyError::Replayed { .. } => RefusalCause::Replayed,
            NotifyError::UnknownPeer { .. } | NotifyError::BadTag { .. } => RefusalCause::Unauthenticated,
        }
    }
}

/// A notification that cannot be sealed is a send that fails: to an unknown peer, or too large.
impl From<NotifyError> for TransportError {
    fn from(e: NotifyError) -> Self {
        match e {
            NotifyError::UnknownPeer { agent } => TransportError::UnknownPeer(agent),
            NotifyError::TooLarge { len, max } => TransportError::NotificationTooLarge { len, max },
            other => TransportError::Backend(other.to_string()),
        }
    }
}

/// One peer's notification keys and counters.
pub(crate) struct Tags {
    out_key: [u8; 32],
    in_key: [u8; 32],
    next_out: u64,
    window: ReplayWindow,
}

impl Tags {
    pub(crate) fn new(out_key: [u8; 32], in_key: [u8; 32]) -> Self {
        Tags { out_key, in_key, next_out: 0, window: ReplayWindow::default() }
    }

    pub(crate) fn seal(&mut self, payload: &[u8]) -> Result<Vec<u8>, NotifyError> {
        if payload.len() > MAX_MESSAGE_BYTES {
            return Err(NotifyError::TooLarge { len: payload.len(), max: MAX_MESSAGE_BYTES });
        }
        let seq = self.next_out.to_be_bytes();
        // 2^64 notifications are out of reach; saturating keeps this panic-free regardless.
        self.next_out = self.next_out.saturating_add(1);
        let tag = mac(&self.out_key, &[NOTIFY_LABEL, &seq, payload]);
        let mut sealed = Vec::with_capacity(NOTIFICATION_OVERHEAD + payload.len());
        sealed.extend_from_slice(MAGIC);
        sealed.extend_from_slice(&seq);
        sealed.extend_from_slice(payload);
        sealed.extend_from_slice(&tag[..TAG_BYTES]);
        Ok(sealed)
    }

    pub(crate) fn open(&mut self, from: &AgentName, sealed: &[u8]) -> Result<Vec<u8>, NotifyError> {
        if sealed.len() < NOTIFICATION_OVERHEAD || &sealed[..MAGIC.len()] != MAGIC {
            return Err(NotifyError::Malformed { from: from.clone(), len: sealed.len() });
        }
        let len = sealed.len() - NOTIFICATION_OVERHEAD;
        if len > MAX_MESSAGE_BYTES {
            return Err(NotifyError::TooLarge { len, max: MAX_MESSAGE_BYTES });
        }
        let seq_bytes = &sealed[MAGIC.len()..MAGIC.len() + 8];
        let seq = u64::from_be_bytes(seq_bytes.try_into().expect("8 bytes"));
        let (body, tag) = sealed[MAGIC.len() + 8..].split_at(len);
        if !verify_truncated(&self.in_key, &[NOTIFY_LABEL, seq_bytes, body], tag) {
            return Err(NotifyError::BadTag { from: from.clone(), seq });
        }
        // Only an authentic notification moves the window, so forgeries cannot shift it.
        self.window.accept(seq).map_err(|highest| NotifyError::Replayed { from: from.clone(), seq, highest })?;
        Ok(body.to_vec())
    }
}

/// The sequence numbers seen in the last [`REPLAY_WINDOW`] below the highest, as a bitmap.
#[derive(Default)]
pub(crate) struct ReplayWindow {
    highest: Option<u64>,
    seen: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl ReplayWindow {
    /// Records `seq`; a replay or a number too old is refused with the highest seen.
    pub(crate) fn accept(&mut self, seq: u64) -> Result<(), u64> {
        match self.highest {
            Some(highest) if seq <= highest => {
                if highest - seq >= REPLAY_WINDOW || self.bit(seq) {
                    return Err(highest);
                }
            }
            Some(highest) => {
                if seq - highest >= REPLAY_WINDOW {
                    self.seen = Default::default();
                } else {
                    for s in highest + 1..seq {
                        self.clear(s);
                    }
                }
                self.highest = Some(seq);
            }
            None => self.highest = Some(seq),
        }
        self.set(seq);
        Ok(())
    }

    fn slot(seq: u64) -> (usize, u64) {
        let i = seq % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    fn bit(&self, seq: u64) -> bool {
        let (word, mask) = Self::slot(seq);
        self.seen[word] & mask != 0
    }

    fn set(&mut self, seq: u64) {
        let (word, mask) = Self::slot(seq);
        self.seen[word] |= mask;
    }

    fn clear(&mut self, seq: u64) {
        let (word, mask) = Self::slot(seq);
        self.seen[word] &= !mask;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn the_window_takes_reordered_numbers_once() {
        let mut w = ReplayWindow::default();
        for seq in [5, 3, 4, 0, 1030, 7] {
            assert_eq!(w.accept(seq), Ok(()), "{seq}");
        }
        assert_eq!(w.accept(7), Err(1030));
        assert_eq!(w.accept(6), Err(1030), "1030 - 6 = 1024 is outside the window");
        assert_eq!(w.accept(1029), Ok(()));
        assert_eq!(w.accept(5000), Ok(()));
        assert_eq!(w.accept(1030), Err(5000));
        assert_eq!(w.accept(4000), Ok(()));
    }

    proptest! {
        // Against a model that remembers every number: within the window the bitmap agrees.
        #[test]
        fn the_window_matches_a_model(seqs in prop::collection::vec(0u64..3000, 1..400)) {
            let mut w = ReplayWindow::default();
            let mut seen = BTreeSet::new();
            let mut highest: Option<u64> = None;
            for seq in seqs {
                let fresh = !seen.contains(&seq);
                let in_window = highest.is_none_or(|h| seq > h || h - seq < REPLAY_WINDOW);
                prop_assert_eq!(w.accept(seq).is_ok(), fresh && in_window, "seq {}", seq);
                if fresh && in_window {
                    seen.insert(seq);
                    highest = Some(highest.map_or(seq, |h| h.max(seq)));
                }
            }
        }
    }
}
