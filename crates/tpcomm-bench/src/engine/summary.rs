//! Helpers of the closing lines subcommands print below their tables: first occurrences,
//! figures per size and their geometric mean.

use crate::engine::row::Row;
use crate::engine::sweep::short_bytes;

/// `items` without repeats, in the order they first come.
pub(crate) fn distinct<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// `"1K 1.02, 4K 0.98"`: each row's size and `value` (rows without one are left out),
/// `decimals` after the point, and the geometric mean of the values.
pub(crate) fn per_size<'r>(
    rows: impl IntoIterator<Item = &'r Row>,
    value: impl Fn(&Row) -> Option<f64>,
    decimals: usize,
) -> (String, Option<f64>) {
    let (mut text, mut values) = (Vec::new(), Vec::new());
    for r in rows {
        if let Some(v) = value(r) {
            text.push(format!("{} {v:.decimals$}", short_bytes(r.bytes)));
            values.push(v);
        }
    }
    (text.join(", "), geomean(&values))
}

/// Geometric mean of `values` (`None` when empty or any is not positive).
pub(crate) fn geomean(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|&v| v <= 0.0) {
        return None;
    }
    Some((values.iter().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::row::row_vs;

    #[test]
    fn summary_helpers_take_geometric_means_and_keep_first_occurrences() {
        assert_eq!(geomean(&[2.0, 8.0]), Some(4.0));
        assert_eq!(distinct([3, 1, 3, 2, 1]), [3, 1, 2]);
        let rows = [row_vs("t", "a", "v", 2.0), row_vs("t", "b", "v", 8.0)];
        let (text, g) = per_size(&rows, |r| r.vs_peer, 1);
        assert_eq!((text.as_str(), g), ("0 2.0, 0 8.0", Some(4.0)));
    }
}
