//! The free blocks of one arena, by kind and tag ([`FreeSet`]). Blocks of
//! at most [`BIN_MAX`] bytes sit in *exact bins*, one per kind, tag and
//! size: a list threaded through the blocks' own [`Info`] (newest first,
//! as CuPy's pool takes them), with a two-level bitmap per kind and tag of
//! the bins that hold a block: the best fit is the first set bit at or
//! above the request's bin. Larger blocks, few, stay in a sorted list.

use super::arena::{Blocks, Kind, Slot, Tag, ANY, MIN_BLOCK};
use super::class::FastMap;
use crate::driver::DevicePtr;

/// The largest block in an exact bin: larger ones are few (a request of
/// 10 MiB or more has a segment of its own).
pub(super) const BIN_MAX: usize = 32 << 20;

/// Bins per kind and tag (one per multiple of [`MIN_BLOCK`] up to
/// [`BIN_MAX`]), and the words of their bitmap's two levels.
const BINS: usize = BIN_MAX / MIN_BLOCK;
pub(super) const WORDS: usize = BINS / 64;
const SUMMARY: usize = WORDS.div_ceil(64);

/// Bitmaps of kinds and tags that emptied are kept, up to this many in all
/// per arena, so that a stream whose blocks come and go does not build one
/// each time; beyond it an empty one goes (a stream destroyed leaves none).
const MAPS_KEPT: usize = 8;

/// The bin of `size` bytes (a multiple of [`MIN_BLOCK`], at most [`BIN_MAX`]).
#[inline]
fn bin(size: usize) -> usize {
    size / MIN_BLOCK - 1
}

/// Which exact bins of one kind and tag hold a block.
pub(super) struct BinMap {
    pub(super) kind: Kind,
    pub(super) tag: Tag,
    /// Bit `w` of word `w / 64`: word `w` of `words` is not zero.
    pub(super) summary: [u64; SUMMARY],
    pub(super) words: Box<[u64; WORDS]>,
}

impl BinMap {
    fn new(kind: Kind, tag: Tag) -> BinMap {
        BinMap {
            kind,
            tag,
            summary: [0; SUMMARY],
            words: Box::new([0; WORDS]),
        }
    }

    #[inline]
    fn set(&mut self, b: usize) {
        self.words[b / 64] |= 1 << (b % 64);
        self.summary[b / 4096] |= 1 << (b / 64 % 64);
    }

    #[inline]
    fn clear(&mut self, b: usize) {
        let w = b / 64;
        self.words[w] &= !(1 << (b % 64));
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }

    /// Whether no bin holds a block.
    #[inline]
    fn is_empty(&self) -> bool {
        self.summary.iter().all(|&w| w == 0)
    }

    /// The first bin at or above `b` that holds a block.
    #[inline]
    fn next(&self, b: usize) -> Option<usize> {
        let w = b / 64;
        let here = self.words[w] & (!0u64 << (b % 64));
        if here != 0 {
            return Some(w * 64 + here.trailing_zeros() as usize);
        }
        // Words above `w`, through the summary.
        let from = w + 1;
        let mut s = from / 64;
        let mut mask = !0u64 << (from % 64);
        while s < SUMMARY {
            let m = self.summary[s] & mask;
            if m != 0 {
                let w = s * 64 + m.trailing_zeros() as usize;
                return Some(w * 64 + self.words[w].trailing_zeros() as usize);
            }
            (s, mask) = (s + 1, !0);
        }
        None
    }
}

/// The free blocks of one arena (see the module documentation).
#[derive(Default)]
pub(super) struct FreeSet {
    /// The first block of each exact bin, by tag and size (with the kind
    /// in its top bit, which the table's hash keeps: no size reaches it).
    pub(super) heads: FastMap<(Tag, usize), Slot>,
    pub(super) maps: Vec<BinMap>,
    /// Blocks over [`BIN_MAX`] by (kind, tag, size, address), with slots,
    /// sorted (a short list): a binary search finds the best fit in a few
    /// compares (an ordered tree's range took a fifth of a CuPy pair).
    pub(super) big: Vec<(Kind, Tag, usize, DevicePtr, Slot)>,
    /// Bytes of free blocks, all tags; and of those free for anyone.
    pub(super) bytes: usize,
    pub(super) any_bytes: usize,
}

#[inline]
pub(super) fn key(kind: Kind, tag: Tag, size: usize) -> (Tag, usize) {
    (tag, size | (kind as usize) << (usize::BITS - 1))
}

impl FreeSet {
    /// Where the bitmap of `kind` and `tag` is in `maps` (they are few).
    #[inline]
    fn map(&self, kind: Kind, tag: Tag) -> Option<usize> {
        self.maps
            .iter()
            .position(|m| m.tag == tag && m.kind == kind)
    }

    /// The free block in slot `at` of `blocks`, of `size` bytes and
    /// `kind`, free on `tag`, joins the set.
    pub(super) fn insert(
        &mut self,
        blocks: &mut Blocks,
        kind: Kind,
        tag: Tag,
        size: usize,
        at: Slot,
    ) {
        self.bytes += size;
        if tag == ANY {
            self.any_bytes += size;
        }
        if size > BIN_MAX {
            let k = (kind, tag, size, blocks[at].at, at);
            let i = self.big.partition_point(|e| *e < k);
            self.big.insert(i, k);
            return;
        }
        let old = self.heads.insert(key(kind, tag, size), at);
        let i = &mut blocks[at];
        (i.bin_prev, i.bin_next) = (0, old.unwrap_or(0));
        if let Some(old) = old {
            blocks[old].bin_prev = at;
            return;
        }
        // The bin was empty: its bit goes up.
        let m = match self.map(kind, tag) {
            Some(m) => m,
            None => {
                self.maps.push(BinMap::new(kind, tag));
                self.maps.len() - 1
            }
        };
        self.maps[m].set(bin(size));
    }

    /// The free block in slot `at` (as inserted) leaves the set; its
    /// entry in `blocks` still holds its links.
    pub(super) fn remove(
        &mut self,
        blocks: &mut Blocks,
        kind: Kind,
        tag: Tag,
        size: usize,
        at: Slot,
    ) {
        self.bytes -= size;
        if tag == ANY {
            self.any_bytes -= size;
        }
        if size > BIN_MAX {
            let was = self
                .big
                .binary_search(&(kind, tag, size, blocks[at].at, at));
            debug_assert!(was.is_ok(), "a free block is in the free set");
            if let Ok(i) = was {
                self.big.remove(i);
            }
            return;
        }
        let (bin_prev, bin_next) = (blocks[at].bin_prev, blocks[at].bin_next);
        if bin_next != 0 {
            blocks[bin_next].bin_prev = bin_prev;
        }
        if bin_prev != 0 {
            blocks[bin_prev].bin_next = bin_next;
        } else if bin_next != 0 {
            self.heads.insert(key(kind, tag, size), bin_next);
        } else {
            let was = self.heads.remove(&key(kind, tag, size));
            debug_assert_eq!(was, Some(at), "a free block heads its bin");
            self.emptied(kind, tag, bin(size));
        }
    }

    /// Bin `b` of `kind` and `tag` emptied: its bit goes down, and an empty
    /// bitmap of a stream goes past the few kept ([`MAPS_KEPT`]).
    fn emptied(&mut self, kind: Kind, tag: Tag, b: usize) {
        let i = self.map(kind, tag).expect("a bin map for a free block");
        self.maps[i].clear(b);
        if tag != ANY && self.maps.len() > MAPS_KEPT && self.maps[i].is_empty() {
            self.maps.swap_remove(i);
        }
    }

    /// The best fit of `kind` on `tag` for `size` bytes: its size and slot.
    #[inline]
    pub(super) fn fit(&self, kind: Kind, tag: Tag, size: usize) -> Option<(usize, Slot)> {
        if size <= BIN_MAX {
            if let Some(b) = self
                .map(kind, tag)
                .and_then(|m| self.maps[m].next(bin(size)))
            {
                let have = (b + 1) * MIN_BLOCK;
                return Some((have, self.heads[&key(kind, tag, have)]));
            }
        }
        // The first key at or past the request, if of this kind and tag.
        let i = self.big.partition_point(|e| *e < (kind, tag, size, 0, 0));
        self.big
            .get(i)
            .filter(|k| k.0 == kind && k.1 == tag)
            .map(|&(_, _, s, _, at)| (s, at))
    }

    /// Every free block on a stream (not [`ANY`]): (kind, tag, size, slot).
    pub(super) fn tagged(&self, blocks: &Blocks) -> Vec<(Kind, Tag, usize, Slot)> {
        let big = self.big.iter().filter(|k| k.1 != ANY);
        let mut out: Vec<_> = big.map(|&(k, t, s, _, at)| (k, t, s, at)).collect();
        for m in self.maps.iter().filter(|m| m.tag != ANY) {
            let mut b = m.next(0);
            while let Some(n) = b {
                let size = (n + 1) * MIN_BLOCK;
                let mut at = self.heads[&key(m.kind, m.tag, size)];
                while at != 0 {
                    out.push((m.kind, m.tag, size, at));
                    at = blocks[at].bin_next;
                }
                b = if n + 1 < BINS { m.next(n + 1) } else { None };
            }
        }
        out
    }
}
