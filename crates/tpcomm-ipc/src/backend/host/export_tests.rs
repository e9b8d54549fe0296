//! `export_all`'s walk up the table against one search per region.

use proptest::prelude::*;

use super::segment_table::{Exportable, SegmentTable};
use super::*;

/// A table of disjoint buffers: each `(gap, len)` starts `gap` bytes after the end of
/// the one before (from address 4096).
fn table(buffers: &[(usize, usize)]) -> SegmentTable {
    let mut table = SegmentTable::new();
    let mut at = 4096;
    for (i, &(gap, len)) in buffers.iter().enumerate() {
        at += gap;
        let fd = i32::try_from(i % 3).unwrap();
        let buffer = Exportable {
            len,
            fd,
            dev: 1,
            inode: 100 + u64::from(fd.unsigned_abs()),
            segment_len: 1 << 30,
            offset: at % (1 << 20),
        };
        table.insert(at, buffer);
        at += len;
    }
    table
}

proptest! {
    #[test]
    fn exporting_many_regions_gives_each_regions_own_export(
        buffers in proptest::collection::vec((0usize..64, 1usize..200), 0..40),
        regions in proptest::collection::vec((0u64..12_000, 0usize..260), 0..60),
    ) {
        let table = table(&buffers);
        let regions: Vec<Region> = regions
            .into_iter()
            .map(|(addr, len)| Region { addr, len })
            .collect();
        // Every region's handle, or the first failure in the regions' order (as text:
        // the errors are not comparable).
        let one_by_one: Result<Vec<HostHandle>> = regions
            .iter()
            .map(|r| export_from(&table, 7, r.addr, r.len))
            .collect();
        let expected = format!("{one_by_one:?}");
        let got = format!("{:?}", export_many(&table, 7, &regions));
        prop_assert_eq!(got, expected);
    }
}

proptest! {
    #[test]
    fn exporting_regions_inside_buffers_gives_each_regions_own_handle(
        buffers in proptest::collection::vec((0usize..64, 1usize..200), 1..40),
        picks in proptest::collection::vec(
            (any::<usize>(), prop_oneof![Just(0usize), 0usize..200], any::<usize>()),
            0..60,
        ),
    ) {
        let table = table(&buffers);
        let bases: Vec<(usize, usize)> =
            table.by_addr.iter().map(|(&base, b)| (base, b.len)).collect();
        // Every region inside one buffer (often at its base), in any order.
        let regions: Vec<Region> = picks
            .iter()
            .map(|&(which, offset, len)| {
                let (base, buffer_len) = bases[which % bases.len()];
                let offset = offset % buffer_len;
                Region {
                    addr: (base + offset) as u64,
                    len: 1 + len % (buffer_len - offset),
                }
            })
            .collect();
        let one_by_one: Vec<HostHandle> = regions
            .iter()
            .map(|r| export_from(&table, 7, r.addr, r.len).unwrap())
            .collect();
        prop_assert_eq!(export_many(&table, 7, &regions).unwrap(), one_by_one);
    }
}

#[test]
fn regions_far_apart_and_out_of_order_are_found_by_a_search() {
    // 100 buffers of 64 bytes, back to back; regions every 20th buffer, backwards.
    let table = table(&[(0, 64); 100]);
    let regions: Vec<Region> = (0..100)
        .rev()
        .step_by(20)
        .map(|i| Region {
            addr: 4096 + 64 * i + 8,
            len: 16,
        })
        .collect();
    let handles = export_many(&table, 7, &regions).unwrap();
    for (r, h) in regions.iter().zip(&handles) {
        assert_eq!(*h, export_from(&table, 7, r.addr, r.len).unwrap());
    }
    assert_eq!(handles.len(), 5);
}
