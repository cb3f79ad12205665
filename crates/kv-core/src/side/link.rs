//! Links: connections an adapter opens beside the side channel (the TCP transport's data
//! connections) that prove they belong to one established side-channel session, and whose
//! every frame carries a tag only that session's two agents can make.
//!
//! Both ends of a session hold its export secret (`k_export`, derived with the session's other
//! keys; see `docs/side-channel.md`). For an adapter protocol named by a label, each derives
//! the same [`LinkSecret`]; a link then runs a challenge and response over its own transcript
//! (the connector's greeting with a fresh nonce, the listener's challenge with another), as
//! the side channel does over the cluster key, and derives one tag key per direction from both
//! nonces. A recorded link is worth nothing later: the other side's fresh nonce changes the
//! transcript and the keys. Nothing here reads a clock or draws randomness.
//!
//! ```text
//! link       = HMAC-SHA256(k_export, "kvflow-export-v1" ‖ label)
//! mac_l      = HMAC-SHA256(link, "kvflow-link-v1 listener"  ‖ transcript)
//! mac_c      = HMAC-SHA256(link, "kvflow-link-v1 connector" ‖ transcript ‖ mac_l)
//! okm        = HKDF-SHA256(salt = nonce_c ‖ nonce_l, ikm = link,
//!                          info = "kvflow-link-v1 keys" ‖ SHA-256(transcript), length = 64)
//! k_c2l, k_l2c = okm[0..32], okm[32..64]
//! tag        = Poly1305 tag of ChaCha20-Poly1305(k_dir, nonce = 0u32 ‖ counter u64 BE,
//!                                                aad = the tagged bytes, plaintext = empty)
//! ```
//!
//! Each direction counts its tags from 0, one per tag, so a tag also fixes the order of what
//! it covers: a frame replayed, dropped or moved within the link fails its tag.

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};
use hkdf::Hkdf;
use sha2::Sha256;

use super::crypto::{mac, sha256, verify, EXPORT_LABEL, MAC_BYTES};
use super::SideEndpoint;
use crate::id::AgentName;

/// Prefix of the listener's MAC input.
const LISTENER_LABEL: &[u8] = b"kvflow-link-v1 listener";
/// Prefix of the connector's MAC input.
const CONNECTOR_LABEL: &[u8] = b"kvflow-link-v1 connector";
/// Prefix of the key derivation's `info`.
const KEYS_LABEL: &[u8] = b"kvflow-link-v1 keys";
/// Bytes of a link MAC.
pub const LINK_MAC_BYTES: usize = MAC_BYTES;
/// Bytes of a frame tag.
pub const LINK_TAG_BYTES: usize = 16;

/// Which end of a link.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LinkRole {
    /// It opened the link (sent the greeting).
    Connector,
    /// It accepted the link (sent the challenge).
    Listener,
}

/// The secret of links to one established peer for one adapter protocol. Its bytes never
/// leave it; `Debug` does not show them.
#[derive(Clone)]
pub struct LinkSecret {
    key: [u8; 32],
    incarnation: u64,
}

impl std::fmt::Debug for LinkSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSecret").field("incarnation", &self.incarnation).finish_non_exhaustive()
    }
}

impl SideEndpoint {
    /// The secret of links with the established peer `peer` for the adapter protocol `label`
    /// (for example `"kvflow-tcp-data-v2"`), with the peer's incarnation; `None` while no
    /// peer of that name is established. Both ends of the session get the same secret, and no
    /// other session (another peer, a later incarnation, another key) does.
    pub fn link_secret(&self, peer: &AgentName, label: &str) -> Option<LinkSecret> {
        let p = self.peers.get(peer)?;
        Some(LinkSecret { key: mac(&p.export, &[EXPORT_LABEL, label.as_bytes()]), incarnation: p.incarnation })
    }
}

impl LinkSecret {
    /// A secret from its bytes, as `docs/side-channel.md` derives them elsewhere (tools and
    /// tests; an engine gets its secrets from [`SideEndpoint::link_secret`]).
    pub fn from_bytes(key: [u8; 32], incarnation: u64) -> Self {
        LinkSecret { key, incarnation }
    }

    /// The incarnation of the peer whose session this secret belongs to.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The listener's MAC over the link's transcript: the connector's greeting, then the
    /// listener's challenge without this MAC.
    pub fn listener_mac(&self, transcript: &[u8]) -> [u8; LINK_MAC_BYTES] {
        mac(&self.key, &[LISTENER_LABEL, transcript])
    }

    /// Whether `tag` is the listener's MAC over `transcript`, compared in constant time.
    pub fn verify_listener_mac(&self, transcript: &[u8], tag: &[u8]) -> bool {
        verify(&self.key, &[LISTENER_LABEL, transcript], tag)
    }

    /// The connector's MAC, over the transcript and the listener's MAC.
    pub fn connector_mac(&self, transcript: &[u8], listener_mac: &[u8]) -> [u8; LINK_MAC_BYTES] {
        mac(&self.key, &[CONNECTOR_LABEL, transcript, listener_mac])
    }

    /// Whether `tag` is the connector's MAC, compared in constant time.
    pub fn verify_connector_mac(&self, transcript: &[u8], listener_mac: &[u8], tag: &[u8]) -> bool {
        verify(&self.key, &[CONNECTOR_LABEL, transcript, listener_mac], tag)
    }

    /// The link's tag keys for the end `role`: what it sends, and what it receives.
    pub fn frame_tags(
        &self,
        role: LinkRole,
        nonce_c: &[u8; 32],
        nonce_l: &[u8; 32],
        transcript: &[u8],
    ) -> (FrameTags, FrameTags) {
        let mut salt = [0u8; 64];
        salt[..32].copy_from_slice(nonce_c);
        salt[32..].copy_from_slice(nonce_l);
        let mut info = KEYS_LABEL.to_vec();
        info.extend_from_slice(&sha256(transcript));
        let mut okm = [0u8; 64];
        // 64 bytes is far below HKDF-SHA256's limit of 255 * 32.
        Hkdf::<Sha256>::new(Some(&salt), &self.key).expand(&info, &mut okm).expect("HKDF-SHA256 yields 64 bytes");
        let (c2l, l2c) = okm.split_at(32);
        let (c2l, l2c) = (FrameTags::new(c2l), FrameTags::new(l2c));
        match role {
            LinkRole::Connector => (c2l, l2c),
            LinkRole::Listener => (l2c, c2l),
        }
    }
}

/// One direction's frame tags: a key and the counter that orders them.
pub struct FrameTags {
    cipher: ChaCha20Poly1305,
    counter: u64,
}

impl std::fmt::Debug for FrameTags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameTags").field("counter", &self.counter).finish_non_exhaustive()
    }
}

impl FrameTags {
    fn new(key: &[u8]) -> Self {
        FrameTags { cipher: ChaCha20Poly1305::new(Key::from_slice(key)), counter: 0 }
    }

    fn nonce(&self) -> Nonce {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&self.counter.to_be_bytes());
        nonce.into()
    }

    /// The tag of `bytes`, the next in this direction.
    pub fn tag(&mut self, bytes: &[u8]) -> [u8; LINK_TAG_BYTES] {
        // ChaCha20-Poly1305 fails only past 256 GiB of plaintext; there is none.
        let tag = self.cipher.encrypt_in_place_detached(&self.nonce(), bytes, &mut []).expect("no plaintext");
        self.counter = self.counter.wrapping_add(1);
        tag.into()
    }

    /// Whether `tag` is the next tag of `bytes` in this direction, compared in constant time.
    /// A tag that fails leaves the counter where it was; the link should end.
    pub fn verify(&mut self, bytes: &[u8], tag: &[u8]) -> bool {
        if tag.len() != LINK_TAG_BYTES {
            return false;
        }
        let ok = self.cipher.decrypt_in_place_detached(&self.nonce(), bytes, &mut [], Tag::from_slice(tag)).is_ok();
        if ok {
            self.counter = self.counter.wrapping_add(1);
        }
        ok
    }

    /// Steps over one tag unchecked, for bytes the receiver drops without acting on them (the
    /// rest of a chunk it refused), so that both ends count alike.
    pub fn skip(&mut self) {
        self.counter = self.counter.wrapping_add(1);
    }

    /// Tags made, verified or stepped over so far in this direction.
    pub fn count(&self) -> u64 {
        self.counter
    }
}
