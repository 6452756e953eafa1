//! The free set alone: exact bins, their bitmaps, the ordered set above
//! them, against a plain ordered model.

use std::collections::BTreeSet;

use super::super::arena::{Blocks, Info, Kind, State, Tag, ANY, MIN_BLOCK};
use super::super::class::FastMap;
use super::super::freeset::{FreeSet, BIN_MAX};
use crate::driver::DevicePtr;

const MIB: usize = 1 << 20;

/// A free set and the block entries its bins thread through, by address.
#[derive(Default)]
struct Set {
    free: FreeSet,
    blocks: Blocks,
}

impl Set {
    fn put(&mut self, kind: Kind, tag: Tag, size: usize, at: DevicePtr) {
        // A block on its own: a segment's one block.
        let s = self
            .blocks
            .add_segment(Info::new(at, size, 0, 0, State::Free(tag), kind));
        self.free.insert(&mut self.blocks, kind, tag, size, s);
    }

    fn take(&mut self, kind: Kind, tag: Tag, size: usize, at: DevicePtr) {
        let s = self.blocks.slot(at).expect("a block put");
        self.free.remove(&mut self.blocks, kind, tag, size, s);
        self.blocks.remove(s);
    }

    fn fit(&self, kind: Kind, tag: Tag, size: usize) -> Option<(usize, DevicePtr)> {
        let (have, s) = self.free.fit(kind, tag, size)?;
        Some((have, self.blocks[s].at))
    }

    fn tagged(&self) -> Vec<(Kind, Tag, usize, DevicePtr)> {
        let t = self.free.tagged(&self.blocks);
        t.into_iter()
            .map(|(k, t, n, s)| (k, t, n, self.blocks[s].at))
            .collect()
    }
}

#[test]
fn the_fit_is_the_smallest_block_that_fits_in_the_bins_and_above_them() {
    let mut s = Set::default();
    let k = Kind::Large;
    for (size, at) in [
        (2 * MIB, 0x1000_0000),
        (40 * MIB, 0x2000_0000),
        (3 * MIB, 0x3000_0000),
    ] {
        s.put(k, ANY, size, at);
    }
    assert_eq!(s.fit(k, ANY, MIB + 512), Some((2 * MIB, 0x1000_0000)));
    assert_eq!(s.fit(k, ANY, 2 * MIB + 512), Some((3 * MIB, 0x3000_0000)));
    // Past every bin that holds a block: the ordered set above them.
    assert_eq!(s.fit(k, ANY, 5 * MIB), Some((40 * MIB, 0x2000_0000)));
    assert_eq!(s.fit(k, ANY, BIN_MAX + 512), Some((40 * MIB, 0x2000_0000)));
    assert_eq!(s.fit(k, ANY, 41 * MIB), None);
    // Another kind or tag sees none of them.
    assert_eq!(s.fit(Kind::Small, ANY, 512), None);
    assert_eq!(s.fit(k, 0x5000, 512), None);
    assert_eq!(s.free.bytes, 45 * MIB);
    assert_eq!(s.free.any_bytes, 45 * MIB);
}

#[test]
fn one_bin_gives_the_block_freed_last_first_and_any_block_leaves_it() {
    let mut s = Set::default();
    let k = Kind::Small;
    for at in [0x1000, 0x2000, 0x3000, 0x4000] {
        s.put(k, 0x5000, 4096, at);
    }
    assert_eq!(s.fit(k, 0x5000, 4096), Some((4096, 0x4000)));
    // From the middle, the end and the head of the list.
    s.take(k, 0x5000, 4096, 0x2000);
    s.take(k, 0x5000, 4096, 0x1000);
    assert_eq!(s.fit(k, 0x5000, 4096), Some((4096, 0x4000)));
    s.take(k, 0x5000, 4096, 0x4000);
    assert_eq!(s.fit(k, 0x5000, 1024), Some((4096, 0x3000)));
    s.take(k, 0x5000, 4096, 0x3000);
    assert_eq!(s.fit(k, 0x5000, 512), None);
    assert_eq!(s.free.bytes, 0);
}

#[test]
fn the_bitmap_finds_bins_across_its_words_and_summary_words() {
    let mut s = Set::default();
    let k = Kind::Large;
    // Bins 0, 63, 64, 4095, 4096 and the last.
    let sizes = [512, 64 * 512, 65 * 512, 4096 * 512, 4097 * 512, BIN_MAX];
    for (i, &size) in sizes.iter().enumerate() {
        s.put(k, ANY, size, (i as u64 + 1) << 32);
    }
    for (i, &size) in sizes.iter().enumerate() {
        assert_eq!(s.fit(k, ANY, size), Some((size, (i as u64 + 1) << 32)));
        // One bin above the one before: this block again.
        if i > 0 {
            let above = sizes[i - 1] + 512;
            assert_eq!(s.fit(k, ANY, above), Some((size, (i as u64 + 1) << 32)));
        }
    }
    assert_eq!(s.fit(k, ANY, BIN_MAX + 512), None);
}

#[test]
fn tagged_lists_every_streams_block_and_none_of_anyones() {
    let mut s = Set::default();
    s.put(Kind::Small, ANY, 512, 0x1000);
    s.put(Kind::Small, 0x5000, 512, 0x2000);
    s.put(Kind::Small, 0x5000, 512, 0x3000);
    s.put(Kind::Small, 0x6000, MIB, 0x4000);
    s.put(Kind::Large, 0x6000, 64 * MIB, 0x8000_0000);
    s.put(Kind::Large, ANY, 64 * MIB, 0x9000_0000);
    let mut got = s.tagged();
    got.sort_by_key(|b| b.3);
    let want = vec![
        (Kind::Small, 0x5000, 512, 0x2000),
        (Kind::Small, 0x5000, 512, 0x3000),
        (Kind::Small, 0x6000, MIB, 0x4000),
        (Kind::Large, 0x6000, 64 * MIB, 0x8000_0000),
    ];
    assert_eq!(got, want);
}

/// Streams come and go: the bitmaps of those with no free block left are
/// let go past the few kept, so that a program that makes a stream per
/// step does not grow the arena.
#[test]
fn bitmaps_of_streams_with_no_free_block_do_not_pile_up() {
    let mut s = Set::default();
    for stream in 1..=200usize {
        let tag = stream << 12;
        s.put(Kind::Small, tag, 4096, (stream as u64) << 20);
        assert_eq!(
            s.fit(Kind::Small, tag, 512),
            Some((4096, (stream as u64) << 20))
        );
        s.take(Kind::Small, tag, 4096, (stream as u64) << 20);
    }
    // A few bitmaps (8 KiB each) are kept, not 200.
    assert!(
        s.free.maps_held() <= 8,
        "{} bitmaps held",
        s.free.maps_held()
    );
    assert_eq!(s.free.bytes, 0);
}

/// Streams whose blocks come and go keep their bitmaps while the arena
/// holds a few: two streams beside memory without a stream, each with
/// small and large blocks (six bitmaps), build none again when their last
/// free block is taken and the next one freed (a bitmap is 8 KiB to clear).
#[test]
fn streams_whose_blocks_come_and_go_keep_their_bitmaps() {
    let mut s = Set::default();
    s.put(Kind::Small, ANY, 4096, 1 << 20);
    s.put(Kind::Large, ANY, 2 * MIB, 64 << 20);
    let streams = [1usize << 12, 2 << 12];
    for round in 0..50 {
        for (i, &tag) in streams.iter().enumerate() {
            let at = ((i as u64) + 2) << 30;
            s.put(Kind::Small, tag, 4096, at);
            s.put(Kind::Large, tag, 2 * MIB, at + (64 << 20));
        }
        assert_eq!(s.free.maps_held(), 6, "round {round}");
        for (i, &tag) in streams.iter().enumerate() {
            let at = ((i as u64) + 2) << 30;
            s.take(Kind::Small, tag, 4096, at);
            s.take(Kind::Large, tag, 2 * MIB, at + (64 << 20));
        }
        assert_eq!(
            s.free.maps_held(),
            6,
            "round {round}: a stream's bitmap went with its last free block"
        );
    }
    assert_eq!(s.free.bytes, 4096 + 2 * MIB);
}

/// Random inserts and removes of blocks on three tags and two kinds, over
/// sizes inside and above the bins, taken by a fit or from anywhere: every fit is the model's smallest
/// block of that kind and tag that fits (an equal-size block of the
/// model's, which one being the bin's order), and the byte counts agree.
#[test]
fn random_churn_agrees_with_an_ordered_model() {
    let mut s = Set::default();
    let mut model: BTreeSet<(Kind, Tag, usize, DevicePtr)> = BTreeSet::new();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut at: DevicePtr = 1 << 32;
    for _ in 0..30_000 {
        let r = next();
        let tag = [ANY, 0x1000, 0x2000][(r % 3) as usize];
        let kind = if r & 4 == 0 { Kind::Small } else { Kind::Large };
        // Log-uniform 512 B to 64 MiB, in granules.
        let size = (((1u64 << ((r >> 8) % 18)) * (1 + (r >> 16) % 512)) as usize)
            .clamp(MIN_BLOCK, 64 * MIB)
            / MIN_BLOCK
            * MIN_BLOCK;
        if r & 8 == 0 || model.is_empty() {
            s.put(kind, tag, size, at);
            model.insert((kind, tag, size, at));
            at += 64 << 20;
        } else if r & 16 == 0 {
            // Any block leaves (a merge takes a neighbour out).
            let b = *model
                .iter()
                .nth((r >> 32) as usize % model.len())
                .expect("in range");
            model.remove(&b);
            s.take(b.0, b.1, b.2, b.3);
        } else {
            let want = model
                .range((kind, tag, size, 0)..=(kind, tag, usize::MAX, DevicePtr::MAX))
                .next()
                .copied();
            let got = s.fit(kind, tag, size);
            assert_eq!(got.map(|g| g.0), want.map(|w| w.2), "the fit's size");
            if let Some((have, p)) = got {
                assert!(
                    model.remove(&(kind, tag, have, p)),
                    "the fit is a free block"
                );
                s.take(kind, tag, have, p);
            }
        }
        let bytes: usize = model.iter().map(|b| b.2).sum();
        assert_eq!(s.free.bytes, bytes);
    }
    let mut tagged = s.tagged();
    tagged.sort();
    let want: Vec<_> = model.iter().filter(|b| b.1 != ANY).copied().collect();
    assert_eq!(tagged, want);
}

/// The table the blocks live in finds an entry by the top bits of its
/// hash before it compares keys: neighbouring blocks must differ there,
/// or every lookup compares a whole group of keys.
#[test]
fn neighbouring_blocks_hash_apart() {
    use std::hash::BuildHasher;
    let build = FastMap::<DevicePtr, ()>::default().hasher().clone();
    let tops: std::collections::HashSet<u64> = (0..128u64)
        .map(|i| build.hash_one(0x7f00_0000_0000u64 + i * 512) >> 57)
        .collect();
    assert!(tops.len() >= 64, "{} distinct top bits of 128", tops.len());
}

/// A small and a large bin of one stream and size (1-32 MiB) are two
/// entries: each gives its own block.
#[test]
fn a_small_and_a_large_bin_of_one_size_stay_apart() {
    let mut s = Set::default();
    s.put(Kind::Small, 0x5000, 2 * MIB, 0x1000_0000);
    s.put(Kind::Large, 0x5000, 2 * MIB, 0x2000_0000);
    assert_eq!(
        s.fit(Kind::Small, 0x5000, MIB),
        Some((2 * MIB, 0x1000_0000))
    );
    assert_eq!(
        s.fit(Kind::Large, 0x5000, MIB),
        Some((2 * MIB, 0x2000_0000))
    );
    s.take(Kind::Small, 0x5000, 2 * MIB, 0x1000_0000);
    assert_eq!(s.fit(Kind::Small, 0x5000, MIB), None);
    assert_eq!(
        s.fit(Kind::Large, 0x5000, MIB),
        Some((2 * MIB, 0x2000_0000))
    );
}
