//! The stack a deep value needs, and a decode run again on a fresh segment when the thread's
//! runs short.
//!
//! postcard decodes (and encodes) a nested value by recursion, and the stack a level takes
//! depends on the type and the build: about 1.2 KiB in a debug build for a small recursive
//! enum, 10 KiB for a struct of 2 KiB of fields, so that the 512 levels `Options::max_depth`
//! allows may take more than a 2 MiB thread stack. Every [`STACK_LOOK_EVERY`]th level looks
//! at the stack left ([`look`], from `Budget::stack_short`); where less than [`RED_ZONE`]
//! is, the decode fails there, and its caller runs it again from the first byte ([`again`]),
//! inside `stacker::grow`, on a fresh segment sized from the stack the levels down to the
//! look took ([`segments`]). The look is out of line and not generic, and a container's
//! decoding is called in one place only: it inlines into its parent's loop as though no look
//! were there, and a value the thread's stack holds (every one a program usually sends) is
//! decoded once, on it. (The encoder looks at the same levels and stops there instead:
//! `encode_bound.rs`.)

/// Levels between two looks at the stack.
pub(crate) const STACK_LOOK_EVERY: usize = 8;

/// Stack that must be left at a look: room for the [`STACK_LOOK_EVERY`] levels to the next
/// one, of up to [`LEVEL_MOST`] each.
pub(crate) const RED_ZONE: usize = 256 << 10;

/// The most stack a level may take for the looks to keep a thread safe (a debug build's
/// decode of a struct of 2 KiB of fields takes about 10 KiB a level).
const LEVEL_MOST: usize = RED_ZONE / STACK_LOOK_EVERY;

/// Where a decode ran short of stack: the level of the look that found less than
/// [`RED_ZONE`] left, and the stack the decode had taken down to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shortage {
    pub(crate) level: usize,
    pub(crate) used: usize,
}

/// Where the stack is now: the address of a local (the stack grows down on every platform
/// `stacker` grows it on).
#[inline(always)]
pub(crate) fn here() -> usize {
    let local = 0u8;
    std::hint::black_box(&local) as *const u8 as usize
}

/// The look at a level where the stack is looked at, for a decode whose stack started at
/// `start` ([`here`]): the [`Shortage`] when less than [`RED_ZONE`] is left (never where
/// `stacker` cannot tell what is left).
pub(crate) fn look(level: usize, start: usize) -> Option<Shortage> {
    let left = stacker::remaining_stack()?;
    (left < RED_ZONE).then(|| Shortage {
        level,
        used: start.saturating_sub(here()),
    })
}

/// Runs `attempt`, one whole decode from its first byte, again on the fresh segments of
/// [`segments`] for a decode that ran short at `first`, each once, until one holds it:
/// `None` then (`attempt` keeps what it decoded), the last [`Shortage`] when none does.
///
/// `attempt` must start from scratch at each call (a fresh budget and shape recorder, the
/// bytes from their first) and report a shortage whatever its outcome: a `Deserialize` that
/// swallows the error of a look and goes on is not trusted with the value. Not generic: one
/// copy, out of line, serves the decode of every type.
#[cold]
#[inline(never)]
pub(crate) fn again(
    max_depth: usize,
    first: Shortage,
    attempt: &mut dyn FnMut() -> Option<Shortage>,
) -> Option<Shortage> {
    let mut short = first;
    for segment in segments(max_depth, first) {
        tracing::debug!(
            level = short.level,
            used = short.used,
            segment,
            "a deep value runs the stack short: decoding it again on a fresh segment"
        );
        match stacker::grow(segment, &mut *attempt) {
            None => return None,
            Some(again) => short = again,
        }
    }
    Some(short)
}

/// The segments a decode that ran short at `short` goes on, in turn: the stack its levels
/// took down to the look, per level, for every level `max_depth` allows, a quarter more and
/// [`RED_ZONE`]; twice that; and the most any level the looks keep safe takes
/// ([`LEVEL_MOST`] for every level, and [`RED_ZONE`]), for the frames of a type that grow
/// with the depth. None is larger than the last.
fn segments(max_depth: usize, short: Shortage) -> impl Iterator<Item = usize> {
    let most = max_depth
        .saturating_mul(LEVEL_MOST)
        .saturating_add(RED_ZONE);
    let all = short
        .used
        .div_ceil(short.level.max(1))
        .saturating_mul(max_depth);
    let measured = all
        .saturating_add(all / 4)
        .saturating_add(RED_ZONE)
        .min(most);
    let doubled = measured.saturating_mul(2).min(most);
    let mut sizes = vec![measured, doubled, most];
    sizes.dedup();
    sizes.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_go_from_the_measured_levels_to_the_most_the_looks_keep_safe() {
        // 8 levels took 8 KiB: 1 KiB a level, for 512 levels, a quarter more, the red zone.
        let short = Shortage {
            level: 8,
            used: 8 << 10,
        };
        let measured = (512 << 10) + (128 << 10) + RED_ZONE;
        let most = 512 * LEVEL_MOST + RED_ZONE;
        assert_eq!(
            segments(512, short).collect::<Vec<_>>(),
            [measured, 2 * measured, most]
        );
        // Levels larger than the looks keep safe: the most, once.
        let huge = Shortage {
            level: 8,
            used: 8 * 2 * LEVEL_MOST,
        };
        assert_eq!(segments(512, huge).collect::<Vec<_>>(), [most]);
    }

    #[test]
    fn a_decode_short_on_every_segment_gives_up_after_the_largest() {
        // Short at every attempt, each a level deeper: on each of the three segments, on
        // the largest with at least its size left.
        let most = 64 * LEVEL_MOST + RED_ZONE;
        let first = Shortage {
            level: 8,
            used: 8 << 10,
        };
        let mut left = Vec::new();
        let last = again(64, first, &mut || {
            left.push(stacker::remaining_stack().unwrap_or(0));
            Some(Shortage {
                level: 8 * (left.len() + 1),
                used: 8 << 10,
            })
        });
        assert_eq!(
            last.map(|s| s.level),
            Some(32),
            "the last attempt's shortage"
        );
        assert_eq!(left.len(), 3);
        assert!(left[2] >= most - (64 << 10), "{left:?}");
    }
}
