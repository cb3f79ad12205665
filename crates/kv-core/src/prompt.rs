//! What a claim says of the prompt it loads for: its length and a digest of its tokens, and a
//! digest of the P blocks D will read. P compares them with what it computed before it lets
//! D read (or writes into D's blocks), so a handoff that a router rebuilt, a client edited or
//! replayed never brings another prompt's KV into a request.
//!
//! The digests are the first 16 bytes of SHA-256 over a domain string and the values as
//! little-endian `u32`s: `SHA-256("kvflow prompt v1" || token_0 || token_1 ...)` and
//! `SHA-256("kvflow blocks v1" || block_0 || ...)`.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::id::BlockId;

/// A 16-byte digest of a prompt's tokens or of a list of blocks: 16 bytes on the wire, 32 hex
/// digits in JSON (the handoff).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 16]);

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            serializer.serialize_str(&self.to_hex())
        } else {
            self.0.serialize(serializer)
        }
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        if deserializer.is_human_readable() {
            let text = String::deserialize(deserializer)?;
            Digest::from_hex(&text)
                .ok_or_else(|| serde::de::Error::custom(format!("a digest is 32 hex digits, not {text:?}")))
        } else {
            <[u8; 16]>::deserialize(deserializer).map(Digest)
        }
    }
}

impl Digest {
    fn of(domain: &[u8], values: impl IntoIterator<Item = u32>) -> Self {
        let mut hash = Sha256::new();
        hash.update(domain);
        for value in values {
            hash.update(value.to_le_bytes());
        }
        let full = hash.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        Digest(out)
    }

    /// The digest of a prompt's token ids.
    pub fn of_tokens(tokens: &[u32]) -> Self {
        Digest::of(b"kvflow prompt v1", tokens.iter().copied())
    }

    /// The digest of P's blocks, in prompt order.
    pub fn of_blocks(blocks: &[BlockId]) -> Self {
        Digest::of(b"kvflow blocks v1", blocks.iter().map(|b| b.0))
    }

    /// The digest as 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The digest written as 32 hex digits; `None` for anything else.
    pub fn from_hex(text: &str) -> Option<Self> {
        if text.len() != 32 || !text.is_ascii() {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Digest(out))
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A prompt as a claim names it: how many tokens, and the digest of their ids where the engine
/// has them (a prompt given as embeddings has none).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Prompt {
    /// Its tokens.
    pub tokens: u64,
    /// [`Digest::of_tokens`] of its token ids, if known.
    pub digest: Option<Digest>,
}

impl Prompt {
    /// A prompt of `tokens` tokens whose ids are not known.
    pub fn len_only(tokens: u64) -> Self {
        Prompt { tokens, digest: None }
    }

    /// The prompt of these token ids.
    pub fn of_tokens(tokens: &[u32]) -> Self {
        Prompt { tokens: tokens.len() as u64, digest: Some(Digest::of_tokens(tokens)) }
    }

    /// How `self` (the prompt a claim names) differs from `computed` (the prompt P computed),
    /// if it does: another length, or other tokens. A digest one side lacks is no difference
    /// (an engine that does not know its prompt's ids, as the simulator's); one that differs
    /// is.
    pub fn mismatch(&self, computed: &Prompt) -> Option<PromptMismatch> {
        if self.tokens != computed.tokens {
            return Some(PromptMismatch::Length { claimed: self.tokens, computed: computed.tokens });
        }
        match (self.digest, computed.digest) {
            (Some(claimed), Some(computed)) if claimed != computed => {
                Some(PromptMismatch::Tokens { claimed, computed })
            }
            _ => None,
        }
    }
}

/// How a claimed prompt differs from the one P computed.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
pub enum PromptMismatch {
    /// Another number of tokens.
    #[error("the claim names a prompt of {claimed} tokens, P computed {computed}")]
    Length {
        /// The claim's.
        claimed: u64,
        /// P's.
        computed: u64,
    },
    /// The same number of tokens, other ids.
    #[error("the claim names other prompt tokens than P computed (digest {claimed}, P's {computed})")]
    Tokens {
        /// The claim's digest.
        claimed: Digest,
        /// P's.
        computed: Digest,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_tell_prompts_and_block_lists_apart() {
        let a = Digest::of_tokens(&[1, 2, 3]);
        assert_eq!(a, Digest::of_tokens(&[1, 2, 3]));
        assert_ne!(a, Digest::of_tokens(&[1, 2, 4]));
        assert_ne!(a, Digest::of_tokens(&[3, 2, 1]));
        // Domain-separated: the same numbers as blocks digest otherwise.
        assert_ne!(a, Digest::of_blocks(&[BlockId(1), BlockId(2), BlockId(3)]));
        assert_eq!(Digest::from_hex(&a.to_hex()), Some(a));
        assert_eq!(Digest::from_hex("zz"), None);
        assert_eq!(Digest::from_hex(&"é".repeat(16)), None);
    }

    #[test]
    fn a_claim_for_another_prompt_is_told_apart() {
        let computed = Prompt::of_tokens(&[5, 6, 7]);
        assert_eq!(Prompt::of_tokens(&[5, 6, 7]).mismatch(&computed), None);
        assert_eq!(Prompt::len_only(3).mismatch(&computed), None);
        assert_eq!(Prompt::len_only(4).mismatch(&computed), Some(PromptMismatch::Length { claimed: 4, computed: 3 }));
        let other = Prompt::of_tokens(&[5, 6, 8]);
        let err = other.mismatch(&computed).expect("other tokens");
        assert!(err.to_string().contains("other prompt tokens"), "{err}");
    }
}
