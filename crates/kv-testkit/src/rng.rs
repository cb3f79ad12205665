//! A seeded pseudo-random generator whose stream is fixed by this file alone.
//!
//! Every random choice of the fake network and the simulator comes from here, so that a seed
//! replays a run exactly; it is hand-written (SplitMix64) so that no dependency upgrade can
//! change the stream behind a recorded seed.

use std::ops::RangeInclusive;

/// SplitMix64: fast, tiny, and good enough to choose faults; not for cryptography.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n`, or 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-and-reject: unbiased, and one multiplication in the common case.
        let threshold = n.wrapping_neg() % n;
        loop {
            let wide = u128::from(self.next_u64()) * u128::from(n);
            if wide as u64 >= threshold {
                return (wide >> 64) as u64;
            }
        }
    }

    /// A uniform value in `range`, or its start when the range is empty.
    pub fn range(&mut self, range: RangeInclusive<u64>) -> u64 {
        let (start, end) = range.into_inner();
        match end.checked_sub(start) {
            None => start,
            Some(u64::MAX) => self.next_u64(),
            Some(span) => start + self.below(span + 1),
        }
    }

    /// True with probability `p`; `p <= 0` (or NaN) is never and `p >= 1` always, drawing nothing.
    pub fn chance(&mut self, p: f64) -> bool {
        if p.is_nan() || p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        unit < p
    }

    /// An independent generator for a sub-system, so that its draws do not shift this stream's.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_splitmix64() {
        // Reference values of SplitMix64 from seed 0; a change here breaks every recorded seed.
        let mut rng = Rng::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn draws_stay_in_bounds() {
        let mut rng = Rng::new(42);
        for _ in 0..1000 {
            assert!(rng.below(7) < 7);
            assert!((10..=12).contains(&rng.range(10..=12)));
        }
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.range(5..=5), 5);
        assert_ne!(rng.range(0..=u64::MAX), rng.range(0..=u64::MAX), "the full range draws 64 bits");
    }

    #[test]
    fn chance_honours_its_extremes_and_its_rate() {
        let mut rng = Rng::new(1);
        assert!((0..100).all(|_| rng.chance(1.0)) && (0..100).all(|_| !rng.chance(0.0) && !rng.chance(f64::NAN)));
        let hits = (0..10_000).filter(|_| rng.chance(0.25)).count();
        assert!((2_300..2_700).contains(&hits), "{hits} hits of 10000 at p = 0.25");
    }

    #[test]
    fn forks_are_deterministic_and_independent() {
        let (mut a, mut b) = (Rng::new(9), Rng::new(9));
        let (mut fa, mut fb) = (a.fork(), b.fork());
        assert_eq!(fa.next_u64(), fb.next_u64());
        assert_ne!(fa.next_u64(), a.next_u64());
    }
}
