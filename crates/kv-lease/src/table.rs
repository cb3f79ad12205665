//! P's lease table: one deadline per export, and a poll of what expired that never scans.
//!
//! Leases live in a slab; a min-heap orders `(expiry, slot, generation)` entries. A renewal
//! pushes a fresh entry and leaves the old one behind, stale; a release only bumps the slot's
//! generation. A poll pops entries due at `now`, drops the stale ones and returns the rest, so
//! its cost is O(expired + log n) amortised over the renewals and releases that made the stale
//! entries. An expired lease is therefore reaped even when entries ahead of it were renewed
//! (vLLM issue 58222): the heap orders by current expiry, not by grant order.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;
use std::time::Duration;

use kv_core::Time;

/// A lease operation that cannot be done.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum LeaseError {
    /// The key already holds a lease.
    #[error("a lease for this key exists, expiring at {expiry}")]
    AlreadyLeased {
        /// The existing lease's expiry.
        expiry: Time,
    },
}

/// The map from an export's key to its lease. Keys are request ids, which can come from an
/// engine's clients, so the map keeps std's randomly keyed SipHash: an unkeyed fast hash would
/// let whoever picks request ids make every lookup collide (O(n) per renewal).
type LeaseMap<K, V> = HashMap<K, V>;

#[derive(Clone, Copy, Debug)]
struct Lease {
    slot: u32,
    /// The slot's generation, kept here too so that a renewal never touches the slab.
    generation: u32,
    expiry: Time,
}

#[derive(Clone, Debug)]
struct Slot<K> {
    key: Option<K>,
    generation: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct Due {
    expiry: Time,
    slot: u32,
    generation: u32,
}

/// Leases by key, each with an expiry; a lease has expired when `now >= expiry`.
#[derive(Clone, Debug)]
pub struct LeaseTable<K> {
    /// The current lease of each key. A renewal touches only this map and the heap's end.
    leases: LeaseMap<K, Lease>,
    /// Slot to key, so that a due heap entry finds its lease; the generation tells reuse apart.
    slots: Vec<Slot<K>>,
    free: Vec<u32>,
    due: BinaryHeap<Reverse<Due>>,
}

impl<K> Default for LeaseTable<K> {
    fn default() -> Self {
        LeaseTable { leases: LeaseMap::default(), slots: Vec::new(), free: Vec::new(), due: BinaryHeap::new() }
    }
}

impl<K: Hash + Eq + Clone> LeaseTable<K> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leases held.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether no lease is held.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Grants `key` a lease until `expiry`.
    pub fn grant(&mut self, key: K, expiry: Time) -> Result<(), LeaseError> {
        match self.leases.entry(key) {
            Entry::Occupied(e) => Err(LeaseError::AlreadyLeased { expiry: e.get().expiry }),
            Entry::Vacant(e) => {
                let slot = match self.free.pop() {
                    Some(slot) => {
                        self.slots[slot as usize].key = Some(e.key().clone());
                        slot
                    }
                    None => {
                        let slot = u32::try_from(self.slots.len()).expect("fewer than 2^32 leases");
                        self.slots.push(Slot { key: Some(e.key().clone()), generation: 0 });
                        slot
                    }
                };
                let generation = self.slots[slot as usize].generation;
                e.insert(Lease { slot, generation, expiry });
                self.schedule(Due { expiry, slot, generation });
                Ok(())
            }
        }
    }

    /// Renews `key`'s lease to `max(old, now + extension)` and returns the new expiry.
    ///
    /// Returns `None` when `key` holds no lease, or its lease has already expired at `now`
    /// (an expired lease is not revived: its blocks are about to be reaped).
    pub fn renew(&mut self, key: &K, now: Time, extension: Duration) -> Option<Time> {
        let lease = self.leases.get_mut(key)?;
        if now >= lease.expiry {
            return None;
        }
        let renewed = now.saturating_add(extension);
        if renewed <= lease.expiry {
            return Some(lease.expiry);
        }
        lease.expiry = renewed;
        let due = Due { expiry: renewed, slot: lease.slot, generation: lease.generation };
        self.schedule(due);
        Some(renewed)
    }

    /// Ends `key`'s lease and returns the expiry it had, or `None` when it held none.
    pub fn release(&mut self, key: &K) -> Option<Time> {
        let lease = self.leases.remove(key)?;
        self.vacate(lease.slot);
        Some(lease.expiry)
    }

    /// `key`'s expiry, if it holds a lease (expired or not, until it is polled).
    pub fn expiry(&self, key: &K) -> Option<Time> {
        self.leases.get(key).map(|lease| lease.expiry)
    }

    /// Removes and returns one lease that has expired at `now`, earliest expiry first.
    pub fn poll_expired(&mut self, now: Time) -> Option<(K, Time)> {
        while let Some(&Reverse(due)) = self.due.peek() {
            if due.expiry > now {
                return None;
            }
            self.due.pop();
            if let Some(key) = self.current_key(due) {
                let key = key.clone();
                self.leases.remove(&key);
                self.vacate(due.slot);
                return Some((key, due.expiry));
            }
        }
        None
    }

    /// The earliest expiry of a held lease: when to poll next.
    pub fn next_expiry(&mut self) -> Option<Time> {
        while let Some(&Reverse(due)) = self.due.peek() {
            if self.current_key(due).is_some() {
                return Some(due.expiry);
            }
            self.due.pop();
        }
        None
    }

    /// The key of the lease a heap entry stands for, unless the entry is stale (the slot was
    /// reused, or the lease was renewed past it).
    fn current_key(&self, due: Due) -> Option<&K> {
        let slot = &self.slots[due.slot as usize];
        let key = slot.key.as_ref().filter(|_| slot.generation == due.generation)?;
        (self.leases.get(key)?.expiry == due.expiry).then_some(key)
    }

    fn schedule(&mut self, due: Due) {
        self.due.push(Reverse(due));
        // Stale entries are dropped when they come due; if renewals pile them up faster, rebuild.
        if self.due.len() > 2 * self.leases.len() + 1024 {
            self.compact();
        }
    }

    fn vacate(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        s.key = None;
        s.generation = s.generation.wrapping_add(1);
        self.free.push(slot);
    }

    fn compact(&mut self) {
        let live = self
            .leases
            .values()
            .map(|lease| Reverse(Due { expiry: lease.expiry, slot: lease.slot, generation: lease.generation }));
        self.due = live.collect();
    }
}

/// The naive table production connectors use: a map, and a poll that scans every lease.
///
/// It is the baseline `cargo xtask bench` measures [`LeaseTable`] against (with the same
/// hasher, so that the ratio compares the algorithms), and the obvious model the property
/// tests check it with.
#[derive(Clone, Debug)]
pub struct ScanLeaseTable<K> {
    leases: LeaseMap<K, Time>,
}

impl<K> Default for ScanLeaseTable<K> {
    fn default() -> Self {
        ScanLeaseTable { leases: LeaseMap::default() }
    }
}

impl<K: Hash + Eq + Clone> ScanLeaseTable<K> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leases held.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether no lease is held.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// As [`LeaseTable::grant`].
    pub fn grant(&mut self, key: K, expiry: Time) -> Result<(), LeaseError> {
        match self.leases.entry(key) {
            Entry::Occupied(e) => Err(LeaseError::AlreadyLeased { expiry: *e.get() }),
            Entry::Vacant(e) => {
                e.insert(expiry);
                Ok(())
            }
        }
    }

    /// As [`LeaseTable::renew`].
    pub fn renew(&mut self, key: &K, now: Time, extension: Duration) -> Option<Time> {
        let expiry = self.leases.get_mut(key)?;
        if now >= *expiry {
            return None;
        }
        *expiry = (*expiry).max(now.saturating_add(extension));
        Some(*expiry)
    }

    /// As [`LeaseTable::release`].
    pub fn release(&mut self, key: &K) -> Option<Time> {
        self.leases.remove(key)
    }

    /// As [`LeaseTable::expiry`].
    pub fn expiry(&self, key: &K) -> Option<Time> {
        self.leases.get(key).copied()
    }

    /// Removes and returns every lease expired at `now`, scanning them all.
    pub fn poll_expired(&mut self, now: Time) -> Vec<(K, Time)> {
        let mut expired: Vec<(K, Time)> =
            self.leases.iter().filter(|(_, &e)| now >= e).map(|(k, &e)| (k.clone(), e)).collect();
        for (key, _) in &expired {
            self.leases.remove(key);
        }
        expired.sort_by_key(|&(_, e)| e);
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: Duration = Duration::from_secs(1);

    fn t(secs: u64) -> Time {
        Time::from_millis(secs * 1000)
    }

    fn drain(table: &mut LeaseTable<&'static str>, now: Time) -> Vec<&'static str> {
        std::iter::from_fn(|| table.poll_expired(now)).map(|(k, _)| k).collect()
    }

    #[test]
    fn expiry_counts_at_the_deadline() {
        let mut table = LeaseTable::new();
        table.grant("r1", t(30)).unwrap();
        assert_eq!(drain(&mut table, t(30) - Duration::from_nanos(1)), Vec::<&str>::new());
        assert_eq!(table.next_expiry(), Some(t(30)));
        assert_eq!(drain(&mut table, t(30)), vec!["r1"]);
        assert!(table.is_empty());
        assert_eq!(table.next_expiry(), None);
    }

    #[test]
    fn an_expired_lease_behind_a_renewed_head_is_reaped() {
        // vLLM issue 58222: the first-granted lease is renewed; the one granted after it is not.
        let mut table = LeaseTable::new();
        table.grant("head", t(30)).unwrap();
        table.grant("behind", t(31)).unwrap();
        assert_eq!(table.renew(&"head", t(20), 20 * SEC), Some(t(40)));
        assert_eq!(drain(&mut table, t(32)), vec!["behind"]);
        assert_eq!(table.expiry(&"head"), Some(t(40)));
        assert_eq!(drain(&mut table, t(40)), vec!["head"]);
    }

    #[test]
    fn renewal_never_shortens_and_never_revives() {
        let mut table = LeaseTable::new();
        table.grant("r", t(30)).unwrap();
        assert_eq!(table.renew(&"r", t(1), 5 * SEC), Some(t(30)), "max(old, now + extension)");
        assert_eq!(table.renew(&"r", t(30), 20 * SEC), None, "expired at the deadline");
        assert_eq!(table.renew(&"unknown", t(1), SEC), None);
        assert_eq!(table.grant("r", t(99)), Err(LeaseError::AlreadyLeased { expiry: t(30) }));
        assert_eq!(table.release(&"r"), Some(t(30)));
        assert_eq!(table.release(&"r"), None, "released once");
        assert_eq!(drain(&mut table, t(100)), Vec::<&str>::new());
    }

    #[test]
    fn renewal_storms_keep_the_heap_bounded() {
        let mut table = LeaseTable::new();
        table.grant(1u32, t(10)).unwrap();
        for i in 0..100_000u64 {
            table.renew(&1, Time::from_nanos(i), 10 * SEC);
        }
        assert!(table.due.len() <= 2 * table.len() + 1025, "heap holds {}", table.due.len());
        assert_eq!(table.poll_expired(t(11)), Some((1, Time::from_nanos(99_999) + 10 * SEC)));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Grant(u8, u16),
        Renew(u8, u16),
        Release(u8),
        Advance(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..16, 0u16..200).prop_map(|(k, d)| Op::Grant(k, d)),
            (0u8..16, 0u16..200).prop_map(|(k, d)| Op::Renew(k, d)),
            (0u8..16).prop_map(Op::Release),
            (0u16..100).prop_map(Op::Advance),
        ]
    }

    proptest! {
        /// The table against the plain model: same answers, same leases reaped at the same time.
        #[test]
        fn matches_the_full_scan_model(ops in prop::collection::vec(op(), 0..300)) {
            let mut table = LeaseTable::new();
            let mut model = ScanLeaseTable::new();
            let mut now = Time::ZERO;
            for op in ops {
                match op {
                    Op::Grant(k, d) => {
                        let expiry = now + Duration::from_millis(u64::from(d));
                        prop_assert_eq!(table.grant(k, expiry), model.grant(k, expiry));
                    }
                    Op::Renew(k, d) => {
                        let ext = Duration::from_millis(u64::from(d));
                        prop_assert_eq!(table.renew(&k, now, ext), model.renew(&k, now, ext));
                    }
                    Op::Release(k) => prop_assert_eq!(table.release(&k), model.release(&k)),
                    Op::Advance(d) => {
                        now = now + Duration::from_millis(u64::from(d));
                        let mut got: Vec<_> = std::iter::from_fn(|| table.poll_expired(now)).collect();
                        let mut want = model.poll_expired(now);
                        prop_assert!(got.windows(2).all(|w| w[0].1 <= w[1].1), "earliest first");
                        got.sort();
                        want.sort();
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                let next = model.leases.values().min().copied();
                prop_assert_eq!(table.next_expiry(), next);
                for k in 0u8..16 {
                    prop_assert_eq!(table.expiry(&k), model.expiry(&k));
                }
            }
        }
    }
}
