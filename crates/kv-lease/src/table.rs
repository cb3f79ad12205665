//! P's lease table: one deadline per export, and a poll of what expired that never scans.
//!
//! Leases live in a hash map keyed per process (`LeaseMap`): each key's expiry, and a slot
//! number (the lowest free, most recently freed first), which orders leases due at the same
//! time. Deadlines are kept in buckets of about a millisecond of expiry (`BUCKET_SHIFT`): the
//! earliest bucket sorted (`front`, entries with their expiry and slot), the later ones as
//! bare keys, unsorted, behind a min-heap of bucket numbers (one per bucket, not per lease).
//! A grant inserts into the map and pushes its key to its bucket (the one grants went to last
//! is held out, so that push reads nothing else); a renewal only writes the map's expiry,
//! leaving the entry where it was, earlier than its deadline now is; a release only removes
//! the key from the map. So none of the three costs more with more leases, and each touches
//! the map once. A bucket becomes the front when the one before it is done: each key is
//! looked up once, dropped if it holds no lease, moved if its lease was renewed past the
//! bucket, and otherwise enters the front with its lease's expiry and slot, sorted. The poll
//! looks at the front's earliest entry: one whose key no longer holds that lease (released,
//! granted again, renewed) is dropped or moved to the bucket of its expiry, and one that
//! still matches is due or not. So a poll with nothing due reads one entry, and one that
//! reaps touches only what is due (and what was released or renewed past it, once each).
//! Expiry is exact: a lease granted until `t` has expired at `t`, not at its bucket's end;
//! leases due at the same time are reaped in slot order. An expired lease is reaped even
//! when entries ahead of it were renewed (vLLM issue 58222): entries move to their current
//! expiry before they count.

use std::cmp::{Ordering, Reverse};
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

/// The map from an export's key to its lease. Keys are request ids, which an engine's clients
/// can choose, so an unkeyed fast hash (Fx) would let them pick ids that all land in one
/// bucket and make every renewal O(n). The map hashes with foldhash seeded at random per
/// process and per map: every hash starts from secret seeds the ids never see, so a set of
/// colliding ids cannot be computed ahead, and no answer of the engine gives the seeds away
/// (foldhash's authors call it minimally DoS-resistant: it does not stand against someone who
/// can study the hash values themselves, which never leave the process). It hashes a short
/// key several times faster than std's SipHash, which this map used before.
type LeaseMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Deadlines are kept in buckets of `2^BUCKET_SHIFT` ns of expiry (about 1 ms).
const BUCKET_SHIFT: u32 = 20;

fn bucket(expiry: Time) -> u64 {
    expiry.as_nanos() >> BUCKET_SHIFT
}

/// A lease: its expiry, and its slot (the order among leases due at the same time: a number
/// no other lease holds while it does, the most recently freed taken first).
#[derive(Clone, Copy, Debug)]
struct Lease {
    expiry: Time,
    slot: u32,
}

/// A deadline entry in the front: a key, and the slot and expiry its lease had when the entry
/// was made. Ordered by expiry, then slot.
#[derive(Clone, Debug)]
struct Due<K> {
    expiry: Time,
    slot: u32,
    key: K,
}

impl<K> Due<K> {
    fn order(&self, other: &Self) -> Ordering {
        (self.expiry, self.slot).cmp(&(other.expiry, other.slot))
    }
}

/// Leases by key, each with an expiry; a lease has expired when `now >= expiry`.
#[derive(Clone, Debug)]
pub struct LeaseTable<K> {
    /// Each key's lease. Grants, renewals and releases touch it once each.
    leases: LeaseMap<K, Lease>,
    /// Every entry of a bucket up to `front_bucket`, latest first (the next due at the end).
    front: Vec<Due<K>>,
    front_bucket: u64,
    /// The entries of later buckets: keys alone (a key's lease gives the entry its expiry
    /// and slot when its bucket comes first).
    later: Later<K>,
    /// Entries in `front` and `later`, current or not (a released lease's stays until due).
    entries: usize,
    /// Slots freed, the most recent last, and the number of slots ever taken.
    free: Vec<u32>,
    slots: u32,
}

impl<K> Default for LeaseTable<K> {
    fn default() -> Self {
        LeaseTable {
            leases: LeaseMap::default(),
            front: Vec::new(),
            front_bucket: 0,
            later: Later::default(),
            entries: 0,
            free: Vec::new(),
            slots: 0,
        }
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
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.slots = self.slots.checked_add(1).expect("fewer than 2^32 leases");
                    self.slots - 1
                });
                let due = Due { expiry, slot, key: e.key().clone() };
                e.insert(Lease { expiry, slot });
                self.schedule(due);
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
        // The lease's entry stays where it is, earlier than this: it moves when it comes due.
        lease.expiry = lease.expiry.max(now.saturating_add(extension));
        Some(lease.expiry)
    }

    /// Ends `key`'s lease and returns the expiry it had, or `None` when it held none.
    pub fn release(&mut self, key: &K) -> Option<Time> {
        let lease = self.leases.remove(key)?;
        self.free.push(lease.slot);
        Some(lease.expiry)
    }

    /// `key`'s expiry, if it holds a lease (expired or not, until it is polled).
    pub fn expiry(&self, key: &K) -> Option<Time> {
        self.leases.get(key).map(|lease| lease.expiry)
    }

    /// Removes and returns one lease that has expired at `now`, earliest expiry first.
    pub fn poll_expired(&mut self, now: Time) -> Option<(K, Time)> {
        if self.next_due()? > now {
            return None;
        }
        let due = self.front.pop()?;
        self.entries -= 1;
        if let Some(lease) = self.leases.remove(&due.key) {
            self.free.push(lease.slot);
        }
        Some((due.key, due.expiry))
    }

    /// The earliest expiry of a held lease: when to poll next.
    pub fn next_expiry(&mut self) -> Option<Time> {
        self.next_due()
    }

    /// The expiry of the entry at the front's end once it stands for a lease due then:
    /// entries before it whose key holds no lease, or holds one in another slot or until
    /// another expiry (granted again, or renewed), are dropped or moved to that expiry's
    /// bucket.
    fn next_due(&mut self) -> Option<Time> {
        loop {
            let Some(due) = self.front.last() else {
                if self.load_front() {
                    continue;
                }
                return None;
            };
            let lease = self.leases.get(&due.key).copied();
            if lease.is_some_and(|lease| lease.expiry == due.expiry && lease.slot == due.slot) {
                return Some(due.expiry);
            }
            let due = self.front.pop()?;
            self.entries -= 1;
            // An entry for a lease due later (renewed, or granted again) moves there.
            if let Some(lease) = lease.filter(|lease| lease.expiry > due.expiry) {
                self.schedule(Due { expiry: lease.expiry, slot: lease.slot, key: due.key });
            }
        }
    }

    /// Makes the earliest later bucket the front, sorted; `false` if there is none. Each
    /// key is looked up once: one holding no lease is dropped, one whose lease is due in a
    /// later bucket (renewed since) moves there, the rest enter the front at their lease's
    /// expiry and slot. A key released and granted again has an entry for each grant: both
    /// stand for its lease now, the later one is dropped once the lease is reaped.
    fn load_front(&mut self) -> bool {
        let mut keys = std::mem::take(&mut self.later.loading);
        let Some(number) = self.later.pop_earliest(&mut keys) else {
            self.later.loading = keys;
            return false;
        };
        self.front_bucket = number;
        for key in keys.drain(..) {
            match self.leases.get(&key).copied() {
                None => self.entries -= 1,
                Some(lease) if bucket(lease.expiry) > number => self.later.push(bucket(lease.expiry), key),
                Some(lease) => self.front.push(Due { expiry: lease.expiry, slot: lease.slot, key }),
            }
        }
        self.later.loading = keys;
        self.front.sort_unstable_by(|a, b| b.order(a));
        true
    }

    fn schedule(&mut self, due: Due<K>) {
        self.entries += 1;
        self.place(due);
        // Released leases' entries wait until they come due; if releases pile them up faster
        // than time reaches them, rebuild from the leases held (at most once per seven live
        // leases' worth of releases, so its cost spreads thin; a later bucket's entry is the
        // key alone, eight bytes for a number).
        if self.entries > 8 * self.leases.len() + 1024 {
            self.compact();
        }
    }

    /// Puts `due` in the front, in order, if its bucket is there, or else in its bucket.
    fn place(&mut self, due: Due<K>) {
        let number = bucket(due.expiry);
        if number <= self.front_bucket {
            let at = self.front.partition_point(|entry| entry.order(&due) == Ordering::Greater);
            self.front.insert(at, due);
        } else {
            self.later.push(number, due.key);
        }
    }

    #[cold]
    fn compact(&mut self) {
        self.front.clear();
        self.later.clear();
        // Every entry to the later buckets (sorted once, when its bucket comes first).
        self.front_bucket = 0;
        self.entries = self.leases.len();
        for (key, lease) in &self.leases {
            match bucket(lease.expiry) {
                0 => self.front.push(Due { expiry: lease.expiry, slot: lease.slot, key: key.clone() }),
                number => self.later.push_aside(number, key.clone()),
            }
        }
        self.front.sort_unstable_by(|a, b| b.order(a));
    }
}

/// The later buckets: each bucket's keys (vectors kept for reuse once emptied), found by
/// bucket number, and the numbers earliest first. The bucket an entry last went to is held
/// out as the tail (grants, due `now + lease`, come in runs to one bucket): a grant pushes
/// to it and reads nothing else.
#[derive(Clone, Debug)]
struct Later<K> {
    index: HashMap<u64, u32, foldhash::fast::FixedState>,
    buckets: Vec<Vec<K>>,
    spare: Vec<u32>,
    order: BinaryHeap<Reverse<u64>>,
    /// The tail's bucket number and place (its vector is `tail`, the place holds an empty one).
    tail_at: Option<(u64, u32)>,
    tail: Vec<K>,
    /// The bucket being loaded into the front (kept for its allocation).
    loading: Vec<K>,
}

impl<K> Default for Later<K> {
    fn default() -> Self {
        Later {
            index: HashMap::default(),
            buckets: Vec::new(),
            spare: Vec::new(),
            order: BinaryHeap::new(),
            tail_at: None,
            tail: Vec::new(),
            loading: Vec::new(),
        }
    }
}

impl<K> Later<K> {
    /// Adds `key` to bucket `number`.
    #[inline]
    fn push(&mut self, number: u64, key: K) {
        if self.tail_at.is_none_or(|(tail, _)| tail != number) {
            self.make_tail(number);
        }
        self.tail.push(key);
    }

    /// Puts the tail back in its place and makes bucket `number` (new if need be) the tail.
    #[inline(never)]
    fn make_tail(&mut self, number: u64) {
        self.put_tail_back();
        let at = self.place_of(number);
        std::mem::swap(&mut self.tail, &mut self.buckets[at as usize]);
        self.tail_at = Some((number, at));
    }

    /// Adds `key` to bucket `number`, leaving the tail as it is (keys in no order, as a
    /// rebuild adds them).
    fn push_aside(&mut self, number: u64, key: K) {
        if self.tail_at.is_some_and(|(tail, _)| tail == number) {
            self.tail.push(key);
        } else {
            let at = self.place_of(number);
            self.buckets[at as usize].push(key);
        }
    }

    /// Where bucket `number` is kept, a place taken for it if it has none.
    fn place_of(&mut self, number: u64) -> u32 {
        if let Some(&at) = self.index.get(&number) {
            return at;
        }
        let at = self.spare.pop().unwrap_or_else(|| {
            self.buckets.push(Vec::new());
            u32::try_from(self.buckets.len() - 1).expect("fewer than 2^32 buckets")
        });
        self.index.insert(number, at);
        self.order.push(Reverse(number));
        at
    }

    fn put_tail_back(&mut self) {
        if let Some((_, at)) = self.tail_at.take() {
            std::mem::swap(&mut self.tail, &mut self.buckets[at as usize]);
        }
    }

    /// Moves the earliest bucket's keys into `into` (empty), and returns its number.
    fn pop_earliest(&mut self, into: &mut Vec<K>) -> Option<u64> {
        let Reverse(number) = self.order.pop()?;
        if self.tail_at.is_some_and(|(tail, _)| tail == number) {
            self.put_tail_back();
        }
        let at = self.index.remove(&number)?;
        // The bucket keeps `into`'s allocation for its next use.
        std::mem::swap(into, &mut self.buckets[at as usize]);
        self.spare.push(at);
        Some(number)
    }

    fn clear(&mut self) {
        self.put_tail_back();
        self.index.clear();
        self.order.clear();
        self.spare.clear();
        for (at, bucket) in self.buckets.iter_mut().enumerate() {
            bucket.clear();
            self.spare.push(at as u32);
        }
    }
}

/// The naive table production connectors use: a map, and a poll that scans every lease;
/// by default std's map with its SipHash, as a connector keeps it without thought for speed.
///
/// It is the baseline `cargo xtask bench` measures [`LeaseTable`] against (also with
/// [`LeaseTable`]'s own hasher, `S`, so that a ratio compares the structures alone), and the
/// obvious model the property tests check it with.
#[derive(Clone, Debug)]
pub struct ScanLeaseTable<K, S = std::collections::hash_map::RandomState> {
    leases: HashMap<K, Time, S>,
}

impl<K, S: Default> Default for ScanLeaseTable<K, S> {
    fn default() -> Self {
        ScanLeaseTable { leases: HashMap::default() }
    }
}

impl<K: Hash + Eq + Clone> ScanLeaseTable<K> {
    /// An empty table, on std's SipHash.
    pub fn new() -> Self {
        Self::default()
    }
}

impl<K: Hash + Eq + Clone, S: std::hash::BuildHasher> ScanLeaseTable<K, S> {
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
    fn renewal_storms_add_no_entries() {
        let mut table = LeaseTable::new();
        table.grant(1u32, t(10)).unwrap();
        for i in 0..100_000u64 {
            table.renew(&1, Time::from_nanos(i), 10 * SEC);
        }
        assert_eq!(table.entries, 1, "a renewal writes the lease alone");
        // Its entry, still at 10 s, moves to the renewed expiry when it comes due.
        assert_eq!(table.poll_expired(t(10)), None);
        assert_eq!(table.poll_expired(t(11)), Some((1, Time::from_nanos(99_999) + 10 * SEC)));
    }

    #[test]
    fn released_leases_entries_stay_bounded_and_the_held_ones_are_reaped_in_order() {
        let mut table = LeaseTable::new();
        for k in 0..10u64 {
            table.grant(k, t(100 - k)).unwrap();
        }
        // A churn of grants and releases with time standing still: each release leaves an
        // entry behind until compaction.
        for k in 10..200_010u64 {
            table.grant(k, t(50) + Duration::from_nanos(k)).unwrap();
            table.release(&k);
            // Compaction runs as an entry is scheduled; the release after it holds one lease fewer.
            assert!(table.entries <= 8 * (table.len() + 1) + 1025, "{} entries", table.entries);
        }
        assert_eq!(table.next_expiry(), Some(t(91)));
        let reaped: Vec<u64> = std::iter::from_fn(|| table.poll_expired(t(100))).map(|(k, _)| k).collect();
        assert_eq!(reaped, (0..10).rev().collect::<Vec<_>>());
        assert!(table.is_empty() && table.next_expiry().is_none());
    }

    #[test]
    fn a_lease_renewed_within_its_bucket_and_one_granted_into_the_front_keep_their_order() {
        // Expiries a microsecond apart share a bucket: the earlier, renewed by a microsecond,
        // moves behind the later within the front; a grant due before both goes first.
        let mut table = LeaseTable::new();
        let base = t(10);
        table.grant("a", base).unwrap();
        table.grant("b", base + Duration::from_micros(1)).unwrap();
        assert_eq!(table.next_expiry(), Some(base));
        assert_eq!(table.renew(&"a", t(9), SEC + Duration::from_micros(2)), Some(base + Duration::from_micros(2)));
        table.grant("c", base - Duration::from_nanos(1)).unwrap();
        let now = base + Duration::from_micros(5);
        let reaped: Vec<_> = std::iter::from_fn(|| table.poll_expired(now)).map(|(k, _)| k).collect();
        assert_eq!(reaped, ["c", "b", "a"]);
    }

    #[test]
    fn a_key_granted_again_in_another_slot_is_reaped_in_its_new_slots_order() {
        // x takes slot 0, y slot 1; x is released and slot 0 goes to z; x, granted again,
        // takes slot 2. All are due at the same time: z, y, x, whether their entries wait in
        // a later bucket (keys alone) or in the front (with the slot of their grant).
        for in_front in [false, true] {
            let mut table = LeaseTable::new();
            let due = t(10);
            if in_front {
                table.grant("w", due - Duration::from_nanos(1)).unwrap();
                assert_eq!(table.next_expiry(), Some(due - Duration::from_nanos(1)), "its bucket is the front");
            }
            table.grant("x", due).unwrap();
            table.grant("y", due).unwrap();
            assert_eq!(table.release(&"x"), Some(due));
            table.grant("z", due).unwrap();
            table.grant("x", due).unwrap();
            let reaped: Vec<_> = std::iter::from_fn(|| table.poll_expired(due)).map(|(k, _)| k).collect();
            let want: &[&str] = if in_front { &["w", "z", "y", "x"] } else { &["z", "y", "x"] };
            assert_eq!(reaped, want);
            assert!(table.is_empty() && table.next_expiry().is_none());
        }
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
