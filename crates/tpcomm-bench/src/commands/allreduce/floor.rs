//! The data-movement floors of `allreduce` (`floor copy+sum`, `floor sum`): what any eager
//! all-reduce of unregistered buffers, and any replay, must move on each rank at least,
//! with no synchronisation, in page-aligned windows standing for the staging buffers.

use crate::data::elements::input;

/// The floors' buffers on one rank: one page-aligned window per rank (this rank's staging
/// buffer first, then one per peer), carved from one vector.
pub(super) struct Floor {
    buf: Vec<f32>,
    /// Elements before the first window (its page alignment).
    start: usize,
    /// Elements from one window to the next (a whole number of pages).
    stride: usize,
    count: usize,
    ranks: usize,
}

impl Floor {
    pub(super) const PAGE: usize = 4096;

    pub(super) fn new(count: usize, ranks: usize) -> Self {
        let page = Self::PAGE / 4;
        let stride = count.next_multiple_of(page);
        let buf = vec![0f32; stride * ranks + page];
        let misaligned = (buf.as_ptr() as usize % Self::PAGE) / 4;
        let start = (page - misaligned) % page;
        Self {
            buf,
            start,
            stride,
            count,
            ranks,
        }
    }

    /// The staging window and the peers' windows.
    pub(super) fn windows(&mut self) -> (&mut [f32], Vec<&[f32]>) {
        let (count, stride) = (self.count, self.stride);
        let all = &mut self.buf[self.start..self.start + stride * self.ranks];
        let (own, peers) = all.split_at_mut(stride);
        let peers = peers.chunks(stride).map(|w| &w[..count]).collect();
        (&mut own[..count], peers)
    }

    /// This rank's input in its staging window and the peers' inputs in theirs, as the
    /// all-reduce's staging buffers would hold them.
    pub(super) fn fill(&mut self, rank: usize, salt: u64) {
        let (count, stride, start) = (self.count, self.stride, self.start);
        for r in 0..self.ranks {
            let window = (r + self.ranks - rank) % self.ranks;
            let at = start + window * stride;
            self.buf[at..at + count].copy_from_slice(&input::<f32>(r, count, salt));
        }
    }

    /// `copy`: the parts of the input that peers read (all but the first n-th) into the
    /// staging window first, and the first n-th read from `input` itself, as an eager
    /// two-stage call does; then the sum of every window into `out`.
    pub(super) fn run(&mut self, copy: bool, input: &[f32], out: &mut [f32]) {
        let private = if copy { self.count / self.ranks } else { 0 };
        let (own, peers) = self.windows();
        if copy {
            own[private..].copy_from_slice(&input[private..]);
        }
        let (head, tail) = out.split_at_mut(private);
        let peer_head = peers.iter().map(|p| &p[..private]);
        Self::sum(head, &input[..private], peer_head);
        Self::sum(tail, &own[private..], peers.iter().map(|p| &p[private..]));
    }

    /// `out = own + every peer`.
    fn sum<'a>(out: &mut [f32], own: &[f32], mut peers: impl Iterator<Item = &'a [f32]>) {
        match peers.next() {
            Some(first) => out
                .iter_mut()
                .zip(own.iter().zip(first))
                .for_each(|(o, (a, b))| *o = a + b),
            None => out.copy_from_slice(own),
        }
        for peer in peers {
            out.iter_mut().zip(peer).for_each(|(o, b)| *o += b);
        }
    }
}
