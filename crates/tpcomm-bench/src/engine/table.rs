//! nccl-tests-style tables on stdout, and progress on stderr.
//!
//! A table is a list of [`Column`]s declared as data: a name, a unit, a width and the
//! function that formats a [`Row`]'s cell (given the row and the row of its peer, for
//! columns that show the peer side by side). Header lines start with `#`, so that a table
//! pasted into a file stays a comment block around its numbers, as nccl-tests prints them.

use std::cell::{Cell as StdCell, RefCell};
use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

use crate::engine::row::Row;

/// Formats one cell: the row, and the row of its peer when the table shows both.
pub(crate) type Cell = fn(&Row, Option<&Row>) -> String;

/// One column of a printed table: right-aligned to `width` characters, with a name line and
/// a unit line above it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Column {
    pub(crate) name: &'static str,
    pub(crate) unit: &'static str,
    pub(crate) width: usize,
    content: Content,
}

/// What a column's cells show.
#[derive(Debug, Clone, Copy)]
enum Content {
    /// What a function makes of the row and the row of its peer.
    Cell(Cell),
    /// The row's `info` fact of this key, as text (`-` when absent).
    Fact(&'static str),
}

impl Column {
    /// A column whose cells `cell` formats.
    pub(crate) const fn new(
        name: &'static str,
        unit: &'static str,
        width: usize,
        cell: Cell,
    ) -> Self {
        Self {
            name,
            unit,
            width,
            content: Content::Cell(cell),
        }
    }

    /// A column of the rows' `info` fact `key`, as text (`-` when absent).
    pub(crate) const fn fact(
        name: &'static str,
        unit: &'static str,
        width: usize,
        key: &'static str,
    ) -> Self {
        Self {
            name,
            unit,
            width,
            content: Content::Fact(key),
        }
    }

    /// The cell of `row`, next to `peer`, the row of its peer.
    fn cell(&self, row: &Row, peer: Option<&Row>) -> String {
        match self.content {
            Content::Cell(cell) => cell(row, peer),
            Content::Fact(key) => row.text(key),
        }
    }
}

/// The columns most tables share.
pub(crate) mod col {
    use super::Column;

    /// `x` with 3 decimals, `-` when absent.
    pub(crate) fn f3(x: Option<f64>) -> String {
        x.map_or_else(|| "-".into(), |x| format!("{x:.3}"))
    }

    /// A ratio: `1.03x`, `-` when absent.
    pub(crate) fn ratio(x: Option<f64>) -> String {
        x.map_or_else(|| "-".into(), |x| format!("{x:.2}x"))
    }

    pub(crate) const fn size(width: usize) -> Column {
        Column::new("size", "(B)", width, |r, _| r.bytes.to_string())
    }
    pub(crate) const fn iters() -> Column {
        Column::new("iters", "", 6, |r, _| r.iters.to_string())
    }
    /// The median, `D` decimals.
    pub(crate) const fn time<const D: usize>(name: &'static str, width: usize) -> Column {
        Column::new(name, "(us)", width, |r, _| {
            format!("{:.*}", D, r.stats.median_us)
        })
    }
    /// The fastest iteration, `D` decimals.
    pub(crate) const fn min<const D: usize>(width: usize) -> Column {
        Column::new("min", "(us)", width, |r, _| {
            format!("{:.*}", D, r.stats.min_us)
        })
    }
    pub(crate) const fn algbw(width: usize) -> Column {
        Column::new("algbw", "(GB/s)", width, |r, _| f3(r.algbw_gbps))
    }
    pub(crate) const fn busbw(width: usize) -> Column {
        Column::new("busbw", "(GB/s)", width, |r, _| f3(r.busbw_gbps))
    }
    pub(crate) const fn variant(name: &'static str, width: usize) -> Column {
        Column::new(name, "", width, |r, _| r.variant.clone())
    }
    pub(crate) const fn vs_peer(name: &'static str, unit: &'static str, width: usize) -> Column {
        Column::new(name, unit, width, |r, _| ratio(r.vs_peer))
    }
}

/// Joins `cells` right-aligned to the widths of `columns`, space-separated; with `comment`
/// the line starts with `#`, taken from the first column's width.
pub(crate) fn line(columns: &[Column], cells: &[String], comment: bool) -> String {
    let mut out = String::new();
    for (i, (col, cell)) in columns.iter().zip(cells).enumerate() {
        let width = col.width;
        match i {
            0 if comment => out.push_str(&format!("#{cell:>w$}", w = width.saturating_sub(1))),
            0 => out.push_str(&format!("{cell:>width$}")),
            _ => out.push_str(&format!(" {cell:>width$}")),
        }
    }
    out
}

/// The title and the two header lines (names, units) of a table.
pub(crate) fn header(title: &str, columns: &[Column]) -> [String; 4] {
    let names: Vec<String> = columns.iter().map(|c| c.name.to_string()).collect();
    let units: Vec<String> = columns.iter().map(|c| c.unit.to_string()).collect();
    [
        "#".into(),
        format!("# {title}"),
        line(columns, &names, true),
        line(columns, &units, true),
    ]
}

/// One row's line.
pub(crate) fn row_line(columns: &[Column], row: &Row, peer: Option<&Row>) -> String {
    let cells: Vec<String> = columns.iter().map(|c| c.cell(row, peer)).collect();
    line(columns, &cells, false)
}

/// Prints `rows`, each next to its peer (the row of its table and case that its `peer`
/// names), looked up among `all`.
pub(crate) fn print_rows<'r>(
    columns: &[Column],
    rows: impl IntoIterator<Item = &'r Row>,
    all: &[Row],
) {
    let peer = |r: &Row| {
        let p = r.peer.as_deref()?;
        all.iter()
            .find(|x| x.table == r.table && x.case == r.case && x.variant == p)
    };
    let lines: Vec<String> = rows
        .into_iter()
        .map(|r| row_line(columns, r, peer(r)))
        .collect();
    print(&lines);
}

/// Prints lines on stdout at once (a closed stdout, `| head`, does not stop the run).
pub(crate) fn print(lines: &[String]) {
    let mut out = std::io::stdout().lock();
    for l in lines {
        let _ = writeln!(out, "{l}");
    }
    let _ = out.flush();
}

/// Progress on stderr, only when it is a terminal and only on rank 0: the case being
/// measured, cases done / total, elapsed time and an estimate of the time left. Redrawn at
/// most every [`Progress::EVERY`], between iterations (never inside a timed region).
#[derive(Debug)]
pub(crate) struct Progress {
    on: bool,
    start: Instant,
    total: StdCell<usize>,
    done: StdCell<usize>,
    case: RefCell<String>,
    last: StdCell<Option<Instant>>,
    /// Whether a progress line is on the terminal now.
    shown: StdCell<bool>,
}

impl Progress {
    const EVERY: Duration = Duration::from_millis(200);

    /// Progress for `rank`: on for rank 0 when stderr is a terminal.
    pub(crate) fn new(rank: usize) -> Self {
        let on = rank == 0 && std::io::stderr().is_terminal();
        Self { on, ..Self::off() }
    }

    /// No progress at all.
    pub(crate) fn off() -> Self {
        Self {
            on: false,
            start: Instant::now(),
            total: StdCell::new(0),
            done: StdCell::new(0),
            case: RefCell::new(String::new()),
            last: StdCell::new(None),
            shown: StdCell::new(false),
        }
    }

    /// Announces how many cases the run will measure.
    pub(crate) fn plan(&self, total: usize) {
        self.total.set(total);
    }

    /// A new case starts (the previous one, if any, is done); the same label again changes
    /// nothing (verification and timing of one case both announce it).
    pub(crate) fn case(&self, label: String) {
        if *self.case.borrow() == label {
            return;
        }
        if !self.case.borrow().is_empty() {
            self.done.set(self.done.get() + 1);
        }
        *self.case.borrow_mut() = label;
        self.last.set(None);
        self.tick(0, 0);
    }

    /// Iteration `i` of `n` of the current case is done.
    pub(crate) fn tick(&self, i: usize, n: usize) {
        if !self.on || self.last.get().is_some_and(|t| t.elapsed() < Self::EVERY) {
            return;
        }
        self.last.set(Some(Instant::now()));
        let elapsed = self.start.elapsed().as_secs_f64();
        let (done, total) = (self.done.get(), self.total.get());
        let line = status(done, total, &self.case.borrow(), (i, n), elapsed);
        eprint!("\r\x1b[K{line}");
        self.shown.set(true);
    }

    /// Clears the progress line.
    pub(crate) fn finish(&self) {
        if self.shown.replace(false) {
            eprint!("\r\x1b[K");
        }
    }
}

/// The progress line: cases done / total, the current case and its iteration, the time
/// elapsed and, once a case is done, an estimate of the time left.
fn status(done: usize, total: usize, case: &str, (i, n): (usize, usize), elapsed: f64) -> String {
    let total = total.max(done + 1);
    let mut line = format!("[{done}/{total}] {case}");
    if n > 0 {
        line.push_str(&format!(" iter {i}/{n}"));
    }
    line.push_str(&format!(", {elapsed:.1} s"));
    if done > 0 {
        let left = elapsed / done as f64 * (total - done) as f64;
        line.push_str(&format!(", ~{left:.0} s left"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_shows_cases_done_the_case_elapsed_and_time_left() {
        assert_eq!(
            status(0, 4, "f32 1 KiB", (0, 0), 0.04),
            "[0/4] f32 1 KiB, 0.0 s"
        );
        assert_eq!(
            status(2, 4, "f32 4 KiB", (30, 200), 10.0),
            "[2/4] f32 4 KiB iter 30/200, 10.0 s, ~10 s left"
        );
        // More cases than planned: the total follows.
        assert_eq!(status(5, 4, "x", (0, 0), 5.0), "[5/6] x, 5.0 s, ~1 s left");
        // Piped (not a terminal) or not rank 0: nothing is drawn, nothing to clear.
        let counted = Progress::off();
        counted.case("a".into());
        counted.case("a".into());
        counted.case("b".into());
        assert_eq!(counted.done.get(), 1, "a announced twice is one case");
        let off = Progress::new(1);
        off.case("x".into());
        off.tick(1, 2);
        assert!(!off.shown.get());
    }

    #[test]
    fn header_lines_start_with_a_hash_inside_the_first_column() {
        let columns = [col::size(6), col::time::<3>("t", 5)];
        let h = header("x", &columns);
        assert_eq!(h[2], "# size     t");
        let row = Row::new("t", "c", "v", 64, 0, vec![1500]).unwrap();
        assert_eq!(row_line(&columns, &row, None), "    64 1.500");
    }
}
