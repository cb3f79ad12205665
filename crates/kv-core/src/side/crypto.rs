//! The side channel's cryptography, all of it from well-kept crates: HMAC-SHA256 (`hmac`,
//! `sha2`) for the challenge and response and the notification tags, HKDF-SHA256 (`hkdf`) for
//! the session keys, ChaCha20-Poly1305 (`chacha20poly1305`) for sealed records. Nothing here
//! draws randomness: the nonces come in from the adapter.

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::frame::{header, Kind, HEADER_BYTES};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a MAC, a nonce and each derived key.
pub(crate) const MAC_BYTES: usize = 32;
/// Bytes of a Poly1305 tag.
pub(crate) const AEAD_TAG_BYTES: usize = 16;
/// Prefix of the listener's MAC input.
pub(crate) const LISTENER_LABEL: &[u8] = b"kvflow-side-v1 listener";
/// Prefix of the initiator's MAC input.
pub(crate) const INITIATOR_LABEL: &[u8] = b"kvflow-side-v1 initiator";
/// Prefix of the key derivation's `info`.
pub(crate) const SESSION_LABEL: &[u8] = b"kvflow-side-v1 session";
/// Prefix of a notification tag's MAC input.
pub(crate) const NOTIFY_LABEL: &[u8] = b"kvflow-notify-v1";
/// Prefix of a link secret's MAC input (see `link`).
pub(crate) const EXPORT_LABEL: &[u8] = b"kvflow-export-v1";

fn hmac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac
}

/// HMAC-SHA256 of the concatenated `parts`.
pub(crate) fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; MAC_BYTES] {
    hmac(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the HMAC-SHA256 of `parts`, compared in constant time.
pub(crate) fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    hmac(key, parts).verify_slice(tag).is_ok()
}

/// Whether `tag` is the leftmost bytes of the HMAC-SHA256 of `parts`, in constant time.
pub(crate) fn verify_truncated(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    hmac(key, parts).verify_truncated_left(tag).is_ok()
}

/// SHA-256 of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The keys of one session, as HKDF-SHA256 derives them.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct SessionKeys {
    /// AEAD key, initiator to listener.
    pub(crate) seal_i2l: [u8; 32],
    /// AEAD key, listener to initiator.
    pub(crate) seal_l2i: [u8; 32],
    /// Notification tag key, initiator to listener.
    pub(crate) tag_i2l: [u8; 32],
    /// Notification tag key, listener to initiator.
    pub(crate) tag_l2i: [u8; 32],
    /// The secret both sides derive links of their own from (`link::LinkSecret`).
    pub(crate) export: [u8; 32],
}

/// HKDF-SHA256(salt = `nonce_i ‖ nonce_l`, ikm = the cluster key,
/// info = `"kvflow-side-v1 session" ‖ SHA-256(transcript)`), 160 bytes, split in five. HKDF's
/// output is a stream: the first 128 bytes are those a 128-byte expansion gives.
pub(crate) fn derive(key: &[u8], nonce_i: &[u8; 32], nonce_l: &[u8; 32], transcript: &[u8]) -> SessionKeys {
    let mut salt = [0u8; 64];
    salt[..32].copy_from_slice(nonce_i);
    salt[32..].copy_from_slice(nonce_l);
    let mut info = SESSION_LABEL.to_vec();
    info.extend_from_slice(&sha256(transcript));
    let mut okm = [0u8; 160];
    // 160 bytes is far below HKDF-SHA256's limit of 255 * 32.
    Hkdf::<Sha256>::new(Some(&salt), key).expand(&info, &mut okm).expect("HKDF-SHA256 yields 160 bytes");
    let part = |i: usize| -> [u8; 32] { okm[32 * i..32 * (i + 1)].try_into().expect("32-byte slice") };
    SessionKeys { seal_i2l: part(0), seal_l2i: part(1), tag_i2l: part(2), tag_l2i: part(3), export: part(4) }
}

/// One direction's AEAD: its cipher and the counter that makes each record's nonce.
pub(crate) struct Direction {
    cipher: ChaCha20Poly1305,
    counter: u64,
}

impl Direction {
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        Direction { cipher: ChaCha20Poly1305::new(Key::from_slice(key)), counter: 0 }
    }

    fn nonce(&self) -> Nonce {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&self.counter.to_be_bytes());
        nonce.into()
    }

    /// The SEALED frame of `record` and `body`, under the next nonce.
    pub(crate) fn seal(&mut self, record: u8, body: &[u8]) -> Vec<u8> {
        let len = 1 + 1 + body.len() + AEAD_TAG_BYTES;
        let mut frame = Vec::with_capacity(4 + len);
        frame.extend_from_slice(&header(Kind::Sealed, len));
        frame.push(record);
        frame.extend_from_slice(body);
        let (aad, plaintext) = frame.split_at_mut(HEADER_BYTES);
        // ChaCha20-Poly1305 fails only past 256 GiB; a record is at most a few MiB.
        let tag = self.cipher.encrypt_in_place_detached(&self.nonce(), aad, plaintext).expect("record under 256 GiB");
        frame.extend_from_slice(&tag);
        self.counter += 1;
        frame
    }

    /// The record type and body of a SEALED frame sealed under the next nonce, or `None`
    /// when it does not open (wrong key, wrong counter, altered bytes, too short).
    pub(crate) fn open(&mut self, frame: &[u8]) -> Option<(u8, Vec<u8>)> {
        if frame.len() < HEADER_BYTES + 1 + AEAD_TAG_BYTES {
            return None;
        }
        let (aad, rest) = frame.split_at(HEADER_BYTES);
        let (ciphertext, tag) = rest.split_at(rest.len() - AEAD_TAG_BYTES);
        let mut plaintext = ciphertext.to_vec();
        self.cipher.decrypt_in_place_detached(&self.nonce(), aad, &mut plaintext, Tag::from_slice(tag)).ok()?;
        self.counter += 1;
        let record = plaintext.remove(0);
        Some((record, plaintext))
    }
}
