//! Push: how far the writes ahead into one D rank's registered blocks have gone, and what a
//! write must move to bring them further. With a chunk computed layer by layer, the blocks of
//! the chunk in progress are written some model layers at a time.

use std::ops::Range;

/// Every model layer, as a layer range's end.
pub(super) const ALL_LAYERS: u32 = u32::MAX;

/// The D blocks of a registration written (or being written): the first `whole` in every
/// layer, and past them, up to `part`'s end, model layers `0..part`'s layers.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(super) struct Ahead {
    pub whole: usize,
    pub part: Option<(usize, u32)>,
}

/// A piece of a write: the registration's D blocks `blocks`, in model layers `layers`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(super) struct Segment {
    pub blocks: Range<usize>,
    pub layers: Range<u32>,
}

impl Segment {
    /// Whether it moves every layer.
    pub fn all_layers(&self) -> bool {
        self.layers == (0..ALL_LAYERS)
    }
}

impl Ahead {
    /// Blocks `0..whole` in every layer, and `whole..end` in layers `0..layers` (none when
    /// `end` is not past `whole` or `layers` is 0).
    pub fn new(whole: usize, end: usize, layers: u32) -> Ahead {
        let part = (end > whole && layers > 0).then_some((end, layers));
        Ahead { whole, part }
    }

    /// The layers written of D block `b`, as a range's end.
    fn layers_of(&self, b: usize) -> u32 {
        match self.part {
            _ if b < self.whole => ALL_LAYERS,
            Some((end, layers)) if b < end => layers,
            _ => 0,
        }
    }

    /// Where it ends: past the last block it says anything of.
    fn end(&self) -> usize {
        self.part.map_or(self.whole, |(end, _)| end.max(self.whole))
    }

    /// Whether every one of `blocks` D blocks is written in every layer.
    pub fn covers(&self, blocks: usize) -> bool {
        self.whole >= blocks
    }

    /// What a write must move to bring the blocks from `self` to `to`: for each run of blocks,
    /// the layers `to` has of them and `self` has not, in block order. A block `to` says fewer
    /// layers of than `self` (a layer count that went back) gets nothing.
    pub fn segments_to(&self, to: &Ahead) -> Vec<Segment> {
        let mut cuts = vec![0, self.whole, self.end(), to.whole, to.end()];
        cuts.sort_unstable();
        cuts.dedup();
        let mut segments: Vec<Segment> = Vec::new();
        for pair in cuts.windows(2) {
            let (start, end) = (pair[0], pair[1]);
            let (from, upto) = (self.layers_of(start), to.layers_of(start));
            if upto <= from {
                continue;
            }
            match segments.last_mut() {
                Some(last) if last.blocks.end == start && last.layers == (from..upto) => last.blocks.end = end,
                _ => segments.push(Segment { blocks: start..end, layers: from..upto }),
            }
        }
        segments
    }

    /// `self` and `to`, each block at the more of their layers: where a write of
    /// [`Ahead::segments_to`] leaves the blocks (as long as the layers only grow, `to`).
    pub fn then(&self, to: &Ahead) -> Ahead {
        let whole = self.whole.max(to.whole);
        let end = self.end().max(to.end());
        let layers = (whole..end).map(|b| self.layers_of(b).max(to.layers_of(b))).min().unwrap_or(0);
        Ahead::new(whole, end, layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(blocks: Range<usize>, layers: Range<u32>) -> Segment {
        Segment { blocks, layers }
    }

    #[test]
    fn whole_blocks_go_in_every_layer() {
        let none = Ahead::default();
        assert_eq!(none.segments_to(&Ahead::new(3, 3, 0)), vec![seg(0..3, 0..ALL_LAYERS)]);
        assert!(Ahead::new(3, 3, 0).segments_to(&Ahead::new(3, 3, 0)).is_empty());
        assert_eq!(Ahead::new(3, 0, 0).segments_to(&Ahead::new(5, 0, 0)), vec![seg(3..5, 0..ALL_LAYERS)]);
    }

    #[test]
    fn a_chunk_goes_a_layer_at_a_time_then_the_next_chunk_starts_from_its_first_layer() {
        let mut at = Ahead::new(2, 0, 0);
        let mut moved = Vec::new();
        for layers in 1..=3 {
            let to = Ahead::new(2, 4, layers);
            moved.extend(at.segments_to(&to));
            at = at.then(&to);
        }
        assert_eq!(moved, vec![seg(2..4, 0..1), seg(2..4, 1..2), seg(2..4, 2..3)]);
        // The chunk is whole (its last layers go), and the next one has its first layer.
        let to = Ahead::new(4, 6, 1);
        assert_eq!(at.segments_to(&to), vec![seg(2..4, 3..ALL_LAYERS), seg(4..6, 0..1)]);
        assert_eq!(at.then(&to), to);
        // At the export: the rest of the chunk's layers and the blocks never written, at once.
        assert_eq!(to.segments_to(&Ahead::new(8, 8, 0)), vec![seg(4..6, 1..ALL_LAYERS), seg(6..8, 0..ALL_LAYERS)]);
    }

    #[test]
    fn a_chunk_reported_before_its_first_layer_moves_only_the_whole_blocks_until_its_layers_come() {
        // vLLM's connector reports each chunk with no layer before its forward, then each layer.
        let mut at = Ahead::default();
        let mut moved = Vec::new();
        for to in [Ahead::new(2, 4, 0), Ahead::new(2, 4, 1), Ahead::new(2, 4, 2), Ahead::new(4, 6, 0)] {
            moved.extend(at.segments_to(&to));
            at = at.then(&to);
        }
        // (Layers past the model's are none: a plan of 2..ALL_LAYERS in a 2-layer model is empty.)
        let expected = [seg(0..2, 0..ALL_LAYERS), seg(2..4, 0..1), seg(2..4, 1..2), seg(2..4, 2..ALL_LAYERS)];
        assert_eq!(moved, expected);
        assert_eq!(at, Ahead::new(4, 6, 0), "nothing of the next chunk went");
        assert!(at.segments_to(&Ahead::new(4, 6, 0)).is_empty(), "a report repeated moves nothing");
    }

    #[test]
    fn layers_that_go_back_write_nothing_and_what_was_written_stays_written() {
        let at = Ahead::new(2, 4, 3);
        assert!(at.segments_to(&Ahead::new(2, 4, 2)).is_empty());
        assert_eq!(at.then(&Ahead::new(2, 4, 2)), at);
    }

    #[test]
    fn every_block_ends_in_every_layer_once() {
        // Any path of reports ends, at the export, with each block's layers moved once each.
        let steps = [Ahead::new(0, 2, 1), Ahead::new(0, 2, 2), Ahead::new(2, 5, 1), Ahead::new(5, 5, 0)];
        let mut at = Ahead::default();
        let mut moved: Vec<Segment> = Vec::new();
        for to in steps.iter().chain([&Ahead::new(7, 7, 0)]) {
            moved.extend(at.segments_to(to));
            at = at.then(to);
        }
        for b in 0..7 {
            let mut layers: Vec<Range<u32>> =
                moved.iter().filter(|s| s.blocks.contains(&b)).map(|s| s.layers.clone()).collect();
            layers.sort_by_key(|l| l.start);
            assert_eq!(layers.first().map(|l| l.start), Some(0), "block {b}: {layers:?}");
            assert!(layers.windows(2).all(|w| w[0].end == w[1].start), "block {b}: {layers:?}");
            assert_eq!(layers.last().map(|l| l.end), Some(ALL_LAYERS), "block {b}: {layers:?}");
        }
    }
}
