//! Targets: what a subcommand aims at and why ([`Target`]), how the rows judge it ([`Judge`],
//! [`within`]), and the verdicts a run prints and writes ([`Verdict`], [`verdict_lines`]).

use serde::{Deserialize, Serialize};

use crate::engine::row::Row;

/// How a [`Target`] judges the rows: met, and the figures it was decided from; `None` when
/// the rows hold nothing to judge.
pub(crate) type Judge = Box<dyn Fn(&[Row]) -> Option<(bool, String)>>;

/// The most rows outside a target that its detail names.
const MAX_LISTED: usize = 5;

/// The judge of "every row that `pick` chooses within `limit` of its peer", `distance`
/// telling how far a ratio is (`|x| x` for "at most", `|x| (x - 1.0).abs()` for "either
/// way"): met when no ratio is farther than `limit`; the detail counts the rows within and
/// names those outside, farthest first (or the farthest, when none is). `None` when no
/// chosen row has a peer.
pub(crate) fn within(
    pick: impl Fn(&Row) -> bool + 'static,
    distance: fn(f64) -> f64,
    limit: f64,
) -> Judge {
    Box::new(move |rows: &[Row]| {
        let ratios: Vec<(f64, &Row)> = rows
            .iter()
            .filter(|r| pick(r))
            .filter_map(|r| Some((r.vs_peer?, r)))
            .collect();
        let far = |(x, r): &(f64, &Row)| format!("{} {} {} {x:.3}x", r.table, r.case, r.variant);
        let mut outside: Vec<&(f64, &Row)> = ratios
            .iter()
            .filter(|(x, _)| distance(*x) > limit)
            .collect();
        outside.sort_by(|a, b| distance(b.0).total_cmp(&distance(a.0)));
        let within = ratios.len() - outside.len();
        let mut detail = format!("{within} of {} rows within", ratios.len());
        if outside.is_empty() {
            let farthest = ratios
                .iter()
                .max_by(|a, b| distance(a.0).total_cmp(&distance(b.0)))?;
            detail.push_str(&format!(", farthest {}", far(farthest)));
        } else {
            let listed: Vec<String> = outside.iter().take(MAX_LISTED).map(|r| far(r)).collect();
            detail.push_str(&format!("; outside, farthest first: {}", listed.join(", ")));
            if outside.len() > MAX_LISTED {
                detail.push_str(&format!(" and {} more", outside.len() - MAX_LISTED));
            }
        }
        Some((outside.is_empty(), detail))
    })
}

/// The clause a verdict adds for the floor measured beside a target: "; `subject` bounds
/// `at`", then ": out of reach`scope` on this machine" when the floor itself misses the
/// target (`reachable` false).
pub(crate) fn floor_bound(subject: &str, at: &str, reachable: bool, scope: &str) -> String {
    let reach = if reachable {
        String::new()
    } else {
        format!(": out of reach{scope} on this machine")
    };
    format!("; {subject} bounds {at}{reach}")
}

/// A target drawn on the time charts: `ratio` times the median of `peer`, case by case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RatioLine {
    /// The variant the target compares with.
    pub(crate) peer: String,
    /// The largest time allowed, as a multiple of the peer's.
    pub(crate) ratio: f64,
}

impl RatioLine {
    pub(crate) fn new(peer: &str, ratio: f64) -> Option<Self> {
        Some(Self {
            peer: peer.into(),
            ratio,
        })
    }
}

/// A performance target a subcommand checks its rows against, with the reason it exists.
pub(crate) struct Target {
    /// What is aimed at, for a user ("tpcomm within 1.1x of rsmpi at every size").
    pub(crate) what: String,
    /// Why this figure is the target.
    pub(crate) why: &'static str,
    /// The verdict from the rows: met, and the figures it was decided from; `None` when the
    /// rows hold nothing to judge.
    pub(crate) judge: Judge,
    /// The target as a line on the charts, where it is a ratio to a peer at every case.
    pub(crate) line: Option<RatioLine>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("what", &self.what).finish()
    }
}

/// A target checked against this run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Verdict {
    pub(crate) target: String,
    pub(crate) reason: String,
    pub(crate) met: bool,
    pub(crate) detail: String,
    /// Whether this run is the configuration the target is stated for; a verdict on
    /// another configuration is indicative only.
    pub(crate) binding: bool,
    /// The target as a line on the charts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) line: Option<RatioLine>,
}

impl Verdict {
    /// The targets `rows` can judge.
    pub(crate) fn judge_all(targets: &[Target], rows: &[Row], binding: bool) -> Vec<Verdict> {
        targets
            .iter()
            .filter_map(|t| {
                let (met, detail) = (t.judge)(rows)?;
                Some(Verdict {
                    target: t.what.clone(),
                    reason: t.why.into(),
                    met,
                    detail,
                    binding,
                    line: t.line.clone(),
                })
            })
            .collect()
    }

    /// The two comment lines of the verdict.
    pub(crate) fn lines(&self) -> [String; 2] {
        let state = if self.met { "MET" } else { "MISSED" };
        let scope = if self.binding {
            ""
        } else {
            " [indicative only]"
        };
        [
            format!("target {}: {state}{scope} ({})", self.target, self.detail),
            format!("  why: {}", self.reason),
        ]
    }
}

/// The closing lines of a run with `targets` targets, judged into `verdicts`: a blank line,
/// a note when none could be judged or the run is not the configuration they are stated
/// for, and the verdicts with their reasons.
pub(crate) fn verdict_lines(
    targets: usize,
    verdicts: &[Verdict],
    (binding, stated_for): (bool, &str),
) -> Vec<String> {
    let mut lines = Vec::new();
    if targets == 0 {
        return lines;
    }
    lines.push(String::new());
    if verdicts.is_empty() {
        lines.push(format!(
            "no target can be judged on this run: they are stated for {stated_for}"
        ));
    } else if !binding {
        lines.push(format!(
            "the targets are stated for {stated_for}: the verdicts below are indicative only"
        ));
    }
    lines.extend(verdicts.iter().flat_map(Verdict::lines));
    lines
}

/// The verdicts of `targets` on `rows`, binding (for tests).
#[cfg(test)]
pub(crate) fn judge(targets: &[Target], rows: &[Row]) -> Vec<Verdict> {
    Verdict::judge_all(targets, rows, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::row::row_vs;

    #[test]
    fn within_counts_the_rows_inside_and_names_the_farthest_and_those_outside() {
        let row = |case: &str, vs| row_vs("t", case, "v", vs);
        let judge = within(|r| r.is("v"), |x| (x - 1.0).abs(), 0.05);
        let (met, detail) = judge(&[row("8", 1.04), row("16", 0.94)]).unwrap();
        assert!(!met);
        assert_eq!(
            detail,
            "1 of 2 rows within; outside, farthest first: t 16 v 0.940x"
        );
        assert_eq!(
            judge(&[row("8", 0.96)]),
            Some((true, "1 of 1 rows within, farthest t 8 v 0.960x".into()))
        );
        assert_eq!(judge(&[]), None);
    }

    #[test]
    fn the_verdicts_say_when_the_run_is_not_the_configuration_of_the_targets() {
        let target = Target {
            what: "fast".into(),
            why: "because",
            judge: Box::new(|rows: &[Row]| {
                Some((rows.first()?.stats.median_us < 2.0, "1 us".into()))
            }),
            line: None,
        };
        let rows = [Row::of_us("t", "c", "v", 1.0)];
        let lines = |rows: &[Row], binding| {
            let verdicts = Verdict::judge_all(std::slice::from_ref(&target), rows, binding);
            verdict_lines(1, &verdicts, (binding, "2 ranks"))
        };
        assert_eq!(
            lines(&rows, false)[1..],
            [
                "the targets are stated for 2 ranks: the verdicts below are indicative only",
                "target fast: MET [indicative only] (1 us)",
                "  why: because"
            ]
        );
        assert_eq!(lines(&rows, true)[1], "target fast: MET (1 us)");
        assert_eq!(
            lines(&[], true)[1],
            "no target can be judged on this run: they are stated for 2 ranks"
        );
        assert!(verdict_lines(0, &[], (false, "2 ranks")).is_empty());
    }
}
