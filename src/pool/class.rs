//! Size classes ([`size_class`]); those up to 256 MiB have a dense index,
//! so an arena counts them in a vector.

use std::collections::HashMap;

pub(super) const MIN_CLASS: usize = 512;
pub(super) const LARGE: usize = 256 << 20;
/// Classes up to [`LARGE`]: 512, then four per power of two.
pub(super) const SMALL_CLASSES: usize =
    1 + 4 * (LARGE.trailing_zeros() - MIN_CLASS.trailing_zeros()) as usize;

/// The size class of a request: at least 512 bytes; up to 256 MiB, four
/// classes per power of two (waste under 25%); above, a multiple of 2 MiB.
pub fn size_class(size: usize) -> usize {
    if size <= MIN_CLASS {
        return MIN_CLASS;
    }
    if size > LARGE {
        return size.div_ceil(2 << 20) * (2 << 20);
    }
    let pow = usize::BITS - 1 - (size - 1).leading_zeros(); // 2^pow < size <= 2^(pow+1)
    let step = 1usize << (pow - 2);
    size.div_ceil(step) * step
}

/// The index of a class up to 256 MiB among the small classes.
pub(super) fn class_index(class: usize) -> Option<usize> {
    if class > LARGE {
        return None;
    }
    if class <= MIN_CLASS {
        return Some(0);
    }
    // class = k * 2^(pow-2) with 2^pow < class <= 2^(pow+1), k in 5..=8.
    let pow = (usize::BITS - 1 - (class - 1).leading_zeros()) as usize;
    let k = class >> (pow - 2);
    Some(1 + 4 * (pow - MIN_CLASS.trailing_zeros() as usize) + (k - 5))
}

/// Addresses are already well spread integers: hash them as they are
/// (SipHash costs more than the rest of an allocation).
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        // Classes and blocks are multiples of 512: drop the zero bits, and
        // multiply (Fibonacci hashing) so that the top bits, which the table
        // compares a group's slots by, differ between neighbouring blocks too;
        // the high half folded down keeps the low bits, its bucket, as spread.
        let m = (self.0 >> 9 ^ self.0 >> 40).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        m ^ m >> 32
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    // One integer is taken as it is; a tuple's (a stream and a class)
    // are mixed, so that streams of one class do not collide.
    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(26) ^ n;
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

pub(crate) type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdentityHasher>>;

/// The small class at `index` (the inverse of [`class_index`]).
pub(super) fn class_of_index(index: usize) -> usize {
    if index == 0 {
        return MIN_CLASS;
    }
    let pow = (index - 1) / 4 + MIN_CLASS.trailing_zeros() as usize;
    let k = (index - 1) % 4 + 5;
    k << (pow - 2)
}

/// Blocks handed out of one size class: now, and at most.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct ClassCount {
    pub(crate) live: usize,
    pub(crate) peak: usize,
}

/// A [`ClassCount`] for each class up to [`LARGE`], by [`class_index`].
pub(crate) struct SmallCounts(pub(crate) Vec<ClassCount>);

impl Default for SmallCounts {
    fn default() -> Self {
        SmallCounts(vec![ClassCount::default(); SMALL_CLASSES])
    }
}
