//! P's bounded bookkeeping: messages that came before their export, ids released recently,
//! and the D incarnations seen gone. Each has a documented bound; past it the oldest goes.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv_core::{EngineId, RequestId, Time};

use crate::common::Consumer;

/// Entries staged, in arrival order, at most `capacity`, oldest evicted first; found by the
/// request's base id, so that settling an export never scans the whole stage.
#[derive(Debug)]
pub(crate) struct EarlyStage<T> {
    capacity: usize,
    next: u64,
    entries: BTreeMap<u64, Staged<T>>,
    by_base: BTreeMap<RequestId, BTreeSet<u64>>,
}

#[derive(Debug)]
struct Staged<T> {
    at: Time,
    request: RequestId,
    item: T,
}

impl<T> EarlyStage<T> {
    pub fn new(capacity: usize) -> Self {
        EarlyStage { capacity: capacity.max(1), next: 0, entries: BTreeMap::new(), by_base: BTreeMap::new() }
    }

    /// Stages `item` about `request`; returns how many were evicted to make room.
    pub fn push(&mut self, now: Time, request: RequestId, item: T) -> u64 {
        let mut evicted = 0;
        while self.entries.len() >= self.capacity {
            let Some((&seq, _)) = self.entries.first_key_value() else { break };
            self.remove(seq);
            evicted += 1;
        }
        let seq = self.next;
        self.next += 1;
        self.by_base.entry(request.base()).or_default().insert(seq);
        self.entries.insert(seq, Staged { at: now, request, item });
        evicted
    }

    fn remove(&mut self, seq: u64) -> Option<Staged<T>> {
        let staged = self.entries.remove(&seq)?;
        let base = staged.request.base();
        if let Some(set) = self.by_base.get_mut(&base) {
            set.remove(&seq);
            if set.is_empty() {
                self.by_base.remove(&base);
            }
        }
        Some(staged)
    }

    /// Takes, in arrival order, the entries about `request` exactly, or with `by_base` about
    /// any id of the same base id, that `keep` accepts; the rest stay staged in their order.
    pub fn take(
        &mut self,
        request: &RequestId,
        by_base: bool,
        keep: impl Fn(&RequestId, &T) -> bool,
    ) -> Vec<(RequestId, T)> {
        let Some(seqs) = self.by_base.get(&request.base()) else { return Vec::new() };
        let chosen: Vec<u64> = seqs
            .iter()
            .copied()
            .filter(|seq| {
                let staged = &self.entries[seq];
                (by_base || staged.request == *request) && keep(&staged.request, &staged.item)
            })
            .collect();
        chosen.into_iter().filter_map(|seq| self.remove(seq)).map(|s| (s.request, s.item)).collect()
    }

    /// The entries about `request` exactly, or with `by_base` about any id of the same base
    /// id, in arrival order.
    pub fn about<'a>(
        &'a self,
        request: &'a RequestId,
        by_base: bool,
    ) -> impl Iterator<Item = (&'a RequestId, &'a T)> + 'a {
        self.by_base
            .get(&request.base())
            .into_iter()
            .flat_map(move |seqs| seqs.iter().map(move |seq| &self.entries[seq]))
            .filter(move |s| by_base || s.request == *request)
            .map(|s| (&s.request, &s.item))
    }

    /// Files the entries about `from` exactly under `to` instead, in their arrival order: the
    /// messages that named an export by another id of it (a transfer id) before that id was
    /// known.
    pub fn rename(&mut self, from: &RequestId, to: &RequestId) {
        let Some(seqs) = self.by_base.get(&from.base()) else { return };
        let moved: Vec<u64> = seqs.iter().copied().filter(|seq| self.entries[seq].request == *from).collect();
        for seq in moved {
            let base = from.base();
            if let Some(set) = self.by_base.get_mut(&base) {
                set.remove(&seq);
                if set.is_empty() {
                    self.by_base.remove(&base);
                }
            }
            self.entries.get_mut(&seq).expect("staged").request = to.clone();
            self.by_base.entry(to.base()).or_default().insert(seq);
        }
    }

    /// Whether an entry about `request` exactly satisfies `test`.
    pub fn any(&self, request: &RequestId, test: impl Fn(&T) -> bool) -> bool {
        self.by_base.get(&request.base()).is_some_and(|seqs| {
            seqs.iter().map(|seq| &self.entries[seq]).any(|s| s.request == *request && test(&s.item))
        })
    }

    /// Drops entries staged before `horizon`; returns how many.
    pub fn expire(&mut self, horizon: Time) -> u64 {
        let mut dropped = 0;
        while let Some((&seq, staged)) = self.entries.first_key_value() {
            if staged.at >= horizon {
                break;
            }
            self.remove(seq);
            dropped += 1;
        }
        dropped
    }

    /// The earliest staging time, for the expiry wake-up.
    pub fn oldest(&self) -> Option<Time> {
        self.entries.first_key_value().map(|(_, s)| s.at)
    }

    /// Entries staged.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

/// At most this many released ids are remembered (by each worker, each for two leases, to tell
/// late messages from early ones; by the scheduler, to refuse an id that named an export).
pub(crate) const RECENT_RELEASES: usize = 65_536;

/// Keys remembered until a horizon, at most `capacity` of them (the oldest forgotten first).
#[derive(Debug)]
pub(crate) struct Recent<K = RequestId> {
    capacity: usize,
    ids: BTreeMap<K, Time>,
    order: VecDeque<(Time, K)>,
}

impl<K: Ord + Clone> Recent<K> {
    pub fn new(capacity: usize) -> Self {
        Recent { capacity: capacity.max(1), ids: BTreeMap::new(), order: VecDeque::new() }
    }

    /// Remembers `id` as of `at` (a second insert keeps the first time).
    pub fn insert(&mut self, id: K, at: Time) {
        if self.ids.contains_key(&id) {
            return;
        }
        while self.ids.len() >= self.capacity {
            let Some((_, old)) = self.order.pop_front() else { break };
            self.ids.remove(&old);
        }
        self.ids.insert(id.clone(), at);
        self.order.push_back((at, id));
    }

    pub fn contains(&self, id: &K) -> bool {
        self.ids.contains_key(id)
    }

    /// Whether one more key would make the oldest be forgotten.
    pub fn is_full(&self) -> bool {
        self.ids.len() >= self.capacity
    }

    /// Forgets ids remembered before `horizon`.
    pub fn expire(&mut self, horizon: Time) {
        while self.order.front().is_some_and(|(t, _)| *t < horizon) {
            let (_, id) = self.order.pop_front().expect("front exists");
            self.ids.remove(&id);
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Forgets every key; returns them, the oldest first.
    pub fn take_all(&mut self) -> impl Iterator<Item = K> {
        self.ids.clear();
        std::mem::take(&mut self.order).into_iter().map(|(_, id)| id)
    }
}

/// D incarnations seen gone: for each engine, every incarnation below a mark is gone (its side
/// channel closed, or a newer one handshook). At most `capacity` engines are remembered; the
/// one remembered longest is forgotten first, which only makes P wait for a lease instead.
#[derive(Debug)]
pub(crate) struct GoneIncarnations {
    capacity: usize,
    below: BTreeMap<EngineId, u64>,
    order: VecDeque<EngineId>,
}

impl GoneIncarnations {
    pub fn new(capacity: usize) -> Self {
        GoneIncarnations { capacity: capacity.max(1), below: BTreeMap::new(), order: VecDeque::new() }
    }

    /// Every incarnation of `engine` below `mark` is gone.
    pub fn mark_below(&mut self, engine: &EngineId, mark: u64) {
        match self.below.get_mut(engine) {
            Some(old) => *old = (*old).max(mark),
            None => {
                while self.below.len() >= self.capacity {
                    let Some(oldest) = self.order.pop_front() else { break };
                    self.below.remove(&oldest);
                }
                self.below.insert(engine.clone(), mark);
                self.order.push_back(engine.clone());
            }
        }
    }

    /// Whether this incarnation is known to be gone.
    pub fn is_gone(&self, consumer: &Consumer) -> bool {
        self.below.get(&consumer.engine).is_some_and(|&mark| consumer.instance < mark)
    }

    pub fn len(&self) -> usize {
        self.below.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stage_is_bounded_evicts_the_oldest_and_finds_by_base() {
        let mut stage = EarlyStage::new(2);
        assert_eq!(stage.push(Time::ZERO, "a".into(), 1), 0);
        assert_eq!(stage.push(Time::ZERO, "b-1234abcd".into(), 2), 0);
        assert_eq!(stage.push(Time::from_millis(1), "c".into(), 3), 1);
        assert!(stage.take(&"a".into(), false, |_, _| true).is_empty(), "a was evicted");
        assert!(stage.take(&"b".into(), false, |_, _| true).is_empty(), "exact match only");
        assert_eq!(stage.take(&"b".into(), true, |_, _| true), vec![("b-1234abcd".into(), 2)]);
        assert!(stage.take(&"c".into(), false, |_, &v| v == 4).is_empty());
        assert_eq!(stage.len(), 1);
        assert_eq!(stage.expire(Time::from_millis(1)), 0);
        assert_eq!(stage.expire(Time::from_millis(2)), 1);
        assert_eq!(stage.oldest(), None);
    }

    #[test]
    fn recent_ids_are_bounded_and_forgotten_after_the_horizon() {
        let mut recent: Recent = Recent::new(2);
        recent.insert("r1".into(), Time::from_millis(5));
        recent.expire(Time::from_millis(5));
        assert!(recent.contains(&"r1".into()));
        recent.expire(Time::from_millis(6));
        assert!(!recent.contains(&"r1".into()));
        for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
            recent.insert(id.into(), Time::from_millis(10 + i as u64));
        }
        assert_eq!(recent.len(), 2);
        assert!(!recent.contains(&"a".into()), "the oldest went first");
    }

    #[test]
    fn gone_incarnations_are_below_a_mark_and_bounded() {
        let mut gone = GoneIncarnations::new(1);
        let d = |engine: &str, instance| Consumer { engine: EngineId::new(engine), instance };
        gone.mark_below(&EngineId::new("d0"), 3);
        assert!(gone.is_gone(&d("d0", 2)));
        assert!(!gone.is_gone(&d("d0", 3)));
        gone.mark_below(&EngineId::new("d0"), 1);
        assert!(gone.is_gone(&d("d0", 2)), "a mark never moves back");
        gone.mark_below(&EngineId::new("d1"), 5);
        assert_eq!(gone.len(), 1);
        assert!(!gone.is_gone(&d("d0", 2)), "d0 was forgotten to make room");
        assert!(gone.is_gone(&d("d1", 4)));
    }
}
