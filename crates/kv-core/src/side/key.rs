//! The cluster key: the secret every engine of one deployment holds, and nothing else does.

use std::fmt;

/// Bytes in a [`ClusterKey`].
pub const CLUSTER_KEY_BYTES: usize = 32;

/// Bytes in a [`ClusterKey::vouch`] tag.
pub const VOUCH_BYTES: usize = 32;

/// The pre-shared key that proves an engine belongs to the cluster.
///
/// Whoever holds it may receive an engine's NIXL agent metadata, which is a capability to read
/// and write that engine's KV pool, so it never appears in logs: its `Debug` says only whether
/// it is the null key. It has no `PartialEq`: compare keys through the handshake, whose MAC
/// checks run in constant time. Its bytes are wiped when it is dropped (`zeroize`), every copy
/// of it included.
#[derive(Clone)]
pub struct ClusterKey([u8; CLUSTER_KEY_BYTES]);

/// Why text or bytes are not a cluster key; no variant echoes the key material.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum KeyError {
    /// The bytes are not 32.
    #[error("cluster key of {len} bytes, expected {CLUSTER_KEY_BYTES}")]
    Length {
        /// Bytes found.
        len: usize,
    },
    /// The text, trimmed, is not 64 characters.
    #[error("cluster key of {len} hex characters, expected {}", 2 * CLUSTER_KEY_BYTES)]
    HexLength {
        /// Characters found, surrounding whitespace trimmed.
        len: usize,
    },
    /// A character is not a hex digit.
    #[error("cluster key has a character that is not a hex digit at position {position}")]
    NotHex {
        /// Its index among the trimmed text's characters, from 0.
        position: usize,
    },
}

impl ClusterKey {
    /// Reads a key written as 64 hex digits (either case); surrounding whitespace, such as the
    /// newline that ends a key file, is ignored.
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        let len = text.chars().count();
        if len != 2 * CLUSTER_KEY_BYTES {
            return Err(KeyError::HexLength { len });
        }
        // Positions by character: a multi-byte character is one position, and not a hex digit.
        if let Some(position) = text.chars().position(|c| !c.is_ascii_hexdigit()) {
            return Err(KeyError::NotHex { position });
        }
        let mut key = ClusterKey([0; CLUSTER_KEY_BYTES]);
        // 64 ASCII hex digits: the crate's decode cannot fail (and says where if it did).
        hex::decode_to_slice(text, &mut key.0).map_err(|e| match e {
            hex::FromHexError::InvalidHexCharacter { index, .. } => KeyError::NotHex { position: index },
            _ => KeyError::HexLength { len },
        })?;
        Ok(key)
    }

    /// Takes exactly 32 bytes as the key.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.len() != CLUSTER_KEY_BYTES {
            return Err(KeyError::Length { len: bytes.len() });
        }
        let mut key = ClusterKey([0; CLUSTER_KEY_BYTES]);
        key.0.copy_from_slice(bytes);
        Ok(key)
    }

    /// The null key (32 zero bytes) of an engine run without a key.
    ///
    /// The protocol runs unchanged, but authenticates nothing, since anyone can compute its
    /// MACs: adapters given it must listen on loopback only, and say so.
    pub fn none() -> Self {
        ClusterKey([0; CLUSTER_KEY_BYTES])
    }

    /// Whether this is the null key.
    pub fn is_none(&self) -> bool {
        self.0.iter().all(|&b| b == 0)
    }

    /// The key's bytes, for the MACs and the key derivation.
    pub(crate) fn bytes(&self) -> &[u8; CLUSTER_KEY_BYTES] {
        &self.0
    }

    /// The HMAC-SHA256, under this key, of `label` followed by `message`: a value one engine
    /// vouches for and another engine of the cluster checks when it comes back through hands
    /// that hold no key (P's handoff, through the router: kv-sched-adapter's `TransferParams`).
    /// `label` names the kind of value, so that a tag made for one kind never passes for
    /// another's. The null key's tags vouch for nothing: anyone can make them.
    pub fn vouch(&self, label: &[u8], message: &[u8]) -> [u8; VOUCH_BYTES] {
        super::crypto::mac(&self.0, &[label, message])
    }

    /// Whether `tag` is [`ClusterKey::vouch`]'s for `label` and `message`, compared in constant
    /// time.
    pub fn vouched(&self, label: &[u8], message: &[u8], tag: &[u8]) -> bool {
        super::crypto::verify(&self.0, &[label, message], tag)
    }
}

impl ClusterKey {
    /// Overwrites the key's bytes with zeros, as dropping it does.
    fn wipe(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl Drop for ClusterKey {
    fn drop(&mut self) {
        self.wipe();
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            f.write_str("ClusterKey(none)")
        } else {
            f.write_str("ClusterKey(<redacted>)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn hex_keys_read_with_whitespace_and_either_case() {
        let key = ClusterKey::from_hex(&format!("  {}\n", HEX.to_uppercase())).unwrap();
        assert_eq!(key.bytes().to_vec(), (0u8..32).collect::<Vec<_>>());
        assert!(!key.is_none());
        assert!(ClusterKey::none().is_none());
        assert!(ClusterKey::from_bytes(&[0; 32]).unwrap().is_none());
    }

    #[test]
    fn bad_keys_name_the_length_and_never_the_key() {
        let secret = "deadbeefcafe";
        let err = ClusterKey::from_hex(secret).unwrap_err();
        assert_eq!(err, KeyError::HexLength { len: 12 });
        assert!(!err.to_string().contains(secret) && !format!("{err:?}").contains(secret));
        assert_eq!(err.to_string(), "cluster key of 12 hex characters, expected 64");
        let with_g = format!("{}g", &HEX[..63]);
        assert_eq!(ClusterKey::from_hex(&with_g).unwrap_err(), KeyError::NotHex { position: 63 });
        // A multi-byte character counts as one character, and is not a hex digit.
        let with_e = format!("é{}", &HEX[1..]);
        assert_eq!(ClusterKey::from_hex(&with_e).unwrap_err(), KeyError::NotHex { position: 0 });
        assert_eq!(ClusterKey::from_bytes(&[1; 31]).unwrap_err().to_string(), "cluster key of 31 bytes, expected 32");
    }

    #[test]
    fn a_vouch_passes_for_its_key_label_and_message_alone() {
        let (key, other) = (ClusterKey::from_hex(HEX).unwrap(), ClusterKey::from_bytes(&[9; 32]).unwrap());
        let tag = key.vouch(b"kvflow-handoff-v1", b"message");
        assert!(key.vouched(b"kvflow-handoff-v1", b"message", &tag));
        assert!(!other.vouched(b"kvflow-handoff-v1", b"message", &tag), "another key");
        assert!(!key.vouched(b"kvflow-other-v1", b"message", &tag), "another label");
        assert!(!key.vouched(b"kvflow-handoff-v1", b"messagf", &tag), "another message");
        assert!(!key.vouched(b"kvflow-handoff-v1", b"message", &tag[..31]), "a cut tag");
        let mut flipped = tag;
        flipped[0] ^= 1;
        assert!(!key.vouched(b"kvflow-handoff-v1", b"message", &flipped), "a changed tag");
    }

    #[test]
    fn dropping_a_key_wipes_its_bytes() {
        let mut key = ClusterKey::from_hex(HEX).unwrap();
        assert!(!key.is_none());
        // What `drop` runs: the bytes are zeros after it.
        key.wipe();
        assert!(key.is_none(), "the key's bytes survived the wipe");
    }

    #[test]
    fn debug_redacts_the_key() {
        let key = ClusterKey::from_hex(HEX).unwrap();
        assert_eq!(format!("{key:?}"), "ClusterKey(<redacted>)");
        assert_eq!(format!("{:?}", ClusterKey::none()), "ClusterKey(none)");
    }
}
