//! Size classes and their dense index.

use super::super::class::*;

#[test]
fn class_indexes_are_dense_and_round_trip() {
    let mut seen = std::collections::HashSet::new();
    let mut size = 1;
    while size <= LARGE {
        let c = size_class(size);
        let i = class_index(c).unwrap();
        assert!(i < SMALL_CLASSES, "{c} -> {i}");
        assert_eq!(class_of_index(i), c);
        seen.insert(i);
        size += size / 9 + 1;
    }
    assert_eq!(seen.len(), SMALL_CLASSES, "every slot is used");
    assert_eq!(class_index(size_class(LARGE + 1)), None);
}

#[test]
fn size_classes_round_up_with_bounded_waste() {
    assert_eq!(size_class(1), 512);
    assert_eq!(size_class(512), 512);
    assert_eq!(size_class(513), 640);
    assert_eq!(size_class(1 << 20), 1 << 20);
    assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 18));
    assert_eq!(size_class((256 << 20) + 1), (256 << 20) + (2 << 20));
    for s in [600usize, 1000, 4097, 123_457, 9_999_999, 300 << 20] {
        let c = size_class(s);
        assert!(c >= s && (c - s) * 4 <= s.max(2 << 20), "{s} -> {c}");
    }
}
