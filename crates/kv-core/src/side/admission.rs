//! Which accepted connections a listener keeps while they authenticate, when a flood brings
//! more than it holds.
//!
//! A listener cannot tell a real engine from a flood until the connection proves the key, so
//! it ranks connections by how far they got ([`Stage`]) and never drops one that has proved
//! more in favour of one that has proved less. Each stage has a budget of its own, in total and
//! per source address: a connection entering a full stage displaces the oldest of that stage,
//! from its own source when that source holds its share already, else from the source holding
//! the most. So a flood that never authenticates displaces only its own kind, a real engine
//! that answers within a round trip moves on before as many newer connections reach its stage,
//! and one flooding address cannot take the budget of the others.
//!
//! The side channel's listener ([`super::SideEndpoint`]) and the TCP transport's data listener
//! both keep their pending connections here, so the two follow one rule.

use core::net::IpAddr;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hash;

/// How far an accepted connection got toward proving it belongs to the cluster.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Stage {
    /// Accepted; nothing has arrived that names anyone.
    Accepted,
    /// Its greeting arrived and was answered (a HELLO): it names someone, but proved nothing.
    Greeted,
    /// It proved the key (or, for a link, the session): a key holder finishing its handshake.
    Proven,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 3] = [Stage::Accepted, Stage::Greeted, Stage::Proven];

    /// The stage's name, in lower case.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Accepted => "accepted",
            Stage::Greeted => "greeted",
            Stage::Proven => "proven",
        }
    }
}

/// How many pending connections a listener keeps.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AdmissionLimits {
    /// Connections in one stage, from all sources.
    pub per_stage: usize,
    /// Connections in one stage from one source address.
    pub per_source: usize,
}

impl AdmissionLimits {
    /// The budget of `stage`, in all and from one source. [`Stage::Proven`] holds an eighth
    /// of the others: only key holders get there, and each may buffer a whole offer (MiBs).
    pub fn of(&self, stage: Stage) -> (usize, usize) {
        match stage {
            Stage::Proven => ((self.per_stage / 8).max(1), (self.per_source / 8).max(1)),
            _ => (self.per_stage, self.per_source),
        }
    }
}

/// A connection that another displaced.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Evicted<C> {
    /// The connection to close.
    pub conn: C,
    /// The stage it was in (the stage the newcomer entered).
    pub stage: Stage,
    /// Whether its source held its share of the stage (else the stage was full).
    pub per_source: bool,
}

struct Entry {
    stage: Stage,
    source: IpAddr,
    /// When it entered its stage, in entries: the oldest has the lowest.
    seq: u64,
}

/// The pending connections of one listener, by stage and source (see the module docs).
pub struct Admission<C> {
    limits: AdmissionLimits,
    next: u64,
    conns: HashMap<C, Entry>,
    /// Per stage: entry order to connection.
    by_stage: [BTreeMap<u64, C>; 3],
    /// Per stage and source: the entry orders of its connections.
    by_source: HashMap<(Stage, IpAddr), BTreeSet<u64>>,
}

impl<C: Copy + Eq + Hash> Admission<C> {
    /// An empty book; budgets of 0 are taken as 1.
    pub fn new(limits: AdmissionLimits) -> Self {
        let limits = AdmissionLimits { per_stage: limits.per_stage.max(1), per_source: limits.per_source.max(1) };
        Admission { limits, next: 0, conns: HashMap::new(), by_stage: Default::default(), by_source: HashMap::new() }
    }

    /// Takes in a connection just accepted from `source`; returns the one it displaced.
    pub fn accept(&mut self, conn: C, source: IpAddr) -> Option<Evicted<C>> {
        if self.conns.contains_key(&conn) {
            return None;
        }
        self.enter(conn, Stage::Accepted, source)
    }

    /// `conn` got to `stage`; returns the connection of that stage it displaced. A connection
    /// the book does not hold, or one at that stage or later already, changes nothing.
    pub fn advance(&mut self, conn: C, stage: Stage) -> Option<Evicted<C>> {
        let entry = self.conns.get(&conn)?;
        if entry.stage >= stage {
            return None;
        }
        let source = entry.source;
        self.remove(conn);
        self.enter(conn, stage, source)
    }

    /// `conn` is no longer pending (established, handed on, failed or closed); its stage then.
    pub fn remove(&mut self, conn: C) -> Option<Stage> {
        let entry = self.conns.remove(&conn)?;
        self.by_stage[entry.stage as usize].remove(&entry.seq);
        let key = (entry.stage, entry.source);
        if let Some(seqs) = self.by_source.get_mut(&key) {
            seqs.remove(&entry.seq);
            if seqs.is_empty() {
                self.by_source.remove(&key);
            }
        }
        Some(entry.stage)
    }

    /// Connections pending, in every stage.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Whether none is pending.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Connections pending in `stage`.
    pub fn count(&self, stage: Stage) -> usize {
        self.by_stage[stage as usize].len()
    }

    /// Connections pending in `stage` from `source`.
    pub fn count_from(&self, stage: Stage, source: IpAddr) -> usize {
        self.by_source.get(&(stage, source)).map_or(0, BTreeSet::len)
    }

    /// The stage `conn` is in, if it is pending.
    pub fn stage(&self, conn: C) -> Option<Stage> {
        self.conns.get(&conn).map(|e| e.stage)
    }

    /// The most connections the book holds at once: the budgets are the bounds.
    pub fn capacity(&self) -> usize {
        Stage::ALL.iter().map(|&stage| self.limits.of(stage).0).sum()
    }

    fn enter(&mut self, conn: C, stage: Stage, source: IpAddr) -> Option<Evicted<C>> {
        let (per_stage, per_source) = self.limits.of(stage);
        let evicted = if self.count_from(stage, source) >= per_source {
            self.oldest_from(stage, source).map(|c| Evicted { conn: c, stage, per_source: true })
        } else if self.count(stage) >= per_stage {
            // The source holding the most of this stage gives way (ties: the one whose oldest
            // is oldest, so the choice is the same however the map is laid out).
            let crowded = self
                .by_source
                .iter()
                .filter(|((s, _), _)| *s == stage)
                .max_by_key(|(_, seqs)| (seqs.len(), std::cmp::Reverse(seqs.first().copied())))
                .map(|((_, source), _)| *source);
            crowded.and_then(|source| self.oldest_from(stage, source)).map(|c| Evicted {
                conn: c,
                stage,
                per_source: false,
            })
        } else {
            None
        };
        if let Some(e) = &evicted {
            self.remove(e.conn);
        }
        self.next += 1;
        let seq = self.next;
        self.conns.insert(conn, Entry { stage, source, seq });
        self.by_stage[stage as usize].insert(seq, conn);
        self.by_source.entry((stage, source)).or_default().insert(seq);
        evicted
    }

    fn oldest_from(&self, stage: Stage, source: IpAddr) -> Option<C> {
        let seq = self.by_source.get(&(stage, source))?.first()?;
        self.by_stage[stage as usize].get(seq).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn book(per_stage: usize, per_source: usize) -> Admission<u32> {
        Admission::new(AdmissionLimits { per_stage, per_source })
    }

    #[test]
    fn a_full_stage_displaces_its_oldest_and_never_a_later_stage() {
        let mut b = book(3, 3);
        for c in 0..3 {
            assert_eq!(b.accept(c, ip(1)), None);
        }
        assert_eq!(b.advance(0, Stage::Greeted), None);
        // Accepted holds 1 and 2; a flood of new connections displaces them, never 0.
        assert_eq!(b.accept(10, ip(1)), None);
        let e = b.accept(11, ip(1)).expect("stage full");
        assert_eq!((e.conn, e.stage), (1, Stage::Accepted));
        for c in 12..100 {
            assert!(b.accept(c, ip(1)).is_some_and(|e| e.conn != 0));
        }
        assert_eq!(b.stage(0), Some(Stage::Greeted));
        // Greeted connections displace only greeted ones, oldest first.
        assert_eq!(b.advance(97, Stage::Greeted), None);
        assert_eq!(b.advance(98, Stage::Greeted), None);
        assert_eq!(b.advance(99, Stage::Greeted).map(|e| e.conn), Some(0));
        assert_eq!(b.advance(99, Stage::Accepted), None, "no going back");
    }

    #[test]
    fn a_flooding_source_displaces_only_its_own() {
        let mut b = book(8, 4);
        for c in 0..3 {
            b.accept(c, ip(1));
        }
        // Source 2 floods: past its 4 it displaces its own oldest, never source 1's.
        for c in 100..200 {
            if let Some(e) = b.accept(c, ip(2)) {
                assert!(e.per_source && e.conn >= 100, "{e:?}");
            }
        }
        assert_eq!((b.count_from(Stage::Accepted, ip(1)), b.count_from(Stage::Accepted, ip(2))), (3, 4));
        // A full stage takes from the source holding the most.
        b.accept(7, ip(3));
        let e = b.accept(8, ip(3)).expect("stage full");
        assert!(!e.per_source && e.conn >= 100, "{e:?}");
    }

    proptest! {
        // Whatever comes, the budgets hold and a connection is displaced only by a newcomer to
        // its own stage.
        #[test]
        fn budgets_hold_and_only_equals_displace(ops in prop::collection::vec((0u32..40, 0u8..3, 0u8..4), 1..400)) {
            let mut b = book(5, 3);
            for (conn, what, source) in ops {
                let evicted = match what {
                    0 => b.accept(conn, ip(source)).map(|e| (e, Stage::Accepted)),
                    1 => b.advance(conn, Stage::Greeted).map(|e| (e, Stage::Greeted)),
                    _ => b.advance(conn, Stage::Proven).map(|e| (e, Stage::Proven)),
                };
                if let Some((e, entered)) = evicted {
                    prop_assert_eq!(e.stage, entered);
                    prop_assert!(b.stage(e.conn).is_none());
                }
                for stage in Stage::ALL {
                    let (per_stage, per_source) = AdmissionLimits { per_stage: 5, per_source: 3 }.of(stage);
                    prop_assert!(b.count(stage) <= per_stage);
                    for s in 0..4 {
                        prop_assert!(b.count_from(stage, ip(s)) <= per_source);
                    }
                }
                prop_assert!(b.len() <= b.capacity());
            }
        }
    }
}
