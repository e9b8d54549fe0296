//! Where the ranks ran while a case was timed: the facts that tell a slow machine state from
//! a slow call.
//!
//! A rank that sleeps in a wait pays a wake-up (microseconds on a VM) that the call itself
//! does not cost, and ranks that the scheduler puts on one CPU sleep in every wait, whatever
//! the transport does. Over each case's timed rounds every rank records its voluntary context
//! switches (`/proc/thread-self/status`: its waits that slept) and the CPU it is on after each
//! round (`getcpu`); over the whole run, rank 0 reads the CPU time the hypervisor stole
//! (`/proc/stat`). The case's rows carry the figures (`info`), and the run ends with a line
//! that names the cases where wake-ups or a shared CPU weigh in the times.

use tpcomm::Communicator;

use crate::engine::error::BenchError;
use crate::engine::row::Row;

/// What one wake-up is taken to cost when judging whether wake-ups weigh in a case's times:
/// the low end of what a futex wake took to run the woken rank on the development VMs
/// (3-15 us; a busy-polling MPI process never pays it).
const WAKE_US: f64 = 3.0;
/// The share of a round's time from which wake-ups weigh in it.
const WEIGHS: f64 = 0.05;
/// The most cases the closing line names.
const LISTED: usize = 6;
/// The share of timed rounds on one CPU from which a case is named as one where ranks
/// shared a CPU.
const SHARED: f64 = 0.1;

/// This rank's readings over a case's timed rounds (collected by [`Probe::finish`]).
#[derive(Debug)]
pub(crate) struct Probe {
    switches: Option<u64>,
    cpus: Vec<u32>,
}

impl Probe {
    /// Starts the readings before `rounds` timed rounds.
    pub(crate) fn start(rounds: usize) -> Self {
        Self {
            switches: voluntary_switches(),
            cpus: Vec::with_capacity(rounds),
        }
    }

    /// After a timed round: the CPU this rank is on.
    pub(crate) fn round(&mut self) {
        self.cpus.push(rustix::thread::sched_getcpu() as u32);
    }

    /// Collective: every rank's readings since [`Probe::start`], the same [`Placement`] on
    /// every rank; `round_ns` is the time of one round (the same on every rank). Every rank
    /// has recorded as many rounds (the count is agreed before them).
    pub(crate) fn finish<C: Communicator>(
        self,
        comm: &C,
        round_ns: u64,
    ) -> Result<Placement, BenchError> {
        const UNKNOWN: u64 = u64::MAX;
        let switches = match (self.switches, voluntary_switches()) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => UNKNOWN,
        };
        let mut send = switches.to_le_bytes().to_vec();
        send.extend(self.cpus.iter().flat_map(|c| c.to_le_bytes()));
        let mut all = vec![0u8; send.len() * comm.size()];
        comm.all_gather(&send, &mut all)?;
        // Each rank's block: its switches (8 bytes), then its CPU after each round (4 each).
        let blocks: Vec<&[u8]> = all.chunks_exact(send.len()).collect();
        let switches = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        fn cpu(block: &[u8], round: usize) -> &[u8] {
            &block[8 + 4 * round..12 + 4 * round]
        }
        let rounds = self.cpus.len();
        let most = blocks.iter().map(|b| switches(b)).max().unwrap_or(UNKNOWN);
        let one_cpu = (0..rounds)
            .filter(|&i| blocks.iter().all(|b| cpu(b, i) == cpu(blocks[0], i)))
            .count();
        Ok(Placement {
            parks_per_round: (most != UNKNOWN && rounds > 0).then(|| most as f64 / rounds as f64),
            one_cpu: if comm.size() > 1 && rounds > 0 {
                one_cpu as f64 / rounds as f64
            } else {
                0.0
            },
            round_us: round_ns as f64 / 1e3,
        })
    }
}

/// Where the ranks ran over a case's timed rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Placement {
    /// Voluntary context switches (waits that slept) per timed round on the rank that had
    /// most; `None` where `/proc` does not say.
    pub(crate) parks_per_round: Option<f64>,
    /// The share of timed rounds after which every rank was on one CPU (0 with one rank).
    pub(crate) one_cpu: f64,
    /// The time of one round (every variant's median, times the runs of it a round makes).
    pub(crate) round_us: f64,
}

impl Placement {
    /// Adds the figures to a row's facts: `parks_per_round` and `one_cpu_pct`.
    pub(crate) fn annotate(&self, row: &mut Row) {
        if let Some(p) = self.parks_per_round {
            row.info.insert("parks_per_round".into(), round3(p).into());
        }
        row.info
            .insert("one_cpu_pct".into(), round3(100.0 * self.one_cpu).into());
    }

    /// Whether wake-ups (at [`WAKE_US`] each) take at least [`WEIGHS`] of a round, or the
    /// ranks shared a CPU after at least [`SHARED`] of the rounds.
    fn disturbed(&self) -> bool {
        let wakes = self.parks_per_round.unwrap_or(0.0) * WAKE_US;
        wakes >= WEIGHS * self.round_us || self.one_cpu >= SHARED
    }
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// The CPU time the hypervisor steals from the machine, from [`StealClock::start`] on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StealClock(Option<(u64, u64)>);

impl StealClock {
    pub(crate) fn start() -> Self {
        Self(stolen_ticks())
    }

    /// The share of the machine's CPU time stolen since the start; `None` where `/proc/stat`
    /// does not say or no tick has passed (it counts in hundredths of a second).
    pub(crate) fn share(&self) -> Option<f64> {
        let ((s0, t0), (s1, t1)) = (self.0?, stolen_ticks()?);
        let total = t1.checked_sub(t0).filter(|&t| t > 0)?;
        Some(s1.saturating_sub(s0) as f64 / total as f64)
    }
}

/// The closing lines on where the ranks ran over the cases `(name, placement)` and the
/// share of CPU time stolen over the run: the ranges over every case, then the cases where
/// wake-ups weigh in the times or ranks shared a CPU (none when there are none).
pub(crate) fn summary(cases: &[(String, Placement)], stolen: Option<f64>) -> Vec<String> {
    if cases.is_empty() {
        return Vec::new();
    }
    let range = |values: Vec<f64>, scale: f64, digits: usize| -> String {
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min) * scale;
        let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max) * scale;
        if values.is_empty() {
            "unknown".into()
        } else {
            format!("{lo:.digits$}-{hi:.digits$}")
        }
    };
    let parks = cases
        .iter()
        .filter_map(|(_, p)| p.parks_per_round)
        .collect();
    let one_cpu = cases.iter().map(|(_, p)| p.one_cpu).collect();
    let stolen = stolen.map_or("unknown".into(), |s| format!("{:.1}%", 100.0 * s));
    let mut lines = vec![format!(
        "where the ranks ran over the timed rounds of {} cases: waits that slept per round {} \
         (the rank with most), every rank on one CPU after {}% of rounds; CPU time stolen by \
         the hypervisor over the run {stolen}",
        cases.len(),
        range(parks, 1.0, 2),
        range(one_cpu, 100.0, 0),
    )];
    let disturbed: Vec<&(String, Placement)> =
        cases.iter().filter(|(_, p)| p.disturbed()).collect();
    let mut named: Vec<String> = disturbed
        .iter()
        .take(LISTED)
        .map(|(name, p)| {
            let parks = p.parks_per_round.map_or("?".into(), |x| format!("{x:.1}"));
            format!(
                "{name} ({parks} per {:.1} us round, one CPU {:.0}%)",
                p.round_us,
                100.0 * p.one_cpu
            )
        })
        .collect();
    if disturbed.len() > LISTED {
        named.push(format!("and {} more", disturbed.len() - LISTED));
    }
    if !disturbed.is_empty() {
        lines.push(format!(
            "wake-ups weigh in the times (at {WAKE_US} us each, {:.0}% of a round or more) or \
             the ranks shared a CPU (after {:.0}% of rounds or more) in: {}; these times \
             measure the machine's scheduling as much as the calls",
            100.0 * WEIGHS,
            100.0 * SHARED,
            named.join(", ")
        ));
    }
    lines
}

/// This thread's voluntary context switches so far; `None` where `/proc` does not say.
fn voluntary_switches() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// The machine's stolen CPU ticks and all its CPU ticks so far (`/proc/stat`'s `cpu` line);
/// `None` where it does not say.
fn stolen_ticks() -> Option<(u64, u64)> {
    parse_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// `(steal, total)` of a `/proc/stat` text: the `cpu` line's eighth field, and the sum of
/// its first eight (user to steal; guest time is already in user).
fn parse_stat(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    (ticks.len() == 8).then(|| (ticks[7], ticks.iter().sum()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(parks: Option<f64>, one_cpu: f64, round_us: f64) -> Placement {
        Placement {
            parks_per_round: parks,
            one_cpu,
            round_us,
        }
    }

    #[test]
    fn the_stat_line_gives_steal_and_total() {
        let stat = "cpu  530675 0 88542 8142967 6142 0 947 2916 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n";
        assert_eq!(
            parse_stat(stat),
            Some((2916, 530675 + 88542 + 8142967 + 6142 + 947 + 2916))
        );
        assert_eq!(parse_stat("cpu  1 2 3\n"), None, "too few fields");
        assert_eq!(parse_stat("intr 1 2\n"), None, "no cpu line");
    }

    #[test]
    fn the_summary_names_only_the_cases_where_wake_ups_weigh_or_ranks_shared_a_cpu() {
        let cases = [
            // 0.5 wake-ups of 3 us in 100 us: 1.5%.
            ("all_gather 8".to_string(), placement(Some(0.5), 0.0, 100.0)),
            // 2 wake-ups in 100 us: 6%.
            (
                "all_gather 1024".to_string(),
                placement(Some(2.0), 0.0, 100.0),
            ),
            // 15 wake-ups in a 200 ms round: nothing, but one CPU after a quarter of rounds.
            (
                "broadcast 16777216".to_string(),
                placement(Some(15.0), 0.25, 2e5),
            ),
            ("broadcast 8".to_string(), placement(Some(15.0), 0.0, 2e5)),
        ];
        let lines = summary(&cases, Some(0.004));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].contains("of 4 cases")
                && lines[0].contains("per round 0.50-15.00")
                && lines[0].contains("after 0-25% of rounds")
                && lines[0].contains("over the run 0.4%"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("all_gather 1024 (2.0 per 100.0 us round, one CPU 0%)")
                && lines[1]
                    .contains("broadcast 16777216 (15.0 per 200000.0 us round, one CPU 25%)")
                && !lines[1].contains("all_gather 8 ")
                && !lines[1].contains("broadcast 8 "),
            "{}",
            lines[1]
        );
        let many: Vec<(String, Placement)> = (0..9)
            .map(|k| (format!("case {k}"), placement(Some(2.0), 0.0, 100.0)))
            .collect();
        let lines = summary(&many, None);
        assert!(
            lines[1].contains("case 5 (")
                && !lines[1].contains("case 6")
                && lines[1].contains("and 3 more"),
            "{}",
            lines[1]
        );
        let calm = summary(&cases[..1], None);
        assert_eq!(calm.len(), 1, "nothing to name: {calm:?}");
        assert!(calm[0].contains("over the run unknown"), "{}", calm[0]);
        assert!(summary(&[], Some(0.0)).is_empty());
    }

    #[test]
    fn figures_unknown_to_proc_stay_out_of_the_row() {
        let mut row = Row::new("t", "1", "tpcomm", 1, 0, vec![5]).unwrap();
        placement(None, 0.5, 1.0).annotate(&mut row);
        assert_eq!(row.number("one_cpu_pct"), Some(50.0));
        assert!(row.number("parks_per_round").is_none());
        placement(Some(1.0 / 3.0), 0.0, 1.0).annotate(&mut row);
        assert_eq!(row.number("parks_per_round"), Some(0.333));
    }

    #[test]
    fn a_probe_agrees_on_the_same_placement_on_every_rank() {
        let placements =
            tpcomm::transport::LocalGroup::new(2).run(|comm| -> Result<Placement, BenchError> {
                let mut probe = Probe::start(3);
                for _ in 0..3 {
                    comm.barrier()?;
                    probe.round();
                }
                probe.finish(&comm, 7_000)
            });
        let placements: Vec<Placement> = placements
            .into_iter()
            .map(|p| p.unwrap().unwrap())
            .collect();
        let first = &placements[0];
        assert!(placements.iter().all(|p| p == first), "{placements:?}");
        assert!((0.0..=1.0).contains(&first.one_cpu) && first.round_us == 7.0);
        assert!(
            first.parks_per_round.is_some_and(|p| p >= 0.0),
            "/proc reads on Linux"
        );
    }
}
