//! FNV-1a (64-bit): the one non-cryptographic hash kvflow uses where a stable, seedless value
//! is the point: the handshake's compatibility hash, and the test and demo harnesses' seeds and
//! digests. Never where a peer chooses the input and a collision costs (the lease table keys
//! against chosen ids with a keyed hash).

/// An FNV-1a hasher.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Fnv1a(u64);

impl Fnv1a {
    /// FNV-1a's 64-bit offset basis.
    pub const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    /// FNV-1a's 64-bit prime.
    pub const PRIME: u64 = 0x0100_0000_01b3;

    /// A hasher at the offset basis.
    pub const fn new() -> Self {
        Fnv1a(Self::OFFSET)
    }

    /// A hasher that continues from `state` (a [`Fnv1a::finish`] value).
    pub const fn from_state(state: u64) -> Self {
        Fnv1a(state)
    }

    /// Folds in `bytes`, one at a time.
    pub fn write(&mut self, bytes: impl IntoIterator<Item = u8>) -> &mut Self {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(Self::PRIME);
        }
        self
    }

    /// Folds in a whole 64-bit word in one step (not byte by byte): a digest of digests.
    pub fn write_word(&mut self, word: u64) -> &mut Self {
        self.0 = (self.0 ^ word).wrapping_mul(Self::PRIME);
        self
    }

    /// The hash so far.
    pub const fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_is_fnv_1a() {
        // The reference vectors of FNV-1a 64.
        assert_eq!(Fnv1a::new().finish(), 0xcbf2_9ce4_8422_2325);
        assert_eq!(Fnv1a::new().write(*b"a").finish(), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(Fnv1a::new().write(*b"foobar").finish(), 0x8594_4171_f739_67e8);
    }
}
