//! The arena alone: best fit, splits, merges and tags, with no driver.

use super::super::arena::BlockState;
use super::super::arena::*;
use crate::driver::DevicePtr;

const MIB: usize = 1 << 20;

fn arena_with(base: DevicePtr, size: usize) -> Arena {
    let mut a = Arena::default();
    a.add_segment(base, size, Kind::of(size.min(SMALL_MAX)));
    a
}

/// Every block of the segment at `base`: sizes tile it, links agree.
fn check_tiles(a: &mut Arena, base: DevicePtr, size: usize) {
    let blocks = a.segment_blocks(base, size);
    let total: usize = blocks.iter().map(|b| b.1).sum();
    assert_eq!(total, size, "blocks tile the segment: {blocks:?}");
    for w in blocks.windows(2) {
        assert_eq!(w[0].0 + w[0].1 as u64, w[1].0);
        assert_eq!(
            a.blocks.get(w[1].0).unwrap().prev,
            a.blocks.slot(w[0].0).unwrap()
        );
    }
    // No two neighbours free for the same tag (they would have merged).
    for w in blocks.windows(2) {
        let (x, y) = (
            a.blocks.get(w[0].0).unwrap().state,
            a.blocks.get(w[1].0).unwrap().state,
        );
        if let (State::Free(s), State::Free(t)) = (x, y) {
            assert!(merged(s, t).is_none(), "{x:?} and {y:?} should have merged");
        }
    }
}

#[test]
fn a_small_request_splits_and_the_free_merges_the_segment_back() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (p, n) = a.take(ANY, 4096).unwrap();
    assert_eq!((p, n), (1 << 32, 4096));
    let (q, _) = a.take(ANY, 8192).unwrap();
    assert_eq!(q, (1 << 32) + 4096, "the rest of the split serves the next");
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    a.free(p, ANY);
    a.free(q, ANY);
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    assert_eq!(
        a.segment_blocks(1 << 32, 2 * MIB).len(),
        1,
        "one block again"
    );
    assert_eq!(a.free_bytes(), 2 * MIB);
}

#[test]
fn best_fit_takes_the_smallest_block_that_fits() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let blocks: Vec<_> = [1024, 4096, 2048, 8192, 512]
        .iter()
        .map(|&n| a.take(ANY, n).unwrap().0)
        .collect();
    // Free the 4096 and the 8192 (not neighbours: a 2048 lies between).
    a.free(blocks[1], ANY);
    a.free(blocks[3], ANY);
    let (p, _) = a.take(ANY, 3000 / 512 * 512 + 512).unwrap();
    assert_eq!(p, blocks[1], "the 4096-byte hole, not the 8192 one");
    check_tiles(&mut a, 1 << 32, 2 * MIB);
}

#[test]
fn a_large_block_keeps_a_rest_of_one_mib_or_less_whole() {
    let mut a = Arena::default();
    a.add_segment(1 << 32, 20 * MIB, Kind::Large);
    let (_, n) = a.take(ANY, 19 * MIB + MIB / 2).unwrap();
    assert_eq!(n, 20 * MIB, "a 0.5 MiB rest is not split off");
    let mut b = Arena::default();
    b.add_segment(1 << 32, 20 * MIB, Kind::Large);
    let (_, n) = b.take(ANY, 18 * MIB).unwrap();
    assert_eq!(n, 18 * MIB, "a 2 MiB rest is");
}

#[test]
fn small_and_large_requests_never_share_a_segment() {
    let mut a = Arena::default();
    a.add_segment(1 << 32, 20 * MIB, Kind::Large);
    assert_eq!(
        a.take(ANY, 4096),
        None,
        "a small request needs a small segment"
    );
    a.add_segment(2 << 32, 2 * MIB, Kind::Small);
    assert_eq!(
        a.take(ANY, 2 * MIB).map(|b| b.0),
        Some(1 << 32),
        "not the small one"
    );
    assert_eq!(a.take(ANY, 4096).map(|b| b.0), Some(2 << 32));
}

#[test]
fn a_block_freed_on_a_stream_serves_that_stream_only() {
    let (s, t) = (0x1000, 0x2000);
    let mut a = Arena::default();
    a.add_segment(1 << 32, 20 * MIB, Kind::Large);
    let (p, _) = a.take(s, 20 * MIB).unwrap();
    a.free(p, s);
    assert_eq!(a.take(t, 2 * MIB), None, "another stream waits for a fence");
    assert_eq!(
        a.take(ANY, 2 * MIB),
        None,
        "so does an owner with no stream"
    );
    assert_eq!(
        a.take(s, 2 * MIB).map(|x| x.0),
        Some(p),
        "its own stream at once"
    );
}

#[test]
fn memory_anyone_may_use_merges_into_a_streams_block() {
    let s = 0x1000;
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (p, _) = a.take(s, 4096).unwrap();
    // The rest of the segment is fresh memory, free for anyone.
    assert_eq!(a.free_any_bytes(), 2 * MIB - 4096);
    a.free(p, s);
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    assert_eq!(a.segment_blocks(1 << 32, 2 * MIB).len(), 1);
    assert_eq!(
        a.free_any_bytes(),
        0,
        "the whole segment is the stream's now"
    );
    assert_eq!(a.take(ANY, MIB), None, "no longer anyone's");
    assert!(a.take(s, MIB).is_some(), "the stream's");
}

#[test]
fn two_streams_blocks_never_merge() {
    let (s, t) = (0x1000, 0x2000);
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (p, _) = a.take(s, MIB).unwrap();
    let (q, _) = a.take(t, MIB).unwrap();
    a.free(p, s);
    a.free(q, t);
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    assert_eq!(a.segment_blocks(1 << 32, 2 * MIB).len(), 2);
    a.wait_all_tagged();
    a.seal(1);
    assert_eq!(a.take(s, 4096), None, "both wait for the fence");
    a.promote(1);
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    assert_eq!(
        a.segment_blocks(1 << 32, 2 * MIB).len(),
        1,
        "after a fence they do"
    );
    assert_eq!(a.free_any_bytes(), 2 * MIB);
}

#[test]
fn a_block_freed_without_a_stream_waits_for_its_fence() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (p, _) = a.take(ANY, MIB).unwrap();
    let (q, _) = a.take(ANY, MIB).unwrap();
    a.wait(p);
    a.wait(q);
    assert_eq!(a.take(ANY, 4096), None, "pending");
    a.seal(7);
    assert!(!a.promote(6), "its fence is not done");
    assert_eq!(a.take(ANY, 4096), None, "sealed");
    assert_eq!(
        a.take_free_segments(&[(1 << 32, 2 * MIB)], false),
        Vec::<DevicePtr>::new(),
        "waiting is not free"
    );
    assert!(a.promote(7));
    assert_eq!(a.take(ANY, 4096).map(|x| x.0), Some(p));
}

#[test]
fn a_claim_takes_a_waiting_block_of_its_kind_within_its_bounds_only() {
    let mut a = Arena::default();
    a.add_segment(1 << 32, 20 * MIB, Kind::Large);
    let (big, _) = a.take(ANY, 8 * MIB).unwrap();
    let (mid, _) = a.take(ANY, 3 * MIB).unwrap();
    a.wait(big);
    a.wait(mid);
    assert_eq!(
        a.claim_waiting(2 * MIB, usize::MAX),
        None,
        "pending: not sealed"
    );
    a.seal(3);
    assert_eq!(
        a.claim_waiting(4 * MIB, 5 * MIB),
        None,
        "8 MiB is too large, 3 too small"
    );
    assert_eq!(
        a.claim_waiting(MIB, usize::MAX),
        None,
        "a small request: no large block"
    );
    assert_eq!(a.claim_waiting(2 * MIB, 4 * MIB), Some((mid, 3 * MIB, 3)));
    assert_eq!(
        a.waiting_bytes(),
        8 * MIB,
        "the claimed block left its batch"
    );
    assert!(a.promote(3));
    assert_eq!(a.take_claimed(mid).map(|s| a.blocks[s].at), Some(mid));
    assert_eq!(a.take_claimed(big), None, "never claimed");
}

#[test]
fn whole_free_segments_are_taken_out_and_others_stay() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    a.add_segment(2 << 32, 2 * MIB, Kind::Small);
    let segs = [(1u64 << 32, 2 * MIB), (2u64 << 32, 2 * MIB)];
    let (p, _) = a.take(ANY, 4096).unwrap();
    let q = a.take(ANY, 8192).unwrap().0;
    a.wait(q);
    let bases = a.take_free_segments(&segs, false);
    let other = if p >> 32 == 1 { 2 << 32 } else { 1 << 32 };
    assert_eq!(bases, vec![other]);
    assert_eq!(a.free_bytes(), 2 * MIB - 4096 - 8192);
    a.free(p, 0x1000);
    assert_eq!(
        a.take_free_segments(&segs, false),
        Vec::<DevicePtr>::new(),
        "a block waits"
    );
    assert_eq!(
        a.take_free_segments(&segs, true).len(),
        1,
        "unless waiting counts"
    );
    assert_eq!((a.free_bytes(), a.waiting_bytes()), (0, 0));
    assert!(a.blocks.is_empty());
}

#[test]
fn used_block_at_finds_only_blocks_handed_out() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (p, n) = a.take(ANY, 8192).unwrap();
    assert_eq!(a.used_block_at(1 << 32, p + 100), Some((p, n)));
    assert_eq!(a.used_block_at(1 << 32, p + 8192), None, "the free rest");
    a.free(p, ANY);
    assert_eq!(a.used_block_at(1 << 32, p), None);
}

/// Random takes and frees on three tags keep the segment tiled, the
/// byte counts exact, and end as one free block.
#[test]
fn random_churn_keeps_the_books() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let mut used: Vec<(DevicePtr, Tag)> = Vec::new();
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let r = next();
        let tag = [ANY, 0x1000, 0x2000][(r % 3) as usize];
        if r & 8 == 0 || used.is_empty() {
            let size = round(((r >> 8) % 65536) as usize + 1);
            if let Some((p, _)) = a.take(tag, size) {
                used.push((p, tag));
            }
        } else {
            let i = (r >> 8) as usize % used.len();
            let (p, t) = used.swap_remove(i);
            a.free(p, t);
        }
        let in_use: usize = a
            .segment_blocks(1 << 32, 2 * MIB)
            .iter()
            .filter(|b| b.2 == BlockState::Used)
            .map(|b| b.1)
            .sum();
        assert_eq!(in_use + a.free_bytes(), 2 * MIB);
    }
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    for (p, t) in used {
        a.free(p, t);
    }
    a.wait_all_tagged();
    a.seal(1);
    a.promote(1);
    assert_eq!(a.segment_blocks(1 << 32, 2 * MIB).len(), 1);
    assert_eq!(a.free_any_bytes(), 2 * MIB);
}

/// `sizes` taken without a stream from a fresh 2 MiB segment at `base`,
/// then freed without a stream and their fence run: they sit on the quick
/// list. Their addresses.
fn fenced(a: &mut Arena, sizes: &[usize]) -> Vec<DevicePtr> {
    let got: Vec<_> = sizes.iter().map(|&n| a.take(ANY, n).unwrap().0).collect();
    for &p in &got {
        a.wait(p);
    }
    a.seal(1);
    assert!(a.promote(1));
    got
}

#[test]
fn a_fenced_block_is_taken_back_whole_by_a_request_of_its_size() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let got = fenced(&mut a, &[4096, 8192, 4096]);
    assert_eq!(a.quick.len(), 3, "whole, on the quick list");
    assert_eq!(a.free_bytes(), 2 * MIB, "counted as free");
    assert_eq!(a.free_any_bytes(), 2 * MIB, "for anyone");
    // Four blocks still (three whole, the rest): nothing merged or split.
    assert_eq!(a.blocks.iter().count(), 4);
    assert_eq!(
        a.take(ANY, 4096),
        Some((got[2], 4096)),
        "the newest of its size"
    );
    assert_eq!(a.take(ANY, 8192), Some((got[1], 8192)));
    assert_eq!(a.take(ANY, 4096), Some((got[0], 4096)));
    assert!(a.quick.is_empty());
    assert_eq!(a.blocks.iter().count(), 4, "no split either");
}

#[test]
fn a_request_of_another_size_merges_the_quick_list_first() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    fenced(&mut a, &[4096, 8192]);
    // 12 KiB is on the list only in two pieces: merged, the segment is one
    // block again, and best fit cuts it from the start.
    assert_eq!(a.take(ANY, 12288), Some((1 << 32, 12288)));
    assert!(a.quick.is_empty());
    assert_eq!(a.quick_bytes, 0);
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    assert_eq!(a.free_bytes(), 2 * MIB - 12288);
}

#[test]
fn a_streams_request_never_takes_from_the_quick_list() {
    let s = 0x1000;
    let mut a = arena_with(1 << 32, 2 * MIB);
    let got = fenced(&mut a, &[4096, 4096]);
    // From the list it would be the newest, got[1]; merged, best fit cuts
    // the segment from its start.
    let (p, _) = a.take(s, 4096).unwrap();
    assert!(a.quick.is_empty(), "the list merged first");
    assert_eq!(p, got[0], "best fit on the merged segment: its start");
    a.free(p, s);
    assert_eq!(a.take(s, 4096), Some((p, 4096)), "the stream's own block");
}

#[test]
fn a_quick_block_serves_only_its_own_kind() {
    // A whole small segment waits (a failed free brings it back so) and
    // reaches the list: 2 MiB, the size of a large request of 2 MiB.
    let mut a = Arena::default();
    a.add_waiting_segment(1 << 32, 2 * MIB, Kind::Small);
    a.seal(1);
    assert!(a.promote(1));
    assert_eq!(a.quick.len(), 1);
    assert_eq!(
        a.take(ANY, 2 * MIB),
        None,
        "a large request, no large block"
    );
    assert_eq!(a.take(ANY, MIB), Some((1 << 32, MIB)), "a small one fits");
}

/// The block handed out at `at` freed without a stream and its fence run:
/// it joins the quick list.
fn to_quick_list(a: &mut Arena, at: DevicePtr) {
    a.wait(at);
    a.seal(1);
    assert!(a.promote(1));
}

#[test]
fn a_free_on_a_stream_merges_the_quick_list_as_the_fence_would_have() {
    // x, q, y side by side; y freed on s2, q fenced (on the list), then x
    // freed on s1: eagerly, q merged into y's block (s2) when its fence
    // ended, and x stays alone on s1.
    let (s1, s2) = (0x1000, 0x2000);
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (x, _) = a.take(ANY, 4096).unwrap();
    let (q, _) = a.take(ANY, 4096).unwrap();
    let (y, _) = a.take(ANY, 4096).unwrap();
    a.free(y, s2);
    to_quick_list(&mut a, q);
    a.free(x, s1);
    assert!(a.quick.is_empty());
    let first = a.blocks.get(x).unwrap();
    assert_eq!((first.size, first.state), (4096, State::Free(s1)));
    let rest = a.blocks.get(q).unwrap();
    assert_eq!((rest.size, rest.state), (2 * MIB - 4096, State::Free(s2)));
}

#[test]
fn wait_all_tagged_merges_the_quick_list_first() {
    // q on the list beside t, free on a stream: eagerly they were one
    // block of the stream's, which waits as a whole.
    let t = 0x1000;
    let mut a = arena_with(1 << 32, 2 * MIB);
    let (q, _) = a.take(ANY, 4096).unwrap();
    let (p, _) = a.take(ANY, 4096).unwrap();
    a.free(p, t);
    to_quick_list(&mut a, q);
    a.wait_all_tagged();
    assert!(a.quick.is_empty());
    assert_eq!(a.blocks.get(q).unwrap().state, State::Waiting);
    assert_eq!(a.waiting_bytes(), 2 * MIB, "the whole segment, one block");
}

#[test]
fn the_quick_list_keeps_at_most_its_length_and_merges_the_oldest() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    let n = super::super::quick::QUICK + 3;
    let got = fenced(&mut a, &vec![4096; n]);
    assert_eq!(a.quick.len(), super::super::quick::QUICK);
    // The three freed first merged into one block at the segment's start.
    let first = a.blocks.get(got[0]).unwrap();
    assert_eq!((first.size, first.state), (3 * 4096, State::Free(ANY)));
    assert_eq!(a.free_bytes(), 2 * MIB);
    check_tiles(&mut a, 1 << 32, 2 * MIB);
    assert_eq!(
        a.blocks.iter().count(),
        1,
        "the segment one block again once the view merged"
    );
}

#[test]
fn a_trim_takes_out_a_segment_whose_blocks_are_on_the_quick_list() {
    let mut a = arena_with(1 << 32, 2 * MIB);
    fenced(&mut a, &[4096, 8192]);
    assert_eq!(
        a.take_free_segments(&[(1 << 32, 2 * MIB)], false),
        vec![1 << 32]
    );
    assert!(a.quick.is_empty() && a.blocks.is_empty());
    assert_eq!((a.free_bytes(), a.quick_bytes), (0, 0));
}
