//! An arena-wide random test with a full audit of the arena after every
//! step: segments tiled, neighbours linked both ways, the index and the
//! table agreeing, the free set holding exactly the free blocks (bins,
//! bitmaps and the ordered set), the waiting lists exactly the waiting
//! blocks, and every byte count.

use std::collections::{HashMap, HashSet};

use super::super::arena::*;
use super::super::blocks::Blocks;
use super::super::freeset::{key, FreeSet, BIN_MAX, WORDS};
use super::super::quick::QUICK;
use crate::driver::DevicePtr;

const MIB: usize = 1 << 20;

/// The table and its index of segments agree (each first block is indexed,
/// and found again by address); vacant slots are exactly the empty ones.
/// The live blocks, by slot.
fn audit_blocks(b: &Blocks) -> Vec<(Slot, Info)> {
    let mut vacant = HashSet::new();
    for &v in &b.vacant {
        assert!(
            v != 0 && vacant.insert(v),
            "slot {v} vacant twice, or slot 0"
        );
        assert_eq!(b.table[v as usize].at, 0, "vacant slot {v} holds a block");
    }
    let mut live = Vec::new();
    for (s, i) in b.table.iter().enumerate().skip(1) {
        let s = s as Slot;
        match i.at {
            0 => assert!(vacant.contains(&s), "empty slot {s} not vacant"),
            at => {
                if i.prev == 0 {
                    assert_eq!(b.heads.get(&at), Some(&s), "first block {s} not indexed");
                }
                assert_eq!(b.slot(at), Some(s), "slot {s} at {at:#x} not found");
                live.push((s, *i));
            }
        }
    }
    let firsts = live.iter().filter(|(_, i)| i.prev == 0).count();
    assert_eq!(b.heads.len(), firsts, "index entries without a segment");
    live
}

/// Every block in the free set, (kind, tag, size, slot), checking its
/// bins, bitmaps, ordered set and byte counts against `blocks`.
fn audit_free(f: &FreeSet, blocks: &Blocks) -> Vec<(Kind, Tag, usize, Slot)> {
    let mut out = Vec::new();
    for &(k, t, size, at, s) in &f.big {
        let i = &blocks[s];
        assert!(
            size > BIN_MAX && (i.at, i.size, i.kind) == (at, size, k),
            "big key of {s}"
        );
        out.push((k, t, size, s));
    }
    let mut heads = 0;
    for m in &f.maps {
        for w in 0..WORDS {
            let summary = m.summary[w / 64] >> (w % 64) & 1 == 1;
            assert_eq!(m.words[w] != 0, summary, "summary word of {w}");
            let mut bits = m.words[w];
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let size = (w * 64 + b + 1) * MIN_BLOCK;
                let head = f.heads.get(&key(m.kind, m.tag, size));
                let (mut s, mut prev) = (*head.expect("a set bit has a head"), 0);
                heads += 1;
                while s != 0 {
                    let i = &blocks[s];
                    assert_eq!(
                        (i.bin_prev, i.size, i.kind),
                        (prev, size, m.kind),
                        "bin {size}"
                    );
                    out.push((m.kind, m.tag, size, s));
                    (prev, s) = (s, i.bin_next);
                    assert!(out.len() <= blocks.table.len(), "a bin's list loops");
                }
            }
        }
    }
    assert_eq!(heads, f.heads.len(), "heads without a bit");
    assert_eq!(
        f.bytes,
        out.iter().map(|x| x.2).sum::<usize>(),
        "free bytes"
    );
    let any = out
        .iter()
        .filter(|x| x.1 == ANY)
        .map(|x| x.2)
        .sum::<usize>();
    assert_eq!(f.any_bytes, any, "free bytes anyone may use");
    out
}

/// Every invariant of `a`, which holds `segments` (base, size, kind).
fn audit(a: &Arena, segments: &[(DevicePtr, usize, Kind)]) {
    let live = audit_blocks(&a.blocks);
    let mut visited = 0;
    for &(base, size, kind) in segments {
        let mut s = a.blocks.slot(base).expect("a segment's first block");
        let (mut prev, mut at, mut last) = (0, base, None);
        while s != 0 {
            let i = &a.blocks[s];
            assert_eq!(
                (i.at, i.prev, i.kind),
                (at, prev, kind),
                "tiling at slot {s}"
            );
            assert!(i.size >= MIN_BLOCK && i.size.is_multiple_of(MIN_BLOCK));
            if let (Some(State::Free(x)), State::Free(y)) = (last, i.state) {
                assert!(merged(x, y).is_none(), "free neighbours {x} {y} unmerged");
            }
            (last, at, prev, s) = (Some(i.state), at + i.size as u64, s, i.next);
            visited += 1;
        }
        assert_eq!(at, base + size as u64, "segment {base:#x} tiles");
    }
    assert_eq!(visited, live.len(), "blocks outside segments");
    let mut free = audit_free(&a.free, &a.blocks);
    free.sort();
    let mut want: Vec<_> = live
        .iter()
        .filter_map(|&(s, i)| match i.state {
            State::Free(t) => Some((i.kind, t, i.size, s)),
            _ => None,
        })
        .collect();
    want.sort();
    assert_eq!(free, want, "the free set is the free blocks");
    let mut listed = HashMap::<Slot, usize>::new();
    let size = |s: &Slot| a.blocks[*s].size;
    assert_eq!(a.pending.iter().map(size).sum::<usize>(), a.pending_bytes);
    let mut sealed = 0;
    for (n, b) in a.sealed.iter().enumerate() {
        assert!(n == 0 || b.seq > a.sealed[n - 1].seq, "batches in order");
        assert_eq!(
            b.blocks.iter().map(size).sum::<usize>(),
            b.bytes,
            "a batch's bytes"
        );
        sealed += b.bytes;
    }
    assert_eq!(sealed, a.sealed_bytes, "sealed bytes");
    let large: usize = a
        .pending
        .iter()
        .chain(a.sealed.iter().flat_map(|b| &b.blocks))
        .filter(|&&s| a.blocks[s].kind == Kind::Large)
        .map(size)
        .sum();
    assert_eq!(large, a.waiting_large, "large waiting bytes");
    for &s in a
        .pending
        .iter()
        .chain(a.sealed.iter().flat_map(|b| &b.blocks))
    {
        *listed.entry(s).or_default() += 1;
    }
    assert!(listed.values().all(|&c| c == 1), "a block waits twice");
    let waiting: HashSet<Slot> = live
        .iter()
        .filter(|(_, i)| i.state == State::Waiting)
        .map(|&(s, _)| s)
        .collect();
    assert_eq!(
        listed.keys().copied().collect::<HashSet<_>>(),
        waiting,
        "waiting lists"
    );
    let quick: HashSet<Slot> = a.quick.iter().copied().collect();
    assert_eq!(
        quick.len(),
        a.quick.len(),
        "a block twice on the quick list"
    );
    assert!(a.quick.len() <= QUICK, "the quick list's length");
    assert_eq!(a.quick.iter().map(size).sum::<usize>(), a.quick_bytes);
    let marked = live.iter().filter(|(_, i)| i.state == State::Quick);
    assert_eq!(
        marked.map(|&(s, _)| s).collect::<HashSet<_>>(),
        quick,
        "the quick list is the blocks marked so"
    );
}

/// A xorshift generator: the same steps for a seed on every host.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A request size: small granules, any small size, large sizes, and sizes
/// at the exact bins' edge ([`BIN_MAX`]).
fn size_of(r: &mut Rng) -> usize {
    match r.below(8) {
        0..=2 => 512 * (1 + r.below(16)),
        3 => 1 + r.below(SMALL_MAX),
        4 => SMALL_MAX + 1 + r.below(40 * MIB),
        5 => BIN_MAX - 512 * r.below(3),
        6 => BIN_MAX + 512 * r.below(3),
        _ => SMALL_MAX + 512 * r.below(64),
    }
}

/// `steps` random steps on one arena (`calm`: fewer segments taken out),
/// audited after each; how many of each kind ran.
fn run(seed: u64, steps: usize, calm: bool) -> [usize; 7] {
    let mut r = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    let mut a = Arena::default();
    let mut segs: Vec<(DevicePtr, usize, Kind)> = Vec::new();
    let mut next_base: DevicePtr = 1 << 40;
    let mut used: HashMap<DevicePtr, usize> = HashMap::new();
    let mut claimed: Vec<(DevicePtr, usize)> = Vec::new();
    let mut stale: Vec<DevicePtr> = Vec::new();
    let (mut seq, mut done) = (0u64, 0u64);
    let tags = [ANY, 1, 2, 3];
    let mut c = [0usize; 7];
    for step in 0..steps {
        let op = r.below(100);
        let ctx = format!("seed {seed} step {step} op {op}");
        match op {
            0..=5 if segs.len() < if calm { 30 } else { 12 } => {
                let (size, kind) = match r.below(6) {
                    0 | 1 => (2 * MIB, Kind::Small),
                    2 => (20 * MIB, Kind::Large),
                    3 => (BIN_MAX, Kind::Large),
                    4 => (BIN_MAX + 2 * MIB, Kind::Large),
                    _ => (80 * MIB, Kind::Large),
                };
                a.add_segment(next_base, size, kind);
                segs.push((next_base, size, kind));
                next_base += 1 << 30;
            }
            6..=35 => {
                let tag = tags[r.below(4)];
                let want = round(size_of(&mut r));
                let quick =
                    |s: &Slot| a.blocks[*s].size == want && a.blocks[*s].kind == Kind::of(want);
                let newest = a
                    .quick
                    .iter()
                    .rev()
                    .find(|s| quick(s))
                    .map(|&s| a.blocks[s].at);
                if let Some((p, n)) = a.take(tag, want) {
                    assert!(n >= want, "{ctx}");
                    if let (ANY, Some(q)) = (tag, newest) {
                        assert_eq!(
                            (p, n),
                            (q, want),
                            "{ctx}: the quick list's newest fit, whole"
                        );
                        c[6] += 1;
                    }
                    assert!(used.insert(p, n).is_none(), "{ctx}: handed out twice");
                    c[0] += 1;
                    if n > BIN_MAX {
                        c[1] += 1;
                    }
                }
            }
            36..=65 if !used.is_empty() => {
                // Sorted: a run is its seed's alone (a map's order is not).
                let mut keys: Vec<_> = used.keys().copied().collect();
                keys.sort_unstable();
                let p = keys[r.below(keys.len())];
                let n = used.remove(&p).unwrap();
                let s = a
                    .used_at(0, p)
                    .unwrap_or_else(|| panic!("{ctx}: live block not used"));
                assert_eq!(a.blocks[s].size, n, "{ctx}");
                stale.push(p);
                if r.below(2) == 0 {
                    a.free_slot(s, tags[r.below(4)]);
                } else {
                    a.wait_slot(s);
                    if a.has_sealed() {
                        a.promote(done);
                    }
                    if !a.has_sealed() || a.pending_count() >= 4 || r.below(4) == 0 {
                        seq += r.below(2) as u64;
                        seq = seq.max(1);
                        a.seal(seq);
                    }
                }
            }
            66..=69 => {
                seq += 1;
                a.seal(seq);
            }
            70..=75 => {
                done = done + r.below((seq - done) as usize + 1) as u64;
                a.promote(done);
            }
            76..=78 => {
                if let Some((p, n, _)) = a.claim_waiting(round(size_of(&mut r)), usize::MAX) {
                    assert!(!used.contains_key(&p), "{ctx}");
                    claimed.push((p, n));
                    c[2] += 1;
                }
            }
            79..=81 if !claimed.is_empty() => {
                let (p, n) = claimed.swap_remove(r.below(claimed.len()));
                if r.below(2) == 0 {
                    if a.take_claimed(p).is_some() {
                        assert!(used.insert(p, n).is_none(), "{ctx}");
                        c[3] += 1;
                    }
                } else {
                    a.unclaim(p);
                }
            }
            82..=83 => a.wait_all_tagged(),
            84..=88 if !calm || r.below(15) == 0 => {
                let pick: Vec<(DevicePtr, usize)> = segs
                    .iter()
                    .filter(|_| r.below(2) == 0)
                    .map(|&(b, s, _)| (b, s))
                    .collect();
                let waiting = r.below(2) == 0;
                let gone = a.take_free_segments(&pick, waiting);
                for b in gone {
                    let i = segs.iter().position(|x| x.0 == b).unwrap();
                    let (base, size, kind) = segs.swap_remove(i);
                    c[4] += 1;
                    let end = base + size as u64;
                    assert!(
                        !used.keys().any(|&p| p >= base && p < end),
                        "{ctx}: a segment with a used block taken"
                    );
                    assert!(
                        !claimed.iter().any(|&(p, _)| p >= base && p < end),
                        "{ctx}: a segment with a claimed block taken"
                    );
                    if r.below(3) == 0 {
                        a.add_waiting_segment(base, size, kind);
                        segs.push((base, size, kind));
                    }
                }
            }
            89 if r.below(20) == 0 => {
                a.forget_all();
                stale.extend(used.drain().map(|(p, _)| p));
                segs.clear();
            }
            90..=99 if !stale.is_empty() => {
                let p = stale[r.below(stale.len())];
                if !used.contains_key(&p) {
                    assert!(
                        a.used_at(0, p).is_none(),
                        "{ctx}: stale block {p:#x} accepted"
                    );
                    c[5] += 1;
                }
            }
            _ => {}
        }
        audit(&a, &segs);
        for (&p, &n) in &used {
            let s = a
                .used_at(0, p)
                .unwrap_or_else(|| panic!("{ctx}: live {p:#x} lost"));
            assert_eq!(a.blocks[s].size, n, "{ctx}");
        }
        for &(p, n) in &claimed {
            if let Some(i) = a.blocks.get(p) {
                if segs.iter().any(|s| p >= s.0 && p < s.0 + s.1 as u64) {
                    assert_eq!(i.state, State::Claimed, "{ctx}");
                    assert_eq!(i.size, n, "{ctx}");
                }
            }
        }
    }
    c
}

#[test]
fn random_steps_keep_every_invariant_of_the_arena() {
    // More with GPUPTR_FUZZ_SEEDS / GPUPTR_FUZZ_STEPS (720,000 steps passed).
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (seeds, steps) = (
        env("GPUPTR_FUZZ_SEEDS", 3) as u64,
        env("GPUPTR_FUZZ_STEPS", 1000),
    );
    let mut ran = [0; 7];
    for seed in 1..=seeds {
        for calm in [false, true] {
            ran.iter_mut()
                .zip(run(seed, steps, calm))
                .for_each(|(t, n)| *t += n);
        }
    }
    // Each kind of step ran: takes, takes over BIN_MAX, claims, claims
    // taken, segments taken out, stale releases refused, quick-list takes.
    assert!(ran.iter().all(|&n| n > 0), "steps run: {ran:?}");
}

/// Waiting blocks of a segment taken out leave their batches before their
/// slots are reused by a new segment; a later promotion frees only the
/// remaining segment's blocks.
#[test]
fn slots_of_a_segment_taken_out_are_not_promoted_once_reused() {
    let mut a = Arena::default();
    let (x, y, z) = (1u64 << 40, 2u64 << 40, 3u64 << 40);
    a.add_segment(x, 4 * 4096, Kind::Small);
    let px: Vec<_> = (0..4).map(|_| a.take(ANY, 4096).unwrap().0).collect();
    a.add_segment(y, 2 * MIB, Kind::Small);
    let py: Vec<_> = (0..4).map(|_| a.take(ANY, 4096).unwrap().0).collect();
    assert!(px.iter().all(|&p| p >= x && p < y) && py.iter().all(|&p| p >= y));
    for &p in &px[..2] {
        a.wait(p);
    }
    a.seal(1);
    for &p in &px[2..] {
        a.wait(p);
    }
    for &p in &py {
        a.free(p, 7);
    }
    a.wait_all_tagged();
    a.seal(2);
    // x: 4 waiting + rest free; y: 4 waiting (tagged) + rest free.
    let segs = [(x, 4 * 4096, Kind::Small), (y, 2 * MIB, Kind::Small)];
    audit(&a, &segs);
    assert_eq!(a.take_free_segments(&[(x, 4 * 4096)], true), vec![x]);
    let segs = [(y, 2 * MIB, Kind::Small), (z, 2 * MIB, Kind::Small)];
    a.add_segment(z, 2 * MIB, Kind::Small);
    let pz: Vec<_> = (0..6).map(|_| a.take(ANY, 4096).unwrap().0).collect();
    audit(&a, &segs);
    assert!(a.promote(2));
    audit(&a, &segs);
    for &p in &pz {
        assert!(
            a.used_at(0, p).is_some(),
            "z's block {p:#x} freed by a stale batch slot"
        );
    }
    assert_eq!(a.segment_blocks(y, 2 * MIB).len(), 1);
}
