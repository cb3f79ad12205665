//! The one quantile the reports use: nearest rank over the sorted values, so a p50 of an
//! even count is the upper of the two middle values, and every reported figure is a measured
//! sample, never an interpolation.

/// The `q` quantile (0 to 1, nearest rank) of `values`, or `None` when there are none.
pub fn quantile<T: Copy + PartialOrd>(values: &[T], q: f64) -> Option<T> {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let last = sorted.len().checked_sub(1)?;
    let rank = (last as f64 * q.clamp(0.0, 1.0)).round() as usize;
    sorted.get(rank.min(last)).copied()
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn nearest_rank_on_any_order_and_nothing_for_nothing() {
        let values = [5u64, 1, 4, 2, 3];
        assert_eq!(quantile(&values, 0.5), Some(3));
        assert_eq!(quantile(&values, 0.0), Some(1));
        assert_eq!(quantile(&values, 0.99), Some(5));
        // An even count: the upper middle value.
        assert_eq!(quantile(&[4.0, 1.0, 3.0, 2.0], 0.5), Some(3.0));
        assert_eq!(quantile::<u64>(&[], 0.5), None);
    }
}
